"""Lesson 6 (data parallelism): the configurations the notebook runs and its claims tests check
(replicas against one process, the float16 wire's two averaging orders, one overflow decision, a
replica one bit off), then the checkers of its exercises: averaging on a float16 wire, the mean
over unequal shards, finding a replica that drifted. Reference solutions:
lessons/solutions/lesson06.py."""

from typing import Any, Callable

import numpy as np

from minimp import distributed as dist
from minimp import nn, optim
from minimp.lessons.checking import Report, expect
from minimp.lessons.lesson05 import _run
from minimp.parallel import DataParallel, ReplicaMismatchError
from minimp.train import TrainConfig, train

REPLICAS = 4  # simulated ranks of the notebook's runs
# A small MLP on the digits, fp32 so that the only difference between runs is the order of sums
EQUIVALENCE = TrainConfig(hidden=32, layers=2, batch_size=32, steps=20, precision="fp32",
                          log_every=1000)
# fp16 with the loss scaler; rank 2's gradients made non-finite at step 5; replicas compared
# after every step
ONE_DECISION = TrainConfig(hidden=32, layers=2, batch_size=32, steps=8, inject_overflow="5:2",
                           check_replicas=1, log_every=1000)
GRADIENT = 30000.0  # each replica's gradient: REPLICAS x 30000 = 120000 > 65504


def trained_weights(world_size: int, config: TrainConfig = EQUIVALENCE) -> dict:
    """Rank 0's float32 master weights after training `config` on world_size simulated replicas."""
    def rank(comm):
        return train(config, log=lambda line: None, comm=comm)

    return dist.simulate(world_size, rank)[0]["master_weights"]


def largest_relative_difference(one: dict, many: dict) -> float:
    """max over parameters of max |many - one| / max |one|."""
    return max(np.abs(many[name] - one[name]).max() / np.abs(one[name]).max() for name in one)


def average_on_float16_wire(comm: Any, when: str) -> np.ndarray:
    """DataParallel's average of GRADIENT on every rank, on a float16 wire, dividing by the
    number of replicas `when` ("before" or "after") the all-reduce."""
    with np.errstate(over="ignore"):  # this rank's thread: the "after" sum overflows on purpose
        parameters = [nn.Parameter(np.zeros(4, np.float32))]
        replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1), comm_dtype=np.float16,
                                average=when)
        gradients = [np.full(4, GRADIENT, np.float32)]
        replicas.reduce(gradients)  # in place
        return gradients[0]


def one_bit_off(comm: Any) -> str:
    """Replicas of 4 float32 weights of 1.0, rank 2's first weight moved to the next float32 up;
    what check_replicas says."""
    parameters = [nn.Parameter(np.ones(4, np.float32))]
    replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1))
    if comm.rank == 2:
        master = replicas.optimizer.master_weights[0]
        master[0] = np.nextafter(master[0], np.float32(2))  # the next float32 above 1.0
    try:
        replicas.check_replicas()
        return "identical"
    except ReplicaMismatchError as error:
        return str(error)


def check_average_gradients(average_gradients: Callable[[Any, np.ndarray], np.ndarray],
                            quiet: bool = False) -> Report:
    """average_gradients(comm, grad): the float32 mean of every rank's float32 gradient, sent as
    float16 through minimp's ring all-reduce, without overflowing where no gradient does."""
    report = Report("average_gradients", quiet)

    for p in (4, 3):

        @report.case(
            f"the mean of {p} ranks' gradients, float32, bit-identical on every rank",
            hint="divide by comm.size (not a fixed number of ranks) and sum with "
                 "dist.ring_allreduce(comm, wire) on a float16 `wire`, then .astype(np.float32)",
        )
        def _():
            grads = [np.random.default_rng(r).standard_normal(400).astype(np.float32)
                     for r in range(p)]
            results = _run(p, lambda comm: average_gradients(comm, grads[comm.rank].copy()))
            mean = np.mean(grads, axis=0)
            for rank, result in enumerate(results):
                dtype = np.asarray(result).dtype
                expect(dtype == np.float32, f"rank {rank} returned {dtype}")
                expect(np.allclose(result, mean, rtol=2e-3, atol=1e-3),
                       f"rank {rank}: off from the mean by up to "
                       f"{np.max(np.abs(result - mean)):.3g}")
                expect(np.array_equal(result, results[0]), f"rank {rank} differs from rank 0")

        @report.case(
            f"{p} ranks of 30000 each: the mean is 30000, not inf",
            hint=f"{p} x 30000 = {p * 30000} does not fit float16: divide by comm.size before "
                 "the sum",
        )
        def _():
            results = _run(p, lambda comm: average_gradients(comm,
                                                             np.full(8, 30000.0, np.float32)))
            # 30000 / 3 rounds to float16 and back: allow the float16 rounding of each share
            expect(np.allclose(np.asarray(results[0]), 30000.0, rtol=2e-3),
                   f"rank 0 returned {results[0]}")

    @report.case(
        "float16 on the wire: 2(p - 1)/p x 2 bytes per element per rank (ring, p = 4)",
        hint="cast to np.float16 before the all-reduce and use the ring",
    )
    def _():
        results = _run(4, lambda comm: average_gradients(comm, np.ones(4000, np.float32)))
        for rank in range(4):
            sent = sum(m.nbytes for m in results.trace if m.source == rank)
            expect(sent == 2 * 3 * 1000 * 2, f"rank {rank} sent {sent} bytes; the ring on a "
                   f"float16 wire sends {2 * 3 * 1000 * 2}")

    return report.finish()


