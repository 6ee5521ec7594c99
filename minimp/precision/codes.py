"""The small float formats' codes, made fast: float32 rounded into a format by a numba loop on the
bits, codes decoded from a 256-entry table; bit for bit ml_dtypes' casts, at a few percent of their
time.

ml_dtypes casts one element at a time through a generic conversion (about 30 ns an element here,
each way), which made the block-scaled recipes' casts cost more than their GEMMs. A format with
m fraction bits and smallest normal exponent emin (blocks.ElementFormat) holds, below 2^emin, the
multiples of 2^(emin - m), and from 2^emin up, m + 1 significant bits. So for a float32 x with
|x| <= the format's max (callers clip: the formats saturate there, ml_dtypes would not):

    |x| <  2^emin   code = rint(|x| * 2^(m - emin))   exact scaling, then ties to even; the
                                                     result 2^m is the smallest normal's code
    |x| >= 2^emin   round the float32 bits to m fraction bits, ties to even (a carry raises the
                    exponent, as it should), then move the exponent's bias from float32's 127 to
                    the format's: code = bits >> (23 - m) minus (127 + emin - 1) << m

and the sign goes above the magnitude's bits. NaN and infinities are left to ml_dtypes (whose NaN
codes differ by format: E4M3 0x7F, E5M2 0x7E, E2M1 none: -0). Without numba `encode` is
ml_dtypes' cast; `decode` is a table lookup either way.
"""

from functools import cache
from typing import TYPE_CHECKING, Any

import numpy as np

from minimp.precision.halfcast_numba import available

if TYPE_CHECKING:
    from minimp.precision.blocks import ElementFormat

FLOAT32 = np.dtype(np.float32)


def encode(x: np.ndarray, fmt: "ElementFormat") -> np.ndarray:
    """float32 x (|x| <= fmt.max, or not finite) as fmt's dtype, rounded to nearest, ties to even:
    ml_dtypes' `x.astype(fmt.dtype)`, bit for bit."""
    x = np.ascontiguousarray(x, FLOAT32).reshape(np.shape(x))  # a 0-d array stays 0-d
    if not available():
        return x.astype(fmt.dtype)
    out = np.empty(x.shape, np.uint8)
    _compiled()[0](x.reshape(-1), x.reshape(-1).view(np.uint32), out.reshape(-1),
                fmt.mantissa_bits, fmt.min_exponent, _sign_shift(fmt))
    out = out.view(fmt.dtype)
    not_finite = ~np.isfinite(x)
    if not_finite.any():  # ml_dtypes' own NaN and infinity codes
        out[not_finite] = x[not_finite].astype(fmt.dtype)
    return out


def decode(codes: np.ndarray) -> np.ndarray:
    """The float32 values of an ml_dtypes small-float array (exact: each is a float32 value), read
    from the table of every code's value (compiled: NumPy's indexing takes 10 ns an element)."""
    table = _table(codes.dtype)
    codes = np.ascontiguousarray(codes).reshape(np.shape(codes)).view(np.uint8)  # 0-d stays 0-d
    if not available():
        return table[codes]
    out = np.empty(codes.shape, FLOAT32)
    _compiled()[1](codes.reshape(-1), table, out.reshape(-1))
    return out


def to_float32(array: np.ndarray) -> np.ndarray:
    """Any array's values in float32: decoded when its dtype is a one-byte small float (values and
    E8M0 or E4M3 scales), else NumPy's conversion."""
    if array.dtype.itemsize == 1 and array.dtype.kind == "V":  # ml_dtypes' small floats
        return decode(array)
    return array.astype(FLOAT32)


@cache
def _table(dtype: np.dtype) -> np.ndarray:
    """Every code's float32 value, indexed by the code's byte."""
    return np.arange(256, dtype=np.uint8).view(dtype).astype(FLOAT32)


def _sign_shift(fmt: "ElementFormat") -> int:
    """The sign bit's place: above the fraction bits and the exponent field, whose codes run from
    1 (emin) to emax - emin + 1 (E4M3 4 bits: 7; E5M2 5: 7; E2M1 2: 3; E2M3 and E3M2: 5)."""
    return fmt.mantissa_bits + (fmt.emax - fmt.min_exponent + 1).bit_length()


@cache
def _compiled() -> tuple[Any, Any]:
    """The two loops, compiled once per process (numba caches their machine code on disk)."""
    import numba

    @numba.njit(cache=True)
    def encode_loop(values, pattern, out, m, emin, sign_shift):  # pragma: no cover (compiled)
        dropped = np.uint32(23 - m)
        half_less_one = np.uint32((1 << (22 - m)) - 1)
        one = np.uint32(1)
        smallest_normal = np.uint32((127 + emin) << 23)  # the bits of 2^emin
        bias_shift = np.uint32((127 + emin - 1) << m)
        subnormal_scale = np.float32(2.0 ** (m - emin))
        for i in range(values.size):
            p = pattern[i]
            magnitude = p & np.uint32(0x7FFFFFFF)
            if magnitude < smallest_normal:
                code = np.uint32(np.rint(abs(values[i]) * subnormal_scale))
            else:
                code = ((magnitude + half_less_one + ((magnitude >> dropped) & one)) >> dropped
                        ) - bias_shift
            out[i] = np.uint8(((p >> np.uint32(31)) << np.uint32(sign_shift)) | code)

    @numba.njit(cache=True)
    def decode_loop(codes, table, out):  # pragma: no cover (compiled)
        for i in range(codes.size):
            out[i] = table[codes[i]]

    return encode_loop, decode_loop
