"""float32 <-> float16 casts written from the IEEE bit layout, in NumPy and compiled by numba.

Why minimp has its own: NumPy's astype converts float16 one element at a time here (1.6-2.5 ns
per element, against 0.3 ns for a float32 copy), and a result that overflows, underflows or lands
among float16's subnormals takes a slow path of ~65 ns, which also raises a floating-point flag
(minimp's casts raise none, so NumPy's "overflow encountered in cast" warning does not appear). The
conversion is a dozen integer operations on the bits, the same for every element, so it vectorises:
numba compiles the loop in halfcast_numba.py to SIMD code, 0.4-0.7 ns per element. Both
implementations give NumPy's astype bit for bit, on every float32 bit pattern
(benchmarks/cast_bench.py --exhaustive checks all 2^32) and every float16 one.

The bit layouts (sign | exponent | fraction), with the exponent stored plus a bias:

    float32: 1 | 8 bits, bias 127 | 23 bits        float16: 1 | 5 bits, bias 15 | 10 bits

A normal number is (-1)^sign * 1.fraction * 2^(exponent - bias); exponent 0 holds zero and the
subnormals 0.fraction * 2^(1 - bias); the largest exponent holds infinity (fraction 0) and NaN.

NaN: a float32 NaN becomes a float16 NaN with the same sign and the top 10 of its 23 fraction
bits, so a quiet NaN (top fraction bit set) stays quiet; when those 10 bits are all zero the lowest
one is set, or the result would read as infinity. That is what NumPy's C code does. The F16C
instruction would also set the quiet bit; NumPy, and so minimp, leaves a signalling NaN signalling.
float16 -> float32 keeps the sign and the whole fraction, shifted up: exact, NaNs included.

Which implementation runs: the one the innermost `with casts("numba" | "numpy" | "astype"):`
block around the cast names, in the thread that entered it; outside any block, the environment
variable MINIMP_HALF_CASTS (read once), else numba when it is installed (`pip install
'minimp[fast]'`), else NumPy's own astype, which beats the NumPy version below except where its
slow path starts.
"""

import os
from contextlib import contextmanager
from contextvars import ContextVar
from functools import cache
from typing import Iterator

import numpy as np
from numpy.typing import DTypeLike

from minimp.precision import halfcast_numba

IMPLEMENTATIONS = ("numba", "numpy", "astype")
ENVIRONMENT_VARIABLE = "MINIMP_HALF_CASTS"

# The innermost casts(...) block's choice, None outside any. A context variable, as
# decimal.localcontext keeps its precision: each thread starts outside every block (the simulated
# world's ranks, threads, take the default even when started inside one).
_chosen: ContextVar[str | None] = ContextVar("minimp_half_casts", default=None)

SMALL_ARRAY = 1024  # elements; below this astype is faster than a call into numba
NUMPY_CHUNK = 65536  # elements; 256 KiB of float32 per temporary

# float16's smallest normal, 2^-14, as a float32 exponent field (biased by 127): 113 - 127 = -14.
# Below it, float16 results are subnormal.
SMALLEST_NORMAL_EXPONENT = 113
BIAS_DIFFERENCE = 127 - 15  # a float16 exponent field is the float32 one minus 112


def float32_to_float16_numpy(array: np.ndarray) -> np.ndarray:
    """float32 -> float16 bits with round to nearest, ties to even, in NumPy integer operations."""
    bits = array.view(np.uint32)
    sign = (bits >> 16) & 0x8000  # the sign bit moves from bit 31 to bit 15
    magnitude = bits & 0x7FFFFFFF  # the rest orders like the value: compare it as an integer
    exponent = magnitude >> 23
    # How many fraction bits of float32's 24-bit significand (the leading 1 included) are dropped:
    # 13 (23 - 10) for float16 normals, one more per power of two below 2^-14, where the result is a
    # subnormal of spacing 2^-24. Capped at 25: anything shifted further is below half of 2^-24 and
    # rounds to zero anyway, and a shift past 31 bits is undefined in C and LLVM.
    shift = np.minimum(126 - np.minimum(exponent, SMALLEST_NORMAL_EXPONENT), 25)
    is_subnormal = exponent < SMALLEST_NORMAL_EXPONENT
    # Normal result: rebias the exponent where it stands, so that the 13-bit shift below leaves
    # exponent and fraction side by side, float16's layout. Subnormal result: the significand with
    # its leading 1 written out, which the longer shift turns into a count of 2^-24 steps (float32's
    # zero and subnormals gain a 1 they lack, harmlessly: shifted by 25, they round to 0 all the
    # same). np.where computes both sides for every element; the unused one may wrap around.
    significand = np.where(
        is_subnormal, (magnitude & 0x007FFFFF) | 0x00800000, magnitude - (BIAS_DIFFERENCE << 23))
    rounded = _shift_rounding_to_even(significand, shift)
    # A carry out of the fraction raises the exponent: that is how a value just under 2^-14 rounds
    # up to the smallest normal and 65520 overflows. Exponent field 31 (0x7C00) or more is infinity.
    finite = np.minimum(rounded, 0x7C00)
    half = np.where(magnitude > 0x7F800000, _nan_bits(magnitude), finite)
    return (half | sign).astype(np.uint16).view(np.float16)


