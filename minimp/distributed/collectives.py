"""All-reduce algorithms besides the ring, and `allreduce`, which picks one by a rule or a policy.

Each all-reduce takes the communicator as its first argument, works on a world of size 1, on the
simulated world and under mpirun, and returns a new array, or `out` when given (the input is not
modified); its `_into` body (p >= 2) is the messages and additions alone. The ring itself, with its
two halves, lives in minimp/distributed/ring.py.

The ranks must pass the same length, dtype and op. The ring and the naive all-reduce first agree
on them (one small all-reduce: on this project's machine about as long as MPI's whole all-reduce of
4 KiB); recursive doubling, which `allreduce` picks for small arrays, carries the check inside its
messages (minimp/distributed/headers.py), each of which starts with its sender's layout, and keeps
their buffers on the communicator from call to call.

A persistent all-reduce, last: agree on the array and plan once, then run it call after call.
MPI-4 calls this a persistent collective (MPI_Allreduce_init once, MPI_Start each time). A caller
that all-reduces arrays of one layout again and again (a gradient bucket, every step) can check
and choose once: `PersistentAllreduce(comm, shape, dtype)` agrees and chooses at construction, on
every rank together; each call then checks on this rank alone that its array is the one planned
(the construction checked that the ranks planned alike) and moves the bytes, with the same
messages (less their headers) and additions, so the same bits, as the checked call.
"""

import functools
import math
from typing import Callable

import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array, array_module
from minimp.distributed.buffers import AllreduceBody, agree_on_layout, checked_allreduce
from minimp.distributed.buffers import contiguous_flat, flat_copy, output_buffer
from minimp.distributed.buffers import raise_disagreement, reduce_into
from minimp.distributed.headers import BareBuffers, HeadedBuffers, headed_buffers
from minimp.distributed.protocol import REDUCE_OPS, Communicator, Tag, check_op
from minimp.distributed.ring import ring_allreduce, ring_allreduce_into
from minimp.precision.casting import round_to, widen


def naive_allreduce(comm: Communicator, x: Array, op: str = "sum", out: Array | None = None,
                    root: int = 0) -> Array:
    """Every rank sends its whole array to root, root reduces (in float32 for 16-bit dtypes, in rank
    order) and broadcasts the result: 2(p - 1) full-size messages through one rank."""
    body = functools.partial(naive_allreduce_into, root=root)
    return checked_allreduce(body, "naive_allreduce", comm, x, op, out)


def naive_allreduce_into(comm: Communicator, x_flat: Array, flat: Array, op: str = "sum",
                         root: int = 0) -> None:
    """naive_allreduce's messages and additions alone, from x_flat into flat (p >= 2; no checks)."""
    flat[...] = x_flat
    if comm.rank == root:
        total = widen(flat)  # float32: flat itself; 16-bit: a float32 copy to sum into
        incoming = array_module(flat).empty_like(flat)
        for source in range(comm.size):
            if source != root:
                comm.recv(incoming, source, tag=Tag.NAIVE_TO_ROOT)
                REDUCE_OPS[op](total, widen(incoming), out=total)
        flat[...] = round_to(total, flat.dtype)
    else:
        comm.send(flat, root, tag=Tag.NAIVE_TO_ROOT)
    comm.bcast(flat, root=root)


def recursive_doubling_allreduce(comm: Communicator, x: Array, op: str = "sum",
                                 out: Array | None = None) -> Array:
    """log2(p) rounds exchanging the whole array with partner rank ^ distance (latency-optimal).

    For p not a power of two, the first p - 2^k ranks above 2^k fold their data into a partner first
    and get the result back at the end (Thakur, Rabenseifner & Gropp 2005, section 4.1).
    The ranks' agreement on the array and the op travels in the messages (headers.py): no
    all-reduce of its own, unless there is a disagreement to name (CollectiveMismatchError on
    every rank).
    """
    check_op(op)
    if comm.size == 1:
        return flat_copy(x, out).reshape(x.shape)
    flat = output_buffer(x, out)
    buffers = headed_buffers(comm, x, op)
    recursive_doubling_into(comm, contiguous_flat(x), flat, op, buffers)
    if not buffers.agreed:  # every rank knows it now, and all raise the same line
        raise_disagreement(comm, x.size, x.dtype, op, "recursive_doubling_allreduce")
    return flat.reshape(x.shape)


def recursive_doubling_into(comm: Communicator, x_flat: Array, flat: Array, op: str = "sum",
                            buffers: "HeadedBuffers | BareBuffers | None" = None) -> None:
    """recursive_doubling_allreduce's messages and additions alone, from x_flat into flat (p >= 2:
    every rank below 2^k exchanges at least once, so flat holds its result). With HeadedBuffers
    (headers.py) each message travels behind a header, and after a disagreement the additions are
    skipped (their operands are not the same array's) but not the messages; without, bare messages
    (the ranks agreed before). A partial result that is sent on is computed in `buffers.outgoing`
    when there is one: behind its header, sent without a copy."""
    buffers = BareBuffers(flat) if buffers is None else buffers
    p, r = comm.size, comm.rank
    power = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - power
    buffers.begin()
    incoming = buffers.incoming
    partial = flat if buffers.outgoing is None else buffers.outgoing  # where sent-on sums go
    if r >= power:  # fold into rank r - power, wait for the answer
        buffers.send(comm, x_flat, r - power, Tag.DOUBLING_FOLD)
        buffers.receive(comm, r - power, Tag.DOUBLING_UNFOLD)
        flat[...] = incoming
        return
    current = x_flat  # this rank's own input (only read), then its partial result
    if r < extra:
        buffers.receive(comm, r + power, Tag.DOUBLING_FOLD)
        if buffers.agreed:
            reduce_into(partial, incoming, op, first=current)
        current = partial
    distance = 1
    while distance < power:
        partner = r ^ distance
        buffers.exchange(comm, current, partner, Tag.DOUBLING_EXCHANGE)
        distance *= 2
        # the last result goes into flat, unless an unfold still sends it on
        target = flat if distance == power and r >= extra else partial
        if buffers.agreed:
            # Both partners put the lower rank's data first. a + b == b + a for numbers, but not
            # for NaNs: x86 returns the first operand's NaN, payload and sign, so the order is
            # what makes both partners (and in the end every rank) hold the same bits.
            lower, higher = (current, incoming) if r < partner else (incoming, current)
            reduce_into(target, higher, op, first=lower)
        current = target
    if r < extra:
        buffers.send(comm, current, r + power, Tag.DOUBLING_UNFOLD)
        if current is not flat:
            flat[...] = current


