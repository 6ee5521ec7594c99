"""The ring all-reduce, from scratch: a reduce-scatter, then an all-gather, each p - 1 steps of
Sendrecv.

Rank r sends to r + 1 and receives from r - 1. The array is cut into p chunks. In the
reduce-scatter, at step s rank r sends its partial sum of chunk (r - s - 1) mod p and adds the
incoming chunk (r - s - 2) mod p into its own; after p - 1 steps rank r holds chunk r summed over
all ranks. The all-gather then passes the finished chunks around the ring. Each rank sends 2(p - 1)
messages holding 2(p - 1)/p of the array in all, which no all-reduce can beat in bandwidth
(Patarasuk & Yuan 2009).

Every rank ends bit-identical: each chunk is summed once, on one rank, and then copied byte for
byte.

Accumulation: partial sums travel in the array's own dtype (float16 halves the bytes, which is the
point of sending float16), but every addition widens both operands to float32 and rounds once, so a
float16 result carries at most p - 1 roundings of 2^-11 relative each, not the swamping of float16
additions.
"""

import numpy as np

from minimp.precision.casting import round_to, widen

REDUCERS = {"sum": np.add, "max": np.maximum, "min": np.minimum}


def chunk_bounds(length, parts):
    """(start, stop) of `parts` nearly equal chunks covering range(length); the first length % parts
    chunks get one extra element. Chunks may be empty when length < parts."""
    base, extra = divmod(length, parts)
    bounds, start = [], 0
    for index in range(parts):
        stop = start + base + (1 if index < extra else 0)
        bounds.append((start, stop))
        start = stop
    return bounds


def reduce_into(target, incoming, op, first=None):
    """target = op(first, incoming) in place (first defaults to target itself), computed in float32
    for 16-bit dtypes. Reading `first` from another array saves copying it into target beforehand."""
    if target.size == 0:
        return
    reducer = REDUCERS[op]
    first = target if first is None else first
    if target.dtype == widen(target).dtype:
        reducer(first, incoming, out=target)  # float32/float64: no temporary
    else:
        target[...] = round_to(reducer(widen(first), widen(incoming)), target.dtype)


def ring_reduce_scatter(comm, x, out, bounds, op="sum"):
    """Reduce-scatter around the ring: afterwards out[bounds[rank]] holds that chunk reduced over
    all ranks. x (flat, contiguous) is only read; out receives the partial sums.

    No copy of x is made first: each incoming partial sum is received straight into its place in out
    and this rank's share is added there, so every byte is read and written as few times as
    possible.
    """
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_start, send_stop = bounds[(r - step - 1) % p]
        recv_start, recv_stop = bounds[(r - step - 2) % p]
        # At step 0 we send our own share; later, the partial sum we finished one step earlier.
        outgoing = (x if step == 0 else out)[send_start:send_stop]
        incoming = out[recv_start:recv_stop]
        comm.sendrecv(outgoing, right, incoming, left, tag=step)
        reduce_into(incoming, x[recv_start:recv_stop], op)


def ring_all_gather_inplace(comm, flat, bounds):
    """All-gather around the ring: rank r starts with chunk r final and receives the others straight
    into place in flat (no staging copies)."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    for step in range(p - 1):
        send_start, send_stop = bounds[(r - step) % p]
        recv_start, recv_stop = bounds[(r - step - 1) % p]
        comm.sendrecv(
            flat[send_start:send_stop], right, flat[recv_start:recv_stop], left, tag=p + step
        )