def check_global_mean_gradient(global_mean_gradient: Callable[[Any, np.ndarray, int], np.ndarray],
                               quiet: bool = False) -> Report:
    """global_mean_gradient(comm, local_mean, count): the gradient of the mean loss over all
    samples, when rank r's shard has count_r samples and local_mean is its mean gradient."""
    report = Report("global_mean_gradient", quiet)
    hint = ("the mean over all samples weighs each shard by its size: sum_r count_r g_r / "
            "sum_r count_r (comm.allreduce_scalars([count], 'sum') gives the total count)")

    for counts in ((4, 4, 4), (1, 2, 5), (7, 1)):

        @report.case(f"shards of {counts} samples: one process's mean gradient", hint=hint)
        def _():
            rng = np.random.default_rng(sum(counts))
            per_sample = [rng.standard_normal((n, 6)) for n in counts]
            means = [g.mean(axis=0) for g in per_sample]
            results = _run(len(counts), lambda comm: global_mean_gradient(
                comm, means[comm.rank].copy(), counts[comm.rank]))
            want = np.concatenate(per_sample).mean(axis=0)
            mean_of_means = np.mean(means, axis=0)
            weighted_sum = sum(n * g for n, g in zip(counts, means))
            for rank, result in enumerate(results):
                result = np.asarray(result)
                expect(result.dtype == np.float64, f"rank {rank} returned {result.dtype}, not "
                       "float64 (the spec's dtype: float32 rounds the mean)")
                why = ""
                if np.allclose(result, mean_of_means) and not np.allclose(result, want):
                    why = ": that is the plain mean of the shards' means (weigh each by its count)"
                elif np.allclose(result, weighted_sum):
                    why = ": that is the sum over all samples (divide it by the total count)"
                expect(result.shape == want.shape and np.allclose(result, want, rtol=1e-9,
                                                                  atol=1e-12),
                       f"rank {rank} returned {np.round(result, 4)}, expected "
                       f"{np.round(want, 4)}{why}")

    return report.finish()


def check_drifted_replicas(drifted_replicas: Callable[[Any, np.ndarray], list],
                           quiet: bool = False) -> Report:
    """drifted_replicas(comm, weights): the ranks whose weights differ from rank 0's in any bit,
    the same list on every rank, without sending the weights around."""
    report = Report("drifted_replicas", quiet)
    base = np.random.default_rng(8).standard_normal(10000).astype(np.float32)

    def run(changes):
        replicas = [base.copy() for _ in range(4)]
        for rank, change in changes.items():
            change(replicas[rank])
        results = _run(4, lambda comm: drifted_replicas(comm, replicas[comm.rank]))
        return [list(r) for r in results], results.trace

    def nudge(w):
        w[1234] = np.nextafter(w[1234], np.float32(np.inf))  # one bit of one weight

    cases = [
        ("identical replicas: []", {}, []),
        ("rank 2 off by one bit in one weight: [2]", {2: nudge}, [2]),
        ("ranks 1 and 3 differ: [1, 3]", {1: nudge, 3: lambda w: w.__setitem__(0, 0.0)}, [1, 3]),
        ("NaN in the same place everywhere: identical, []",
         {r: (lambda w: w.__setitem__(5, np.nan)) for r in range(4)}, []),
        ("rank 2 holds NaN where the others hold 0.0: [2]",
         {r: (lambda w, r=r: w.__setitem__(5, np.nan if r == 2 else 0.0)) for r in range(4)},
         [2]),
        ("rank 3 holds two weights swapped: [3]",
         {3: lambda w: w.__setitem__([10, 11], w[[11, 10]])}, [3]),
        ("0.0 against -0.0: different bits, [1]",
         {0: lambda w: w.__setitem__(7, 0.0), 1: lambda w: w.__setitem__(7, -0.0),
          2: lambda w: w.__setitem__(7, 0.0), 3: lambda w: w.__setitem__(7, 0.0)}, [1]),
    ]
    for description, changes, want in cases:

        @report.case(description, hint="compare bits, not values (NaN != NaN, 0.0 == -0.0; "
                     "nan_to_num hides a NaN), and in order (a sum of values or of bytes misses "
                     "two weights swapped): a "
                     "checksum of weights.tobytes() (zlib.crc32) per rank, gathered with "
                     "comm.allreduce_scalars")
        def _():
            results, _ = run(changes)
            for rank, result in enumerate(results):
                expect(result == want, f"rank {rank} returned {result}, expected {want} (the "
                       "same list on every rank)")

    @report.case(
        "the messages carry far less than the weights (10,000 float32 = 40,000 bytes)",
        hint="send a checksum, not the array",
    )
    def _():
        _, trace = run({2: nudge})
        total = sum(m.nbytes for m in trace)
        expect(total < base.nbytes, f"{total} bytes went over the wire")

    return report.finish()


EXERCISES = [
    ("average_gradients", check_average_gradients),
    ("global_mean_gradient", check_global_mean_gradient),
    ("drifted_replicas", check_drifted_replicas),
]