def _shift_rounding_to_even(significand: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """significand >> shift, rounded to nearest with ties to even, without a branch."""
    # Adding just under half a unit of the kept part carries into it exactly when the dropped bits
    # are more than half; adding the kept part's lowest bit as well makes an exact half carry only
    # when that bit is 1, which leaves the kept part even either way. Then truncate.
    almost_half = (np.uint32(1) << (shift - 1)) - 1
    lowest_kept_bit = (significand >> shift) & 1
    return (significand + almost_half + lowest_kept_bit) >> shift


def _nan_bits(magnitude: np.ndarray) -> np.ndarray:
    """The float16 NaN NumPy makes of a float32 NaN: the top 10 fraction bits, kept nonzero."""
    fraction = (magnitude >> 13) & 0x03FF
    return 0x7C00 | fraction | (fraction == 0)


def float16_to_float32_numpy(array: np.ndarray) -> np.ndarray:
    """float16 -> float32, exactly, in NumPy integer operations (and two float ones for
    subnormals)."""
    bits = array.view(np.uint16).astype(np.uint32)
    sign = (bits & 0x8000) << 16
    exponent = (bits >> 10) & 0x1F
    # Normals: the fraction moves up 13 bits and the exponent field gains 112 (the bias difference);
    # infinity and NaN (exponent 31) must land on float32's 255, so they gain 224.
    shifted = (bits & 0x7FFF) << 13
    rebias = np.where(exponent == 31, np.uint32(224 << 23), np.uint32(BIAS_DIFFERENCE << 23))
    normal = shifted + rebias
    # A subnormal (or zero) is fraction * 2^-24. float32 holds that as a normal number, which needs
    # the fraction's leading 1 found and moved: converting the 10-bit integer to float32 and scaling
    # by a power of two lets the hardware do it, exactly.
    fraction = (bits & 0x03FF).astype(np.float32) * np.float32(2.0**-24)
    result = np.where(exponent == 0, fraction.view(np.uint32), normal)
    return (result | sign).view(np.float32)


@contextmanager
def casts(name: str) -> Iterator[None]:
    """Inside the block, casting.widen and round_to convert NumPy float16 arrays with `name`
    ("numba", "numpy" or "astype"); blocks nest, and leaving one restores the choice before it."""
    token = _chosen.set(_checked(name))
    try:
        yield
    finally:
        _chosen.reset(token)


def selected_casts() -> str:
    """The implementation in use: the innermost casts(...) block's, else default_casts()."""
    return _chosen.get() or default_casts()


@cache  # read at the first cast outside any block, once per process
def default_casts() -> str:
    """MINIMP_HALF_CASTS when it is set, else numba when it is installed, else astype."""
    default = "numba" if halfcast_numba.available() else "astype"
    return _checked(os.environ.get(ENVIRONMENT_VARIABLE, "").strip().lower() or default)


def _checked(name: str) -> str:
    """name, or a ValueError unless it is an implementation this process can run."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"unknown float16 cast {name!r}: use one of {', '.join(IMPLEMENTATIONS)}")
    if name == "numba" and not halfcast_numba.available():
        raise ValueError("float16 cast 'numba' needs numba: pip install 'minimp[fast]'")
    return name


def to_float16(array: np.ndarray, implementation: str | None = None) -> np.ndarray:
    """A float32 NumPy array rounded into float16 by the selected (or the named) implementation."""
    return _cast(array, implementation or selected_casts(), np.float16)


def to_float32(array: np.ndarray, implementation: str | None = None) -> np.ndarray:
    """A float16 NumPy array widened to float32 by the selected (or the named) implementation."""
    return _cast(array, implementation or selected_casts(), np.float32)


def _cast(array: np.ndarray, implementation: str, dtype: DTypeLike) -> np.ndarray:
    # The bit tricks run over one contiguous block of memory; a small array, where a call costs
    # more than the work (numba's ~1.5 us against astype's ~0.3 us), takes astype.
    if implementation == "astype" or array.size < SMALL_ARRAY:
        return array.astype(dtype)
    # The result is laid out in memory as astype lays it out (its order="K"): the axes in the
    # order of the input's strides, largest first. Read in that order, a C- or Fortran-ordered
    # array is one block already; a strided view (attention's heads, a slice) is gathered into
    # one by a copy of its 16 or 32 bits, which costs less than astype's own float16 conversion
    # (1.6-2.5 ns an element, benchmarks/cast_bench.py) takes over the numba path's.
    convert = halfcast_numba.cast if implementation == "numba" else _numpy_in_chunks
    if array.flags.c_contiguous:  # most casts: no strides to look at (3 us a call less)
        return convert(array.reshape(-1), dtype).reshape(array.shape)
    order = sorted(range(array.ndim), key=lambda axis: -abs(array.strides[axis]))
    in_memory_order = np.ascontiguousarray(array.transpose(order))
    result = convert(in_memory_order.reshape(-1), dtype).reshape(in_memory_order.shape)
    return result.transpose(np.argsort(order))


def _numpy_in_chunks(flat: np.ndarray, dtype: DTypeLike) -> np.ndarray:
    """The NumPy implementation a chunk at a time: its ~30 temporaries then stay in the L2 cache
    instead of each making a trip to memory (3-4x faster on a million elements)."""
    convert = float32_to_float16_numpy if dtype == np.float16 else float16_to_float32_numpy
    result = np.empty(flat.shape, dtype)
    for start in range(0, flat.size, NUMPY_CHUNK):
        result[start : start + NUMPY_CHUNK] = convert(flat[start : start + NUMPY_CHUNK])
    return result
