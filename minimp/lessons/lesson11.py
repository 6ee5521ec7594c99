"""Lesson 11 (who holds what): the runs that the lesson, its claims test
(tests/lessons/test_lesson11.py) and its checkers share, and the checkers of its exercises: the
bytes a rank holds in each ZeRO stage, stage 1's update from the ring's two halves, the bytes a
rank sends in a step. Reference solutions: lessons/solutions/lesson11.py."""

import functools
import time
from typing import Any, Callable

import numpy as np

from minimp import Tensor, nn, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_shakespeare, text_batch
from minimp.distributed import all_gather, chunk_bounds, reduce_scatter, simulate
from minimp.lessons.checking import Report, call, expect
from minimp.lessons.lesson05 import _run
from minimp.models.gpt import GPT, GPTConfig
from minimp.parallel import DataParallel, zero_data_parallel
from minimp.parallel.zero.formulas import bytes_sent_formula, memory_formula
from minimp.precision import NoLossScaler, mixed_precision_step
from minimp.train import TrainConfig, train
from minimp.train.sizes import zero_unit_sizes

# ----- the lesson's runs ------------------------------------------------------------------------
# docs/zero.md's MLP (8 hidden layers of 256 on the digits, fp16, Adam) for 2 steps. Overlap off:
# with it (the trainer's default) each ring runs during backward with buffers of its own, and the
# peak inside a step depends on the threads' timing; without it the peak is peak_formula's, on every
# rank and every run. A batch of 48 divides by the checkers' 3 ranks x 2 micro-batches as well as
# by the lesson's 1, 2 and 4 ranks (x 2).
MLP = dict(hidden=256, layers=8, batch_size=48, steps=2, log_every=1000, threads=1, overlap=False)
# The same trainer, smaller and in float32, 10 steps: where ZeRO ends on the bits of --zero 0.
SAME_TRAINING = {**MLP, "hidden": 32, "layers": 2, "steps": 10, "precision": "fp32"}
KINDS = ("parameters", "accumulators", "masters", "optimizer_state", "buffers")


def mlp_config(**flags: Any) -> TrainConfig:
    """The lesson's MLP run with these flags changed (zero=2, micro_batches=2, ...)."""
    return TrainConfig(**{**MLP, **flags})


def simulated(world_size: int, **flags: Any) -> list[dict]:
    """Every rank's result of the lesson's MLP run on `world_size` simulated ranks, without the
    weights (the bytes are what the lesson reads). Cached: a run's bytes are the same every time,
    and the lesson, its test and its checkers read the same runs (so read them, never change
    them)."""
    return _simulated(world_size, tuple(sorted(flags.items())))


@functools.lru_cache(maxsize=None)
def _simulated(world_size: int, flags: tuple) -> list[dict]:
    config = mlp_config(**dict(flags))
    config.validate(world_size)
    results = simulate(world_size, lambda comm: train(config, log=lambda line: None, comm=comm))
    return [{k: v for k, v in result.items() if k != "master_weights"} for result in results]


def mlp_units() -> list[int]:
    """The elements of each unit (Linear layer) of the lesson's MLP, in order."""
    return zero_unit_sizes(mlp_config())[0]


def command_line(**flags: Any) -> list[str]:
    """The arguments of `python` that run the lesson's MLP with these flags under mpirun."""
    return ["-m", "minimp.train", *" ".join(mlp_config(**flags).changed_flags()).split()]


def final_weights(world_size: int, **flags: Any) -> dict:
    """Rank 0's float32 master weights after SAME_TRAINING's 10 steps with these flags."""
    config = TrainConfig(**{**SAME_TRAINING, **flags})
    config.validate(world_size)
    results = simulate(world_size, lambda comm: train(config, log=lambda line: None, comm=comm))
    return results[0]["master_weights"]


# ----- recomputation: a GPT of 4 blocks -----------------------------------------------------
# context s, batch b, width h, heads a, blocks; fp16, dropout 0.1, one BLAS thread.
GPT_SHAPE = dict(s=64, b=8, h=64, a=4, layers=4)
ROUNDS = 7  # runs without and with recomputation, alternated; the fastest of each is kept