ALGORITHMS = {
    "ring": ring_allreduce,
    "naive": naive_allreduce,
    "recursive_doubling": recursive_doubling_allreduce}
# Each algorithm's messages and additions alone, for callers that made the checks once
# (PersistentAllreduce, below)
BODIES: dict[str, AllreduceBody] = {
    "ring": ring_allreduce_into,
    "naive": naive_allreduce_into,
    "recursive_doubling": recursive_doubling_into}


# How an all-reduce picks its algorithm for a message: (bytes, ranks) -> a name in ALGORITHMS.
# Every rank must pick the same one, so a policy may depend on nothing but its arguments: constants,
# never a per-rank measurement (minimp.measure.machinemodel.FastestPredicted asks a fitted model).
AlgorithmPolicy = Callable[[int, int], str]

# Below this, an all-reduce is latency-bound and recursive doubling's log2(p) whole-array exchanges
# beat the ring's 2(p - 1) steps; from it the ring's (p - 1)/p of the bytes per rank win. Measured
# on this project's machine (docs/benchmarks.md, "All-reduce against MPI"): at p = 4 recursive
# doubling took 0.91-0.96x the ring's time at 256 KiB and 1.07-1.20x at 512 KiB; the model fitted
# at p = 2 switches at 448 KiB.
RING_FROM_BYTES = 512 * 1024


def choose_algorithm(nbytes: int, world_size: int) -> str:
    """minimp's rule for `algorithm="auto"`: recursive doubling below RING_FROM_BYTES, the ring
    from there (MPICH switches the same way, at its own sizes: Thakur et al. 2005)."""
    return "ring" if nbytes >= RING_FROM_BYTES else "recursive_doubling"


def resolve_algorithm(algorithm: "str | AlgorithmPolicy", nbytes: int, world_size: int) -> str:
    """The algorithm's name: as given, chosen by the rule ("auto"), or by a policy (a callable)."""
    name = algorithm(nbytes, world_size) if callable(algorithm) else algorithm
    if name == "auto":
        name = choose_algorithm(nbytes, world_size)
    if name not in ALGORITHMS:
        raise ValueError(f"unknown all-reduce algorithm {name!r}: use auto or one of "
                         f"{sorted(ALGORITHMS)}")
    return name


def allreduce(comm: Communicator, x: Array, op: str = "sum",
              algorithm: "str | AlgorithmPolicy" = "auto", out: Array | None = None) -> Array:
    """All-reduce with the named algorithm, with the one choose_algorithm picks ("auto"), or with
    the one a policy picks, the way MPI libraries switch from latency- to bandwidth-optimal
    algorithms as messages grow."""
    name = resolve_algorithm(algorithm, x.size * x.dtype.itemsize, comm.size)
    return ALGORITHMS[name](comm, x, op, out=out)


class PersistentAllreduce:
    """All-reduce of arrays of one shape and dtype, planned once: `plan(x, out=None)` returns the
    reduction like allreduce(comm, x, op, algorithm, out=out). Constructing it is a collective
    (every rank of comm, with the same shape, dtype and op, or CollectiveMismatchError on all)."""

    def __init__(self, comm: Communicator, shape: tuple[int, ...], dtype: DTypeLike,
                 op: str = "sum", algorithm: "str | AlgorithmPolicy" = "auto"):
        check_op(op)
        if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in shape):
            raise ValueError("PersistentAllreduce: shape must be non-negative integers, "
                             f"got {shape}")
        self.comm, self.op = comm, op
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        size = math.prod(self.shape)
        self.algorithm = resolve_algorithm(algorithm, size * self.dtype.itemsize, comm.size)
        agree_on_layout(comm, size, self.dtype, "PersistentAllreduce", op)
        self._body = BODIES[self.algorithm]

    def __call__(self, x: Array, out: Array | None = None) -> Array:
        if x.shape != self.shape or x.dtype != self.dtype:
            raise ValueError(f"PersistentAllreduce: planned for {self.dtype} arrays of shape "
                             f"{self.shape}, called with {x.dtype} {x.shape}; make a plan for "
                             "that layout")
        flat_x, flat_out = contiguous_flat(x), output_buffer(x, out)
        if self.comm.size == 1:
            flat_out[...] = flat_x
        else:
            self._body(self.comm, flat_x, flat_out, self.op)
        return flat_out if len(self.shape) == 1 else flat_out.reshape(self.shape)

    def __repr__(self) -> str:
        return (f"PersistentAllreduce({self.algorithm}, {self.dtype} {self.shape}, "
                f"op={self.op!r}, {self.comm.size} ranks)")
