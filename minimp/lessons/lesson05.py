"""Lesson 5 (the ring): the configurations the notebook runs and its claims tests check (the ring
on P simulated ranks, the chunk each message carries, the bytes of ring and naive, the send-first
ring that deadlocks past the eager limit), then the checkers of its exercises: the all-gather and
reduce-scatter halves in the simulated world, with their bytes counted from the message trace, and
a ring shift that cannot deadlock. Reference solutions: lessons/solutions/lesson05.py."""

from typing import Any, Callable

import numpy as np

from minimp import distributed as dist
from minimp.lessons.checking import Failed, Report, expect

P = 4  # ranks in every demonstration of the notebook
BIG_N = 1_000_000  # float32 elements of the array whose bytes the notebook counts
EAGER_FLOATS, RENDEZVOUS_FLOATS = 100, 100_000  # 400 and 400,000 bytes: below and past 64 KiB


def chunk_sent(rank: int, step: int, p: int) -> int:
    """The chunk rank `rank` sends at its `step`-th message of a ring all-reduce on p ranks, by the
    lesson's formula: (rank - step - 1) mod p in the reduce-scatter (steps 0 to p - 2), then
    (rank - s) mod p at all-gather step s = step - (p - 1)."""
    return (rank - step - 1) % p if step < p - 1 else (rank - (step - (p - 1))) % p


class _ChunkRecorder:
    """A communicator that passes everything on and notes which chunk each sendrecv sends: the
    ring sends views of whole arrays, so the view's offset in its array, in chunks, is the chunk."""

    def __init__(self, comm: Any, log: list):
        self._comm, self._log = comm, log

    def __getattr__(self, name: str) -> Any:
        return getattr(self._comm, name)

    def sendrecv(self, send_array: Any, dest: int, recv_array: Any, source: int,
                 **kwargs: Any) -> None:
        whole = send_array if send_array.base is None else send_array.base
        offset = send_array.__array_interface__["data"][0] - whole.__array_interface__["data"][0]
        self._log.append(offset // send_array.nbytes)
        self._comm.sendrecv(send_array, dest, recv_array, source, **kwargs)


def chunks_sent(p: int = P, n: int = 2 * P) -> list[list[int]]:
    """The chunk each rank's messages carry in minimp's ring_allreduce of n float32 elements on p
    simulated ranks, read from the arrays the ring hands to sendrecv: one list per rank."""

    def run(comm):
        log: list[int] = []
        dist.ring_allreduce(_ChunkRecorder(comm, log), np.ones(n, np.float32))
        return log

    return list(dist.simulate(p, run))


def bytes_sent_per_rank(algorithm: str, p: int = P, n: int = BIG_N) -> list[int]:
    """Bytes each rank sends in dist.allreduce(algorithm=...) of n float32 ones on p ranks,
    counted from the simulator's message trace."""
    arrays = [np.ones(n, np.float32) for _ in range(p)]
    trace = dist.simulate(p, lambda comm: dist.allreduce(comm, arrays[comm.rank],
                                                         algorithm=algorithm)).trace
    return [sum(m.nbytes for m in trace if m.source == rank) for rank in range(p)]


def naive_ring(comm: Any, length: int) -> np.ndarray:
    """Send to the right, then receive from the left: blocking calls in the order a learner
    writes them first."""
    outgoing, incoming = np.ones(length, np.float32), np.empty(length, np.float32)
    comm.send(outgoing, (comm.rank + 1) % comm.size)
    comm.recv(incoming, (comm.rank - 1) % comm.size)
    return incoming


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


# minimp's own collectives (and the communicator's): calling one is the shortcut the exercises
# ask you to write yourself
LIBRARY_COLLECTIVES = {"all_gather", "reduce_scatter", "allreduce", "ring_allreduce",
                       "naive_allreduce", "recursive_doubling_allreduce", "PersistentAllreduce",
                       "gather_named_arrays", "bcast", "allreduce_scalars"}


def _names_called(code: Any) -> set[str]:
    """The global and attribute names a code object (and every function nested in it) uses."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if hasattr(constant, "co_names"):
            names |= _names_called(constant)
    return names


def _without_library_collectives(solution: Callable) -> None:
    """Fail a solution whose code names one of minimp's collectives: it would pass the traffic
    checks on the library's ring, not its own."""
    code = getattr(solution, "__code__", None)
    used = sorted(_names_called(code) & LIBRARY_COLLECTIVES) if code is not None else []
    expect(not used, f"calls {', '.join(used)}: that is minimp's own collective (the library "
           "shortcut); write the ring's steps with comm.sendrecv")


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

    @report.case("its own ring, not minimp's collective",
                 hint="dist.all_gather is the library's answer: write the p - 1 sendrecv steps")
    def _():
        _without_library_collectives(all_gather)

    return report.finish()


def check_reduce_scatter(reduce_scatter: Callable[[Any, np.ndarray], np.ndarray],
                         quiet: bool = False) -> Report:
    """reduce_scatter(comm, x): this rank's chunk (block `rank` of p equal blocks) of the sum of
    every rank's x. x.size is a multiple of p; x itself must not change."""
    report = Report("reduce_scatter", quiet)
    hint = ("at step s send your partial sum of block (rank - s - 1) % p to the right, receive "
            "block (rank - s - 2) % p from the left and add your own share of it")

    for p in (4, 1, 2, 3, 5):

        @report.case(f"{p} rank(s): rank r ends with block r of the sum, x unchanged",
                     hint=hint + "; work on a copy of x, never x itself")
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

    @report.case("its own ring, not minimp's collective",
                 hint="dist.reduce_scatter is the library's answer: write the p - 1 sendrecv "
                 "steps")
    def _():
        _without_library_collectives(reduce_scatter)

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
    hint = ("if every rank sends first, every rank waits (deadlock): let even ranks send first "
            "and odd ranks receive first (and think about rank p - 1 when p is odd, and about "
            "p = 1, where a rank's left neighbour is itself)")

    for p in (2, 4, 3, 5, 1):

        @report.case(f"{p} rank(s): each rank gets its left neighbour's x, 40,000-byte messages "
                     "past the eager limit", hint=hint)
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