def lesson_gpt() -> tuple[GPT, np.ndarray, np.ndarray]:
    """The GPT, a batch of Shakespeare's token ids and their targets, dropout states set."""
    s, b, h, a, layers = (GPT_SHAPE[k] for k in ("s", "b", "h", "a", "layers"))
    gpt = GPT(GPTConfig(vocab_size=65, context=s, layers=layers, heads=a, width=h, dropout=0.1),
              np.random.default_rng(0))
    gpt.to(np.float16)  # in place
    ids, targets = text_batch(load_shakespeare().train, seed=0, step=1, batch_size=b, context=s)
    gpt.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    return gpt, ids, targets


def gpt_forward(gpt: GPT, ids: np.ndarray, targets: np.ndarray,
                recompute: bool) -> tuple[Tensor, float]:
    """The loss, and the CPU seconds this thread spent in the blocks' forward."""
    x = gpt[0](Tensor(ids))  # the embeddings: (B, T, C)
    start = time.thread_time()
    for block in gpt.layers[1:-1]:
        x = nn.recompute([block], x) if recompute else block(x)
    blocks = time.thread_time() - start
    logits = gpt[-1](x)  # (B, T, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1)), blocks


def block_forwards_in_backward(gpt: GPT, ids: np.ndarray, targets: np.ndarray,
                               recompute: bool) -> int:
    """How many times a block's forward runs inside backward: counted by a forward pre-hook on
    every block, not timed."""
    count = [0]

    def counted(module: Any, args: tuple) -> None:
        count[0] += 1

    handles = [block.register_forward_pre_hook(counted) for block in gpt.layers[1:-1]]
    loss, _ = gpt_forward(gpt, ids, targets, recompute)
    count[0] = 0  # the forward's own calls
    loss.backward()
    for handle in handles:
        handle.remove()
    for parameter in gpt.parameters():
        parameter.grad = None
    return count[0]


def recompute_times(gpt: GPT, ids: np.ndarray, targets: np.ndarray,
                    rounds: int = ROUNDS) -> dict[bool, np.ndarray]:
    """{recompute: (the blocks' forward, backward)} in CPU seconds of this thread on one BLAS
    thread, the fastest of `rounds` alternated runs. CPU time, not the wall clock: another
    process that shares the core stretches the wall clock, not the CPU time this thread uses."""
    times: dict[bool, list] = {False: [], True: []}
    with limit_cpu_threads(1):  # products this small run fastest on one BLAS thread
        for _ in range(rounds):
            for recompute in (False, True):
                loss, blocks = gpt_forward(gpt, ids, targets, recompute)
                start = time.thread_time()
                loss.backward()
                times[recompute].append((blocks, time.thread_time() - start))
                for parameter in gpt.parameters():
                    parameter.grad = None
    return {recompute: np.min(each, axis=0) for recompute, each in times.items()}


def backward_extra(times: dict[bool, np.ndarray]) -> float:
    """Backward's extra time with recomputation, in forwards of the blocks without it."""
    return float((times[True][1] - times[False][1]) / times[False][0])


# ----- exercise 1: bytes held -----------------------------------------------------------------
# Unit sizes the checkers try: the lesson's MLP's first, a middle and its last layer (2,570 does
# not divide by 3 or 4), and units smaller than the number of ranks.
LAYOUTS = ([16640, 65792, 2570], [5, 3], [7])
# fp16 compute copies, an fp32 gradient wire, Adam's two slots: the lesson's runs.
SETTINGS = dict(compute_bytes=2, wire_bytes=4)


def every_rank(micro_batches: tuple = (1,)) -> Any:
    """(units, N, M, rank) for every layout of LAYOUTS, N = 1 to 4, M and rank of N."""
    for units in LAYOUTS:
        for n in (1, 2, 3, 4):
            for m in micro_batches:
                for rank in range(n):
                    yield units, n, m, rank


HELD_HINTS = {
    0: "nothing is sharded: 2 P (fp16 copy), 4 P (fp32 accumulators), 4 P (masters), 8 P (Adam); "
    "buffers: a send and a receive buffer of the whole model in the wire dtype, 2 x 4 P, and "
    "none on one rank (no wire)",
    1: "stage 1 shards the masters and Adam's state only (the accumulators from stage 2, the "
    "compute copy in stage 3): this rank's chunks, chunk_bounds(size, N)[rank] of every unit, "
    "summed (uneven chunks: not P // N); buffers: send and receive of the largest unit (fp32) "
    "and one fp16 all-gather buffer of it",
    2: "stage 2 shards the fp32 accumulators too, but not the compute copy (stage 3); buffers as "
    "in stage 1",
    3: "the fp16 compute copy is a chunk too, and no all-gather buffer is kept (each layer's "
    "gather is allocated when the layer runs and freed after): buffers 2 x 4 x the largest unit",
}


