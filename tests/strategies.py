"""Shared hypothesis strategies: float16 values including subnormals, infinities and NaN."""

import numpy as np
from hypothesis import strategies as st

FLOAT16_MAX = 65504.0
SMALLEST_SUBNORMAL = 2.0**-24
SMALLEST_NORMAL = 2.0**-14


def float16_bits():
    """Every float16 bit pattern: normals, subnormals, zeros, infinities and NaNs alike."""
    return st.integers(0, 0xFFFF).map(
        lambda bits: np.array(bits, np.uint16).view(np.float16).item()
    )


def finite_float16():
    return float16_bits().filter(np.isfinite)


def normal_range_floats():
    """float64 values whose magnitude lies in float16's normal range."""
    magnitude = st.floats(SMALLEST_NORMAL, FLOAT16_MAX, allow_nan=False, allow_infinity=False)
    return st.tuples(magnitude, st.booleans()).map(lambda pair: -pair[0] if pair[1] else pair[0])


def small_arrays(min_side=1, max_side=5, ndim=2):
    """Shapes for float64 op checks."""
    return st.lists(st.integers(min_side, max_side), min_size=ndim, max_size=ndim).map(tuple)


def float32_bits():
    """float32 bit patterns: any at all, or ones near float16's range, where rounding is decided."""
    anywhere = st.integers(0, 0xFFFFFFFF)
    near_float16 = st.integers(0x33000000, 0x47800000)  # 2^-25 up to 2^16
    signed = st.tuples(near_float16, st.booleans()).map(lambda pair: pair[0] | pair[1] << 31)
    return st.one_of(anywhere, signed, st.sampled_from([0x7F800000, 0x7F800001, 0xFFC00000]))
