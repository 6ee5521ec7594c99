"""The ring all-reduce, whole: a reduce-scatter, then an all-gather, each p - 1 steps of Sendrecv.

Rank r sends to r + 1 and receives from r - 1. The array is cut into p chunks. In the
reduce-scatter, at step s rank r sends its partial sum of chunk (r - s - 1) mod p and adds the
incoming chunk (r - s - 2) mod p into its own; after p - 1 steps rank r holds chunk r summed
over all ranks. The all-gather then passes the finished chunks around the ring. Each rank sends
2(p - 1) messages holding 2(p - 1)/p of the array in all, which no all-reduce can beat in
bandwidth (Patarasuk & Yuan 2009).

Every rank ends bit-identical: each chunk is summed once, on one rank, then copied byte for byte.

Accumulation: partial sums travel in the array's own dtype (float16 halves the bytes, which is
the point of sending float16), but every addition widens both operands to float32 and rounds
once, so a float16 result carries at most p - 1 roundings of 2^-11 relative each, not the
swamping of float16 additions.

The two halves are also collectives of their own; ZeRO builds on `reduce_scatter` and `all_gather`.
"""

import functools
from typing import Sequence

from minimp.backend import Array, array_module
from minimp.distributed.buffers import agree_on_array, agree_on_layout, checked_allreduce
from minimp.distributed.buffers import contiguous_flat
from minimp.distributed.buffers import reduce_into
from minimp.distributed.protocol import Communicator, Tag, check_op
from minimp.distributed.staging import host_staged, stages_through_host

Bounds = Sequence[tuple[int, int]]  # (start, stop) of each rank's chunk, in rank order


@functools.lru_cache(maxsize=1024)  # the same few sizes every step: a collective's plan, once
def chunk_bounds(length: int, parts: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) of `parts` nearly equal chunks covering range(length); the first length % parts
    chunks get one extra element. Chunks may be empty when length < parts."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def ring_step(comm: Communicator, bounds: Bounds,
              behind: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(bounds of the chunk rank r sends to the right, of the one it receives from the left) when
    it sends chunk r - behind (mod p) and so receives chunk r - behind - 1. Reduce-scatter step s
    sends chunk r - s - 1 (behind = s + 1), all-gather step s chunk r - s (behind = s)."""
    p, r = comm.size, comm.rank
    return bounds[(r - behind) % p], bounds[(r - behind - 1) % p]


def ring_reduce_scatter_into(comm: Communicator, x: Array, out: Array, bounds: Bounds,
                             op: str = "sum") -> None:
    """Reduce-scatter around the ring: afterwards out[bounds[rank]] holds that chunk reduced over
    all ranks. x (flat, contiguous) is only read; out receives the partial sums.

    No copy of x is made first: each incoming partial sum is received straight into its
    place in out and this rank's share is added there, so every byte is read and written
    as few times as possible.
    """
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        (send_start, send_stop), (recv_start, recv_stop) = ring_step(comm, bounds, step + 1)
        # At step 0 we send our own share; later, the partial sum we finished one step earlier.
        outgoing = (x if step == 0 else out)[send_start:send_stop]
        incoming = out[recv_start:recv_stop]
        comm.sendrecv(outgoing, right, incoming, left, tag=Tag.RING_REDUCE_SCATTER)
        reduce_into(incoming, x[recv_start:recv_stop], op)


def ring_all_gather_inplace(comm: Communicator, flat: Array, bounds: Bounds) -> None:
    """All-gather around the ring: rank r starts with chunk r final and receives the others straight
    into place in flat (no staging copies)."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        (send_start, send_stop), (recv_start, recv_stop) = ring_step(comm, bounds, step)
        outgoing, incoming = flat[send_start:send_stop], flat[recv_start:recv_stop]
        comm.sendrecv(outgoing, right, incoming, left, tag=Tag.RING_ALL_GATHER)


def ring_allreduce(comm: Communicator, x: Array, op: str = "sum",
                   out: Array | None = None) -> Array:
    """All-reduce by reduce-scatter + all-gather around a ring (bandwidth-optimal for large arrays).
    Returns a new array shaped like x, or `out` when given (it must not overlap x)."""
    if stages_through_host(comm, x):  # one copy each way, not one per message (staging.py)
        return host_staged(ring_allreduce, comm, x, op, out)
    return checked_allreduce(ring_allreduce_into, "ring_allreduce", comm, x, op, out)


def ring_allreduce_into(comm: Communicator, flat_x: Array, flat_out: Array,
                        op: str = "sum") -> None:
    """The ring's messages and additions alone, on flat arrays (p >= 2; no checks, no agreement:
    ring_allreduce and PersistentAllreduce (collectives.py) make them)."""
    bounds = chunk_bounds(flat_x.size, comm.size)
    ring_reduce_scatter_into(comm, flat_x, flat_out, bounds, op)
    ring_all_gather_inplace(comm, flat_out, bounds)


def reduce_scatter(comm: Communicator, x: Array, op: str = "sum") -> Array:
    """This rank's chunk (chunk_bounds(x.size, p)[rank]) of the reduction of x over all ranks."""
    check_op(op)
    agree_on_layout(comm, x.size, x.dtype, "reduce_scatter", op)
    flat_x = contiguous_flat(x)
    bounds = chunk_bounds(flat_x.size, comm.size)
    start, stop = bounds[comm.rank]
    if comm.size == 1:
        return flat_x[start:stop].copy()
    out = array_module(x).empty_like(flat_x)
    ring_reduce_scatter_into(comm, flat_x, out, bounds, op)
    return out[start:stop].copy()


def all_gather(comm: Communicator, chunk: Array, length: int | None = None) -> Array:
    """Concatenate every rank's chunk in rank order. Chunk sizes follow chunk_bounds(length, p);
    `length` defaults to p * chunk.size (equal chunks)."""
    length = comm.size * chunk.size if length is None else length
    bounds = chunk_bounds(length, comm.size)
    start, stop = bounds[comm.rank]
    if chunk.size != stop - start:
        raise ValueError(f"all_gather: rank {comm.rank} holds {chunk.size} elements but chunk "
                         f"{comm.rank} of {length} over {comm.size} ranks has {stop - start}")
    flat = array_module(chunk).empty(length, chunk.dtype)
    agree_on_array(comm, flat, "all_gather")
    flat[start:stop] = chunk.reshape(-1)
    ring_all_gather_inplace(comm, flat, bounds)  # p - 1 steps: none on one rank
    return flat