def check_bytes_held(bytes_held: Callable[[int, list, int, int], dict],
                     quiet: bool = False) -> Report:
    """bytes_held(stage, unit_sizes, rank, world_size): {kind: bytes} rank holds at the end of
    a step, for KINDS, with fp16 compute copies, an fp32 gradient wire and Adam."""
    report = Report("bytes_held", quiet)
    for stage in range(4):

        @report.case(f"stage {stage}: every rank of N = 1, 2, 3, 4, uneven and tiny units, "
                     "against formulas.memory_formula", hint=HELD_HINTS[stage])
        def _():
            for units, n, _, rank in every_rank():
                want = memory_formula(stage, unit_sizes=units, rank=rank, world_size=n, slots=2,
                                      **SETTINGS)
                _compare_held(call(bytes_held, stage, list(units), rank, n), want,
                              f"units {units}, N = {n}, rank {rank}")

    @report.case("measured: the lesson's MLP on 3 ranks, every stage (no unit divides by 3)",
                 hint="the measured bytes are the formula's: see the crosses above")
    def _():
        for stage in range(4):
            results = simulated(3, zero=stage)
            for rank in range(3):
                measured = results[0]["model_state_by_kind"][rank]
                _compare_held(call(bytes_held, stage, mlp_units(), rank, 3), measured,
                              f"stage {stage}, rank {rank} (measured)")

    return report.finish()


def _compare_held(got: Any, want: dict, where: str) -> None:
    expect(isinstance(got, dict), f"{where}: returned {type(got).__name__}, not a dict of kinds")
    for kind in KINDS:
        expect(kind in got, f"{where}: no {kind!r} in what you returned")
        expect(got[kind] == want[kind], f"{where}: {kind} {got[kind]:,}, expected {want[kind]:,}")


# ----- stage 1 from the ring's halves -------------------------------------------------------
def _minimp_steps(comm: Any, weights: np.ndarray, gradients: np.ndarray, lr: float,
                  zero: bool) -> tuple[np.ndarray, np.ndarray, int]:
    """minimp's own steps over one flat parameter: DataParallel (zero=False) or ZeRO stage 1,
    SGD, fp16 compute copy. gradients: (steps, ranks, size) float16. Returns the compute copy,
    this rank's chunk of the master and the bytes this rank sent."""
    parameter = nn.Parameter(weights.copy())
    optimizer: Any = optim.SGD([parameter], lr=lr)  # masters: float32 copies of the weights
    parameter.data = parameter.data.astype(np.float16)
    # No layers: the parameter is a unit of its own, one array as data parallelism's bucket is.
    sync: Any = (zero_data_parallel(1, optimizer, [], comm) if zero
                 else DataParallel(comm, optimizer))
    optimizer = sync.optimizer
    before = comm.bytes_sent
    for step_gradients in gradients:
        parameter.grad = step_gradients[comm.rank].copy()
        mixed_precision_step(optimizer, NoLossScaler(), sync=sync)
    start, stop = chunk_bounds(weights.size, comm.size)[comm.rank]
    master = optimizer.masters[0] if zero else optimizer.master_weights[0][start:stop]
    return parameter.data.copy(), master.copy(), comm.bytes_sent - before


def _learner_steps(comm: Any, zero1_step: Callable, weights: np.ndarray, gradients: np.ndarray,
                   lr: float) -> tuple[np.ndarray, np.ndarray, int]:
    """The same steps by the learner's zero1_step, with this rank's master chunk kept between
    steps by the caller, as ZeRO's optimizer keeps it."""
    start, stop = chunk_bounds(weights.size, comm.size)[comm.rank]
    master, compute = weights[start:stop].copy(), weights.astype(np.float16)
    before = comm.bytes_sent
    for step_gradients in gradients:
        grad = step_gradients[comm.rank].astype(np.float32)  # this rank's fp32 accumulator
        compute = np.asarray(call(zero1_step, comm, compute, master, grad, lr))
    return compute, master, comm.bytes_sent - before


