"""All-reduce and its halves over any minimp communicator: ring, naive, recursive doubling, auto.

Each function takes the communicator as its first argument, works on a world of size 1, on the
simulated world and under mpirun, and returns a new array (the input is not modified). Before moving
data, the ranks agree on the array's length and dtype with one tiny all-reduce, so a mismatch is a
clear error on every rank instead of a hang or a wrong sum.
"""

import numpy as np

from minimp import costmodel
from minimp.backend import array_module
from minimp.dist.ring import (
    REDUCERS,
    chunk_bounds,
    reduce_into,
    ring_all_gather_inplace,
    ring_reduce_scatter,
)
from minimp.precision.casting import round_to, widen

_DTYPE_CODES = {"float16": 1, "bfloat16": 2, "float32": 3, "float64": 4, "int32": 5, "int64": 6}


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with arrays of different lengths or dtypes."""


def agree_on_array(comm, array, name):
    """Raise CollectiveMismatchError on every rank unless all ranks pass the same length and
    dtype."""
    if comm.size == 1:
        return
    code = _DTYPE_CODES.get(np.dtype(array.dtype).name, 99)
    highest = comm.allreduce_scalars([array.size, code, -array.size, -code], op="max")
    if highest[0] != -highest[2] or highest[1] != -highest[3]:
        raise CollectiveMismatchError(
            f"{name}: ranks disagree on the array (lengths {int(-highest[2])}..{int(highest[0])}, "
            f"dtype codes {int(-highest[3])}..{int(highest[1])}); every rank must pass the same "
            "length "
            "and dtype"
        )


def _check_op(op):
    if op not in REDUCERS:
        raise ValueError(f"op must be one of {sorted(REDUCERS)}, got {op!r}")


def _contiguous_flat(x):
    """x as a flat contiguous array (a view when it already is one; it is only read)."""
    return array_module(x).ascontiguousarray(x).reshape(-1)


def _output(x, out):
    """The flat array a result goes into: `out` (reused by callers that all-reduce every step, which
    saves the page faults of a fresh allocation) or a new array shaped like x."""
    if out is None:
        return array_module(x).empty(x.size, x.dtype)
    if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape {x.shape}")
    if array_module(x).may_share_memory(out, x):
        raise ValueError("out must not overlap x (x is read while out is written)")
    return out.reshape(-1)


def _flat_copy(x, out=None):
    """A contiguous 1-D copy to reduce into (the caller's array is never modified)."""
    flat = _output(x, out)
    flat[...] = x.reshape(-1)
    return flat


def ring_allreduce(comm, x, op="sum", out=None):
    """All-reduce by reduce-scatter + all-gather around a ring (bandwidth-optimal for large arrays).
    The result goes into `out` when given (it must not overlap x), else into a new array."""
    _check_op(op)
    agree_on_array(comm, x, "ring_allreduce")
    if comm.size == 1:
        return _flat_copy(x, out).reshape(x.shape)
    flat_x = _contiguous_flat(x)
    out = _output(x, out)
    bounds = chunk_bounds(flat_x.size, comm.size)
    ring_reduce_scatter(comm, flat_x, out, bounds, op)
    ring_all_gather_inplace(comm, out, bounds)
    return out.reshape(x.shape)


def reduce_scatter(comm, x, op="sum"):
    """This rank's chunk (chunk_bounds(x.size, p)[rank]) of the reduction of x over all ranks."""
    _check_op(op)
    agree_on_array(comm, x, "reduce_scatter")
    flat_x = _contiguous_flat(x)
    bounds = chunk_bounds(flat_x.size, comm.size)
    start, stop = bounds[comm.rank]
    if comm.size == 1:
        return flat_x[start:stop].copy()
    out = array_module(x).empty_like(flat_x)
    ring_reduce_scatter(comm, flat_x, out, bounds, op)
    return out[start:stop].copy()


def all_gather(comm, chunk, length=None):
    """Concatenate every rank's chunk in rank order. Chunk sizes follow chunk_bounds(length, p);
    `length` defaults to p * chunk.size (equal chunks)."""
    length = comm.size * chunk.size if length is None else length
    bounds = chunk_bounds(length, comm.size)
    start, stop = bounds[comm.rank]
    if chunk.size != stop - start:
        raise ValueError(
            f"all_gather: rank {comm.rank} holds {chunk.size} elements but chunk "
            f"{comm.rank} of {length} over {comm.size} ranks has {stop - start}"
        )
    flat = array_module(chunk).empty(length, chunk.dtype)
    agree_on_array(comm, flat, "all_gather")
    flat[start:stop] = chunk.reshape(-1)
    if comm.size > 1:
        ring_all_gather_inplace(comm, flat, bounds)
    return flat


def naive_allreduce(comm, x, op="sum", out=None, root=0):
    """Every rank sends its whole array to root, root reduces (in float32 for 16-bit dtypes, in rank
    order) and broadcasts the result: 2(p - 1) full-size messages through one rank."""
    _check_op(op)
    agree_on_array(comm, x, "naive_allreduce")
    flat = _flat_copy(x, out)
    if comm.size == 1:
        return flat.reshape(x.shape)
    if comm.rank == root:
        total = widen(flat).copy() if widen(flat) is not flat else flat
        incoming = array_module(flat).empty_like(flat)
        for source in range(comm.size):
            if source != root:
                comm.recv(incoming, source, tag=1)
                REDUCERS[op](total, widen(incoming), out=total)
        flat[...] = round_to(total, flat.dtype)
    else:
        comm.send(flat, root, tag=1)
    comm.bcast(flat, root=root)
    return flat.reshape(x.shape)


def recursive_doubling_allreduce(comm, x, op="sum", out=None):
    """log2(p) rounds of exchanging the whole array with the partner rank ^ distance
    (latency-optimal).

    For p not a power of two, the first p - 2^k ranks above 2^k fold their data into a partner first
    and get the result back at the end (Thakur, Rabenseifner & Gropp 2005, section 4.1).
    """
    _check_op(op)
    agree_on_array(comm, x, "recursive_doubling_allreduce")
    x_flat, flat = _contiguous_flat(x), _output(x, out)
    p, r = comm.size, comm.rank
    power = 1 << (p.bit_length() - 1)  # the largest power of two <= p
    extra = p - power
    if r >= power:  # fold into rank r - power, wait for the answer
        comm.send(x_flat, r - power, tag=2)
        comm.recv(flat, r - power, tag=3)
        return flat.reshape(x.shape)
    # What this rank holds so far: its own input (only read), then the partial result in flat.
    current, incoming = x_flat, array_module(flat).empty_like(flat)
    if r < extra:
        comm.recv(incoming, r + power, tag=2)
        reduce_into(flat, incoming, op, first=current)
        current = flat
    distance = 1
    while distance < power:
        partner = r ^ distance
        comm.sendrecv(current, partner, incoming, partner, tag=4)
        # a + b == b + a bit for bit: both partners compute the same value
        reduce_into(flat, incoming, op, first=current)
        current, distance = flat, distance * 2
    if current is not flat:  # one rank: nothing was reduced
        flat[...] = x_flat
    if r < extra:
        comm.send(flat, r + power, tag=3)
    return flat.reshape(x.shape)


ALGORITHMS = {
    "ring": ring_allreduce,
    "naive": naive_allreduce,
    "recursive_doubling": recursive_doubling_allreduce,
}


def choose_algorithm(nbytes, world_size, network=None):
    """The algorithm the cost model predicts fastest for this message size and world size."""
    return costmodel.fastest_allreduce(nbytes, world_size, network, candidates=tuple(ALGORITHMS))


def allreduce(comm, x, op="sum", algorithm="auto", network=None, out=None):
    """All-reduce with the named algorithm, or with the one the cost model picks ("auto"), the
    way MPI libraries switch from latency-optimal to bandwidth-optimal algorithms as messages
    grow."""
    if algorithm == "auto":
        algorithm = choose_algorithm(x.size * x.dtype.itemsize, comm.size, network)
    if algorithm not in ALGORITHMS:
        raise ValueError(
            f"unknown all-reduce algorithm {algorithm!r}: use auto or one of {sorted(ALGORITHMS)}"
        )
    return ALGORITHMS[algorithm](comm, x, op, out=out)
