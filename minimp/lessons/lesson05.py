"""Checkers for lesson 5 (the ring): the all-gather and reduce-scatter halves in the simulated
world, with their bytes counted from the message trace, and a ring shift that cannot deadlock.
Reference solutions: lessons/solutions/lesson05.py."""

from typing import Any, Callable

import numpy as np

from minimp import distributed as dist
from minimp.lessons.checking import Failed, Report, expect

TIMEOUT = 20.0  # seconds a simulated rank may wait; a deadlock is reported sooner


def _run(p: int, fn: Callable, *args: Any, eager_limit: int = 64 * 1024) -> Any:
    """simulate(p, fn, *args) with a short timeout; a deadlock becomes a Failed that says who
    waits on whom."""
    try:
        return dist.simulate(p, fn, *args, eager_limit=eager_limit, timeout=TIMEOUT)
    except dist.DeadlockError as error:
        raise Failed(str(error)) from None


def _ring_traffic(trace: list, p: int, messages: int, nbytes: int) -> None:
    """Every rank sent `messages` messages of `nbytes` bytes, each to its right neighbour."""
    for rank in range(p):
        sent = [m for m in trace if m.source == rank]
        expect(all(m.dest == (rank + 1) % p for m in sent),
               f"rank {rank} sent to {sorted({m.dest for m in sent})}: a ring only talks to "
               f"rank {(rank + 1) % p}")
        expect(len(sent) == messages and all(m.nbytes == nbytes for m in sent),
               f"rank {rank} sent {len(sent)} messages of {[m.nbytes for m in sent][:6]} bytes; "
               f"the ring sends {messages} of {nbytes}")


def check_all_gather(all_gather: Callable[[Any, np.ndarray], np.ndarray],
                     quiet: bool = False) -> Report:
    """all_gather(comm, chunk): every rank's chunk, concatenated in rank order, on every rank."""
    report = Report("all_gather", quiet)
    hint = ("out[r] = chunk; at step s send block (rank - s) % p to the right and receive block "
            "(rank - s - 1) % p from the left, with one comm.sendrecv")

    for p in (4, 1, 2, 3, 5):

        @report.case(f"{p} rank(s): every rank ends with all chunks, in rank order", hint=hint)
        def _():
            chunks = [np.arange(3, dtype=np.float32) + 10 * r for r in range(p)]
            results = _run(p, lambda comm: all_gather(comm, chunks[comm.rank].copy()))
            want = np.concatenate(chunks)
            for rank, result in enumerate(results):
                expect(result is not None and np.array_equal(np.asarray(result).ravel(), want),
                       f"rank {rank} returned {result}, expected {want}")

    @report.case(
        "bandwidth: p - 1 messages of one chunk per rank, to the right neighbour only (p = 4)",
        hint="each rank forwards what it received one step earlier; nothing else goes out",
    )
    def _():
        chunks = [np.ones(1000, np.float32) * r for r in range(4)]
        results = _run(4, lambda comm: all_gather(comm, chunks[comm.rank]))
        _ring_traffic(results.trace, 4, 3, 4000)

    return report.finish()


def check_reduce_scatter(reduce_scatter: Callable[[Any, np.ndarray], np.ndarray],
                         quiet: bool = False) -> Report:
    """reduce_scatter(comm, x): this rank's chunk (block `rank` of p equal blocks) of the sum of
    every rank's x. x.size is a multiple of p; x itself must not change."""
    report = Report("reduce_scatter", quiet)
    hint = ("at step s send your partial sum of block (rank - s - 1) % p to the right, receive "
            "block (rank - s - 2) % p from the left and add your own share of it")

    for p in (4, 1, 2, 3, 5):

        @report.case(f"{p} rank(s): rank r ends with block r of the sum, x unchanged", hint=hint)
        def _():
            inputs = [np.random.default_rng(r).integers(-9, 9, 4 * p).astype(np.float32)
                      for r in range(p)]
            copies = [x.copy() for x in inputs]
            results = _run(p, lambda comm: reduce_scatter(comm, inputs[comm.rank]))
            total = np.sum(copies, axis=0)
            for rank, result in enumerate(results):
                want = total[4 * rank: 4 * rank + 4]
                expect(result is not None and np.array_equal(np.asarray(result).ravel(), want),
                       f"rank {rank} returned {result}, expected {want}")
                expect(np.array_equal(inputs[rank], copies[rank]), f"rank {rank}'s x changed")

    @report.case(
        "bandwidth: p - 1 messages of one block per rank, to the right neighbour only (p = 4)",
        hint="send partial sums of one block at a time, never the whole array",
    )
    def _():
        inputs = [np.ones(4000, np.float32) for _ in range(4)]
        results = _run(4, lambda comm: reduce_scatter(comm, inputs[comm.rank]))
        _ring_traffic(results.trace, 4, 3, 4000)

    return report.finish()


class SendAndRecvOnly:
    """A communicator that offers send and recv, and refuses sendrecv."""

    def __init__(self, comm: Any):
        self.rank, self.size, self._comm = comm.rank, comm.size, comm

    def send(self, array: Any, dest: int, tag: int = 0) -> None:
        self._comm.send(array, dest, tag)

    def recv(self, array: Any, source: int, tag: int = 0) -> None:
        self._comm.recv(array, source, tag)

    def sendrecv(self, *args: Any, **kwargs: Any) -> None:
        raise Failed("this exercise allows comm.send and comm.recv only (no sendrecv)")


def check_ring_shift(ring_shift: Callable[[Any, np.ndarray], np.ndarray],
                     quiet: bool = False) -> Report:
    """ring_shift(comm, x): the x of the left neighbour, with send and recv only, for messages
    so large that every send waits for its receive (rendezvous)."""
    report = Report("ring_shift", quiet)
    hint = ("if every rank sends first, every rank waits: let even ranks send first and odd "
            "ranks receive first (and think about rank p - 1 when p is odd, and about p = 1)")

    for p in (2, 4, 3, 5, 1):

        @report.case(f"{p} rank(s), 40,000-byte messages past the eager limit", hint=hint)
        def _():
            inputs = [np.full(10000, float(r), np.float32) for r in range(p)]
            results = _run(p, lambda comm: ring_shift(SendAndRecvOnly(comm), inputs[comm.rank]),
                           eager_limit=1024)
            for rank, result in enumerate(results):
                want = inputs[(rank - 1) % p]
                expect(result is not None and np.array_equal(result, want),
                       f"rank {rank} returned {None if result is None else result[:3]}..., "
                       f"expected rank {(rank - 1) % p}'s x")

    return report.finish()


EXERCISES = [
    ("all_gather", check_all_gather),
    ("reduce_scatter", check_reduce_scatter),
    ("ring_shift", check_ring_shift),
]