def _divided_steps(comm: Any, weights: np.ndarray, gradients: np.ndarray,
                   lr: float) -> tuple[np.ndarray, np.ndarray, int]:
    """The other mean the spec allows, grad / N before the reduce-scatter, on the same ring (at
    N = 3, x / 3 and x * float32(1/3) differ in some last bits; minimp multiplies)."""
    start, stop = chunk_bounds(weights.size, comm.size)[comm.rank]
    master, compute = weights[start:stop].copy(), weights.astype(np.float16)
    before = comm.bytes_sent
    for step_gradients in gradients:
        grad = step_gradients[comm.rank].astype(np.float32)
        master -= lr * reduce_scatter(comm, grad / comm.size)
        compute = all_gather(comm, master.astype(np.float16), weights.size)
    return compute, master, comm.bytes_sent - before


def _inputs(n: int, size: int, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """float32 weights (size,) and float16 gradients (steps, n, size), seeded by the case."""
    rng = np.random.default_rng(size + n)
    weights = rng.standard_normal(size).astype(np.float32)
    return weights, rng.standard_normal((steps, n, size)).astype(np.float16)


def _both(zero1_step: Callable, n: int, size: int, steps: int, zero: bool) -> tuple[list, list]:
    """Every rank's (compute copy, master chunk, bytes sent) by the learner's steps and by
    minimp's DataParallel (zero=False) or ZeRO stage 1 (zero=True)."""
    weights, gradients = _inputs(n, size, steps)
    want = _run(n, _minimp_steps, weights, gradients, 0.1, zero)
    got = _run(n, _learner_steps, zero1_step, weights, gradients, 0.1)
    return got, want


def _same_bits(got: list, want: list, what: str) -> None:
    for rank, ((weights, master, _), (weights_, master_, _)) in enumerate(zip(got, want)):
        expect(weights.dtype == np.float16 and weights.shape == weights_.shape,
               f"rank {rank} returned {weights.dtype} {weights.shape}, not float16 "
               f"{weights_.shape}")
        expect(master.tobytes() == master_.tobytes(), f"rank {rank}: {np.sum(master != master_)} "
               f"of the {master.size} elements of its master chunk differ from {what}'s")
        expect(weights.tobytes() == weights_.tobytes(), f"rank {rank}: "
               f"{np.sum(weights != weights_)} compute weights differ from {what}'s")


HINT = ("a float32 reduce-scatter, dist.reduce_scatter(comm, grad * np.float32(1 / comm.size)), "
        "is this rank's chunk of the mean; master -= lr * that chunk (a float32 product), in "
        "place; then dist.all_gather(comm, the master chunk rounded to float16, weights.size)")
MEAN_HINT = ("scale each rank's float32 gradient by 1 / N before the reduce-scatter (grad / "
             "comm.size, or grad * np.float32(1 / comm.size) as minimp does), not the sum after "
             "it: (a + b + c) / 3 and a / 3 + b / 3 + c / 3 differ in the last bit")


def check_zero1_step(zero1_step: Callable[[Any, np.ndarray, np.ndarray, np.ndarray, float],
                                          np.ndarray], quiet: bool = False) -> Report:
    """zero1_step(comm, weights, master, grad, lr): one SGD step of ZeRO stage 1 over a flat
    parameter. weights: the whole float16 compute copy (the same on every rank); master: this
    rank's float32 chunk of the masters (chunk_bounds(weights.size, N)[rank]), updated in place;
    grad: this rank's float32 gradient of the whole parameter, scaled by 1 / N (either way)
    before a float32 reduce-scatter. Returns the new compute copy."""
    report = Report("zero1_step", quiet)

    @report.case("N = 1, 2 and 4 (10, 1,000 and 1,003 elements): data parallelism's bits on "
                 "every rank (minimp's DataParallel)", hint=HINT)
    def _():
        for n, size in ((1, 10), (2, 1000), (4, 1003)):
            _same_bits(*_both(zero1_step, n, size, 1, zero=False), "DataParallel")

    @report.case("N = 3: ZeRO stage 1's bits (minimp's ZeroDataParallel, grad * np.float32(1 / "
                 "3)), or the same ring's on grad / 3", hint=MEAN_HINT)
    def _():
        got, want = _both(zero1_step, 3, 1001, 1, zero=True)
        if any(g[1].tobytes() != w[1].tobytes() for g, w in zip(got, want)):  # masters
            want = _run(3, _divided_steps, *_inputs(3, 1001, 1), 0.1)
        _same_bits(got, want, "the ring's mean")

    @report.case("N = 4, 3 elements: a rank whose chunk is empty",
                 hint="chunks follow chunk_bounds(weights.size, N): pass the length to "
                 "dist.all_gather, which cannot guess it from uneven chunks")
    def _():
        _same_bits(*_both(zero1_step, 4, 3, 1, zero=True), "ZeRO stage 1")

    @report.case("three steps in a row, N = 2: the master chunk carries over",
                 hint="update `master` in place (master -= ...): the caller keeps it for the "
                 "next step, as ZeRO's optimizer does")
    def _():
        _same_bits(*_both(zero1_step, 2, 500, 3, zero=True), "ZeRO stage 1")

    @report.case("N = 4: the bytes ZeRO stage 1 sends (an fp32 reduce-scatter, an fp16 "
                 "all-gather)", hint="an all-reduce sends the gradients' both halves in fp32; "
                 "ZeRO's second half carries the float16 weights, not the float32 master")
    def _():
        got, want = _both(zero1_step, 4, 1003, 1, zero=True)
        for rank, (mine, theirs) in enumerate(zip(got, want)):
            expect(mine[2] == theirs[2], f"rank {rank} sent {mine[2]:,} bytes; ZeRO stage 1 "
                   f"sends {theirs[2]:,}")

    return report.finish()


# ----- the bytes a step sends ---------------------------------------------------------------
SENT_HINTS = {
    0: "this rank's own bytes, not the average over the ranks: one all-reduce of one bucket of "
    "all P elements (fp32), whose ring reduce-scatter sends every chunk but the rank's own and "
    "all-gather every chunk but its right neighbour's (rank + 1)",
    1: "once a step: each unit reduce-scattered (fp32; every chunk but the rank's own) and "
    "all-gathered (fp16; every chunk but the right neighbour's)",
    2: "as stage 1, but the reduce-scatter runs on every micro-batch",
    3: "every micro-batch: a reduce-scatter (fp32) and two all-gathers of each layer (fp16): "
    "before its forward and again before its backward",
}


def check_bytes_sent(bytes_sent: Callable[[int, list, int, int, int], float],
                     quiet: bool = False) -> Report:
    """bytes_sent(stage, unit_sizes, rank, world_size, micro_batches): the bytes rank sends in
    one step, fp16 compute copies and an fp32 gradient wire, each unit read by one layer (the
    MLP), stage 0's all-reduce over one bucket of all the units."""
    report = Report("bytes_sent", quiet)
    for stage in range(4):

        @report.case(f"stage {stage}: every rank of N = 1 to 4, 1 and 3 micro-batches, against "
                     "formulas.bytes_sent_formula", hint=SENT_HINTS[stage])
        def _():
            for units, n, m, rank in every_rank(micro_batches=(1, 3)):
                sizes = [sum(units)] if stage == 0 else units  # stage 0: one bucket
                want = sum(bytes_sent_formula(stage, sizes=sizes, rank=rank, world_size=n,
                                              micro_batches=m, **SETTINGS).values())
                got = call(bytes_sent, stage, list(units), rank, n, m)
                expect(got == want, f"units {units}, N = {n}, M = {m}, rank {rank}: you say "
                       f"{got:,}, expected {want:,}")

    @report.case("measured: the lesson's MLP on 3 ranks, 2 micro-batches, every stage",
                 hint="the measured bytes are the formula's: see the crosses above")
    def _():
        for stage in range(4):
            results = simulated(3, zero=stage, micro_batches=2)
            for rank, result in enumerate(results):
                sent = result["history"][-1]["bytes_sent"]
                got = call(bytes_sent, stage, mlp_units(), rank, 3, 2)
                expect(got == sent, f"stage {stage}, rank {rank}: you say {got:,}, it sent "
                       f"{sent:,}")

    return report.finish()


EXERCISES = [
    ("bytes_held", check_bytes_held),
    ("zero1_step", check_zero1_step),
    ("bytes_sent", check_bytes_sent),
]
