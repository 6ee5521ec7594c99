"""What every collective does around moving bytes: agree on the array, lay out flat buffers, reduce.

Before any data moves, the ranks agree on the array's length and dtype (and the op) with one tiny
all-reduce, so a mismatch is a clear error on every rank instead of a hang or a wrong sum.
Recursive doubling carries the same check inside its messages instead (headers.py) and makes that
all-reduce only to name a disagreement it found (raise_disagreement). Results go into flat
contiguous buffers (the caller's `out`, reused step after step, or a new one); the caller's input
is only read. Reductions of 16-bit arrays widen both operands to float32 and round once.
"""

from typing import Callable

import ml_dtypes
import numpy as np

from minimp.backend import Array, array_module
from minimp.distributed.protocol import REDUCE_OPS, Communicator, check_op
from minimp.precision.casting import LOW_PRECISION_DTYPES, round_to, widen

# An all-reduce's messages and additions alone, (comm, x_flat, out_flat, op), for p >= 2: what runs
# once the checks are made (by checked_allreduce at every call, by PersistentAllreduce once).
AllreduceBody = Callable[[Communicator, Array, Array, str], None]

# dtype -> the number that stands for it in the agreement (looked up by dtype: no name to build)
_DTYPE_CODES = {np.dtype(dtype): code for dtype, code in (
    (np.float16, 1), (ml_dtypes.bfloat16, 2), (np.float32, 3), (np.float64, 4), (np.int32, 5),
    (np.int64, 6))}
_OP_CODES = {name: code for code, name in enumerate(REDUCE_OPS)}  # sum 0, max 1, min 2


class CollectiveMismatchError(ValueError):
    """Ranks called the same collective with arrays of different lengths or dtypes (or ops)."""


def dtype_code(dtype: np.dtype) -> int:
    """The number that stands for dtype in an agreement or a header (99: a dtype without one)."""
    return _DTYPE_CODES.get(dtype, 99)


def op_code(op: str) -> int:
    """The number that stands for a reduce op: its place in REDUCE_OPS (sum 0, max 1, min 2)."""
    return _OP_CODES[op]


def agree_on_array(comm: Communicator, array: Array, name: str) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks pass the same length and
    dtype (agree_on_layout of the array's)."""
    agree_on_layout(comm, array.size, array.dtype, name)


def agree_on_layout(comm: Communicator, size: int, dtype: np.dtype, name: str,
                    op: str | None = None) -> None:
    """Raise CollectiveMismatchError on every rank unless all ranks name the same length and
    dtype (and op, when given). One all-reduce of six numbers: the max of (size, dtype code, op
    code or -1 for none) and of their negatives."""
    if comm.size == 1:
        return
    code, operation = _DTYPE_CODES.get(dtype, 99), -1 if op is None else _OP_CODES[op]
    # (written out: a small message pays for every Python call it makes)
    highest = comm.allreduce_scalars([size, code, operation, -size, -code, -operation], op="max")
    if highest[0] != -highest[3] or highest[1] != -highest[4] or highest[2] != -highest[5]:
        lowest = -highest[3:]
        ranges = [f"lengths {int(lowest[0])}..{int(highest[0])}",
                  f"dtype codes {int(lowest[1])}..{int(highest[1])}"]
        must = "length and dtype"
        if op is not None:
            names = list(REDUCE_OPS)
            ranges.append(f"ops {names[int(lowest[2])]}..{names[int(highest[2])]}")
            must = "length, dtype and op"
        raise CollectiveMismatchError(f"{name}: ranks disagree on the array ({', '.join(ranges)});"
                                      f" every rank must pass the same {must}")


def raise_disagreement(comm: Communicator, size: int, dtype: np.dtype, op: str,
                       name: str) -> None:
    """Raise the CollectiveMismatchError that agree_on_layout raises, on every rank: called by
    all ranks together once the headers of a collective have told each that they disagree."""
    agree_on_layout(comm, size, dtype, name, op)
    # not reached unless a communicator delivered headers that no rank sent
    raise CollectiveMismatchError(f"{name}: a message's header disagreed with its receiver's "
                                  "layout, but the ranks' layouts agree")


def contiguous_flat(x: Array) -> Array:
    """x as a flat contiguous array (a view when it already is one; it is only read)."""
    if x.ndim == 1 and x.flags.c_contiguous:  # a bucket, a flat gradient: as it is, no calls
        return x
    return array_module(x).ascontiguousarray(x).reshape(-1)


def output_buffer(x: Array, out: Array | None = None) -> Array:
    """The flat array a result goes into: `out` (reused by callers that all-reduce every step, which
    saves the page faults of a fresh allocation) or a new array shaped like x."""
    if out is None:
        return array_module(x).empty(x.size, x.dtype)
    if out.shape != x.shape or out.dtype != x.dtype or not out.flags.c_contiguous:
        raise ValueError(f"out must be a C-contiguous {x.dtype} array of shape {x.shape}")
    # (NumPy asked directly for NumPy arrays: a small message pays for every call it makes)
    xp = np if type(x) is np.ndarray else array_module(x)
    if xp.may_share_memory(out, x):
        raise ValueError("out must not overlap x (x is read while out is written)")
    return out if out.ndim == 1 else out.reshape(-1)


def flat_copy(x: Array, out: Array | None = None) -> Array:
    """A contiguous 1-D copy to reduce into (the caller's array is never modified)."""
    flat = output_buffer(x, out)
    flat[...] = x.reshape(-1)
    return flat


def reduce_into(target: Array, incoming: Array, op: str, first: Array | None = None) -> None:
    """target = op(first, incoming) in place (first defaults to target itself), computed in float32
    for 16-bit dtypes. Reading `first` from another array saves copying it into target first."""
    if target.size == 0:
        return
    reducer = REDUCE_OPS[op]
    first = target if first is None else first
    if target.dtype not in LOW_PRECISION_DTYPES:
        reducer(first, incoming, out=target)  # float32/float64: no temporary
    else:
        target[...] = round_to(reducer(widen(first), widen(incoming)), target.dtype)


def checked_allreduce(body: AllreduceBody, name: str, comm: Communicator, x: Array, op: str,
                      out: Array | None) -> Array:
    """body's reduction of x over the ranks, with what every all-reduce does around it: the op
    checked, the ranks agreed on the array and the op (or CollectiveMismatchError on all), the
    result in `out` or a new array, shaped like x. On one rank it is a copy of x."""
    check_op(op)
    agree_on_layout(comm, x.size, x.dtype, name, op)
    if comm.size == 1:
        return flat_copy(x, out).reshape(x.shape)
    flat = output_buffer(x, out)
    body(comm, contiguous_flat(x), flat, op)
    return flat.reshape(x.shape)
