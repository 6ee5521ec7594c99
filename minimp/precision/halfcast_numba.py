"""halfcast's float32 <-> float16 algorithm compiled by numba, which is imported when first used.

The loops mirror halfcast's NumPy functions step for step (see there for why each step works).
Here each element goes through the steps in registers, in one pass over memory. Each `if` only
assigns a value computed from registers, so LLVM turns it into a select, not a branch, and the
whole loop into SIMD code (16 int32 lanes with AVX-512). numba is an optional dependency: without
it `available()` is False and halfcast does not offer this path.
"""

from functools import cache
from typing import Any

import numpy as np
from numpy.typing import DTypeLike


@cache
def available() -> bool:
    """True when numba imports (`pip install 'minimp[fast]'`); asked at the first float16 cast."""
    try:
        import numba  # noqa: F401  (a numba built for another NumPy raises ImportError here)
    except ImportError:
        return False
    return True


def cast(flat: np.ndarray, dtype: DTypeLike, parallel: bool = False) -> np.ndarray:
    """A 1-D contiguous float32 array rounded to float16, or a float16 one widened to float32.
    parallel=True splits the loop over numba's threads (measured in benchmarks/cast_bench.py)."""
    to_float16, to_float32 = _compiled(parallel)
    if np.dtype(dtype) == np.float16:
        result = np.empty(flat.shape, np.uint16)
        to_float16(flat.view(np.uint32), result)
        return result.view(np.float16)
    result = np.empty(flat.shape, np.uint32)
    to_float32(flat.view(np.uint16), result)
    return result.view(np.float32)


@cache
def _compiled(parallel: bool) -> tuple[Any, Any]:
    """Compile both loops once per process; prange is a plain range unless parallel is True."""
    import numba

    # numba caches the serial machine code on disk between runs. Not the parallel one: its cache
    # entry would share the serial one's name, and either could then be loaded for the other.
    cache = not parallel

    # int32 throughout: every intermediate fits (the largest is a NaN's magnitude, under 2^31), and
    # 32-bit lanes are twice as many per SIMD register as numba's default 64-bit integers.
    i32 = np.int32

    @numba.njit(cache=cache, parallel=parallel)
    def float32_bits_to_float16_bits(bits: np.ndarray, out: np.ndarray) -> None:
        for index in numba.prange(bits.size):
            word = i32(bits[index])  # the same 32 bits: float32's sign is the int32's sign
            sign = (word >> i32(16)) & i32(0x8000)  # bit 31 -> bit 15
            magnitude = word & i32(0x7FFFFFFF)  # orders like |value|
            exponent = magnitude >> i32(23)
            # 13 bits dropped for a normal result, one more per binade below 2^-14, at most 25
            shift = min(i32(126) - min(exponent, i32(113)), i32(25))
            if exponent < i32(113):  # subnormal result: the significand with its leading 1
                significand = (magnitude & i32(0x007FFFFF)) | i32(0x00800000)
            else:  # normal result: the exponent rebiased from 127 to 15 where it stands
                significand = magnitude - i32(112 << 23)
            # round to nearest, ties to even: add just under half, plus the lowest kept bit
            almost_half = (i32(1) << (shift - i32(1))) - i32(1)
            lowest_kept_bit = (significand >> shift) & i32(1)
            rounded = (significand + almost_half + lowest_kept_bit) >> shift
            half = min(rounded, i32(0x7C00))  # exponent field 31 or more: infinity
            fraction = (magnitude >> i32(13)) & i32(0x03FF)
            if magnitude > i32(0x7F800000):  # NaN: the top 10 fraction bits, kept nonzero
                half = i32(0x7C00) | fraction | i32(fraction == i32(0))
            out[index] = np.uint16(half | sign)

    @numba.njit(cache=cache, parallel=parallel)
    def float16_bits_to_float32_bits(bits: np.ndarray, out: np.ndarray) -> None:
        for index in numba.prange(bits.size):
            word = i32(bits[index])
            sign = (word & i32(0x8000)) << i32(16)  # bit 15 -> bit 31
            exponent = (word >> i32(10)) & i32(0x1F)
            shifted = (word & i32(0x7FFF)) << i32(13)  # exponent and fraction move up together
            # rebias 15 -> 127 (+112); infinity and NaN, 31, must land on 255 (+224)
            rebias = i32(224 << 23) if exponent == i32(31) else i32(112 << 23)
            result = shifted + rebias
            if exponent == i32(0):  # zero or subnormal: fraction * 2^-24, normalised by the FPU
                # numba's view() (a bit cast) wants an explicitly typed NumPy scalar
                subnormal = np.float32(np.float32(word & i32(0x03FF)) * np.float32(2.0**-24))
                result = subnormal.view(np.int32)
            out[index] = np.uint32(result | sign)

    return float32_bits_to_float16_bits, float16_bits_to_float32_bits
