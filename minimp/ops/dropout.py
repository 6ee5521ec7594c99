"""Dropout whose mask is a pure function of (seed, step, layer, sample, position): a counter hash.

Why not a random generator: a generator's output depends on how many numbers were drawn before,
so a data-parallel shard, a pipeline micro-batch or a recomputed activation would each draw a
different mask for the same sample. GPUs solve this with counter-based generators (Philox, Salmon
et al. 2011): a counter goes in, random bits come out, and any element can be drawn on its own.
minimp does the same with SplitMix64 (Steele, Lea & Flood 2014), vectorised on uint64 arrays:

    key  = mix(mix(mix(seed + g) + step + g) + layer + g)      one stream per (seed, step, layer)
    n    = sample * 2^32 + position                            position: flat index in the sample
    bits = mix(key + (n + 1) * g)                              SplitMix64's n-th output of `key`
    keep = bits >= p * 2^64                                    so P(keep) = 1 - p

with g = 0x9E3779B97F4A7C15 and mix SplitMix64's finalizer (all arithmetic mod 2^64). `sample` is
the sample's index in the global batch, so the rows a rank holds draw the same bits whatever the
layout; `position` runs over every element of one sample (row-major over the non-batch axes). A
rank that holds slice i of p equal slices of the sample's first axis (tensor parallelism's heads,
sequence parallelism's positions) holds a contiguous range of those positions and passes its start,
`offset`, so its elements draw the bits the whole tensor's would.
"""

from types import ModuleType

import numpy as np
import numpy.typing as npt

from minimp.backend import Array, array_module, to_numpy
from minimp.function import Context, Function
from minimp.precision.casting import round_to, widen

_GOLDEN_GAMMA = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio, odd: SplitMix64's increment
_MASK64 = 2**64 - 1


def _mix(z: Array) -> Array:
    """SplitMix64's finalizer on a uint64 array (NumPy and CuPy wrap uint64 arithmetic mod 2^64)
    or NumPy scalar (which wraps too, with a warning: stream_key silences it)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def stream_key(seed: int, step: int, layer: int) -> int:
    """The 64-bit key of one (seed, step, layer) stream."""
    key: Array | np.uint64 = np.uint64(0)  # a scalar: ~5 us here, a 1-element array ~17 us
    with np.errstate(over="ignore"):  # the wrap-around mod 2^64 is the hash's arithmetic
        for word in (seed, step, layer):
            key = _mix(key + np.uint64(word & _MASK64) + _GOLDEN_GAMMA)
    return int(key)


def keep_mask(shape: tuple[int, ...], p: float, seed: int, step: int, layer: int,
              sample_indices: npt.ArrayLike, xp: ModuleType = np, offset: int = 0) -> Array:
    """Bool array of `shape` (batch axis first): True where dropout keeps the element.

    Row r holds global sample `sample_indices[r]`; the mask is the same wherever that sample is.
    `offset`: the position, within its sample, of this array's first element (0 unless the array
    is a slice of a larger one).
    """
    samples = to_numpy(sample_indices).reshape(-1)  # a few ints: checked on the host
    per_sample = int(np.prod(shape[1:], dtype=np.int64))
    if len(samples) != shape[0]:
        raise ValueError(f"dropout: {len(samples)} sample indices for a batch of {shape[0]} rows")
    if samples.size and (int(samples.min()) < 0 or int(samples.max()) >= 2**32):
        raise ValueError("dropout: sample indices must lie in 0..2^32 - 1")
    if offset < 0 or offset + per_sample >= 2**32:
        raise ValueError("dropout: a sample may hold at most 2^32 - 1 elements")
    samples = xp.asarray(samples.astype(np.uint64))
    positions = xp.arange(offset, offset + per_sample, dtype=np.uint64)
    counters = (samples[:, None] << np.uint64(32)) | positions[None, :]  # (B, elements)
    key = np.uint64(stream_key(seed, step, layer))
    bits = _mix((counters + np.uint64(1)) * _GOLDEN_GAMMA + key)  # arrays on the left
    threshold = np.uint64(min(int(p * 2.0**64), _MASK64))
    return (bits >= threshold).reshape(shape)


class Dropout(Function):
    """y = x * keep / (1 - p);  dL/dx = dL/dy * keep / (1 - p)   (keep from `keep_mask`).

    Backward keeps the mask as bools (1 byte an element, as Korthikanti et al. count it). Redrawing
    it from the counters instead, as FlashAttention does with Philox, would save that memory for
    the time of a second hash.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, p: float, seed: int, step: int, layer: int,
                sample_indices: npt.ArrayLike, offset: int = 0) -> Array:
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1), got {p}")
        keep = keep_mask(x.shape, p, seed, step, layer, sample_indices, array_module(x), offset)
        ctx.save_for_backward(keep)
        ctx.scale = 1.0 / (1.0 - p)
        return _masked_scale(x, keep, ctx.scale)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (keep,) = ctx.saved_arrays
        return _masked_scale(grad_output, keep, ctx.scale)


def _masked_scale(x: Array, keep: Array, scale: float) -> Array:
    """x * scale where keep, exactly 0 elsewhere (where, not a product: inf * 0 would be NaN)."""
    wide = widen(x)
    return round_to(array_module(x).where(keep, wide * scale, wide.dtype.type(0)), x.dtype)
