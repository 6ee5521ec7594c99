"""The two fp8 formats and the one fp8 cast: scale, saturate, round to nearest even; and back.

    E4M3: 1 sign | 4 exponent bits, bias 7  | 3 fraction bits   max 448,   normals from 2^-6
    E5M2: 1 sign | 5 exponent bits, bias 15 | 2 fraction bits   max 57344, normals from 2^-14

E4M3 keeps one more bit of precision; E5M2 spans a wider range, up to 57344 and down to 2^-16 (its
smallest subnormal; E4M3's is 2^-9). Transformer Engine's HYBRID format uses each where it serves:
E4M3 for what the forward multiplies (activations and weights), E5M2 for the output gradients of
backward, whose magnitudes spread wider. E5M2 has infinities, as float16 does; E4M3
(`float8_e4m3fn`, "finite, NaN") gives only its top code to NaN and has no infinity, which is how
it reaches 448 rather than 240.

Eight bits cover too little range to hold a tensor as it is (activations near 1, weights near
0.02, gradients near 1e-6), so each tensor gets a scale s: fp8 stores q = round(x * s) and the
value it stands for is q / s. Choosing s so that the tensor's largest magnitude lands near the
format's maximum is the job of a scaling recipe (precision/fp8_scaling.py).

The formats come from ml_dtypes (their limits from `ml_dtypes.finfo`, the rounding from its cast,
which precision/codes.py computes bit for bit, compiled), not from a hand-written table. One thing
differs from ml_dtypes' cast: a scaled value beyond the format's maximum saturates to +-max, as
Transformer Engine's casts do (CUDA's __NV_SATFINITE), where ml_dtypes gives NaN (E4M3) or inf
(E5M2). One too-large value then costs its own precision, not the whole tensor. NaN stays NaN.
The cast runs on NumPy arrays: the emulation is for the CPU.
"""

import ml_dtypes
import numpy as np

from minimp.precision import codes
from minimp.precision.blocks import ElementFormat
from minimp.precision.casting import FLOAT32, widen


class Fp8Format(ElementFormat):
    """One fp8 format: blocks.py's element format (name, ml_dtypes' dtype, max, emax,
    mantissa_bits, min_exponent, read from ml_dtypes.finfo), with the limits the fp8 cast uses.

    max: the largest finite value, 448 (E4M3) or 57344 (E5M2); smallest_normal: 2^-6 (E4M3) or
    2^-14 (E5M2); smallest_subnormal: 2^-9 (E4M3) or 2^-16 (E5M2), below half of which a value
    rounds to zero; mantissa_bits: the fraction bits stored, 3 (E4M3) or 2 (E5M2); has_nan: True
    for both (E4M3's one NaN code, E5M2's NaNs beside its infinities).
    """

    @property
    def smallest_normal(self) -> float:
        """2^min_exponent: 2^-6 (E4M3), 2^-14 (E5M2)."""
        return 2.0**self.min_exponent

    @property
    def smallest_subnormal(self) -> float:
        """2^(min_exponent - mantissa_bits), the spacing below the normals: 2^-9 (E4M3), 2^-16
        (E5M2)."""
        return 2.0 ** (self.min_exponent - self.mantissa_bits)

    @property
    def saturation_threshold(self) -> float:
        """max plus half the spacing there: 464 (E4M3), 61440 (E5M2). Beyond it, rounding to
        nearest could not bring a value back to max; only the saturating cast's clip does."""
        return self.max + 2.0 ** (self.emax - self.mantissa_bits) / 2  # 448 = 1.75 * 2^8


E4M3 = Fp8Format.of("E4M3", ml_dtypes.float8_e4m3fn)
E5M2 = Fp8Format.of("E5M2", ml_dtypes.float8_e5m2)
FORMATS = {"E4M3": E4M3, "E5M2": E5M2}


def amax(array: np.ndarray) -> float:
    """max |x| of the array, in float32 (NaN when it holds a NaN, as Transformer Engine's)."""
    if array.size == 0:
        return 0.0
    return float(np.abs(widen(array)).max())


def scale_values(array: np.ndarray, scale: float) -> np.ndarray:
    """x * s in float32, rounded once: the values the cast then rounds to fp8. Quietly: a NaN stays
    NaN and a product past float32's range is inf, which the cast saturates."""
    with np.errstate(invalid="ignore", over="ignore"):
        return np.multiply(widen(array), np.float32(scale), dtype=FLOAT32)


def cast_saturating(scaled: np.ndarray, fmt: Fp8Format) -> np.ndarray:
    """float32 values rounded to nearest (ties to even) in fmt, saturating at +-max; NaN stays NaN.

    The clip first: ml_dtypes' own cast would turn values beyond max into NaN or inf; then
    codes.encode, ml_dtypes' cast bit for bit, compiled."""
    with np.errstate(invalid="ignore"):  # NaN is cast as NaN, as it should be
        return codes.encode(np.clip(scaled, -fmt.max, fmt.max), fmt)


def quantize(array: np.ndarray, scale: float, fmt: Fp8Format) -> np.ndarray:
    """The fp8 array q = saturate(round(x * s)) in fmt, one byte per value."""
    return cast_saturating(scale_values(array, scale), fmt)


def to_float32(fp8_array: np.ndarray) -> np.ndarray:
    """The fp8 values as float32 (exact: every fp8 value is a float32 value), scale not applied."""
    return codes.decode(fp8_array)


def inverse(scale: float) -> np.float32:
    """1 / s in float32, what the dequantization multiplies by (Transformer Engine's scale_inv)."""
    return np.float32(1.0) / np.float32(scale)


def dequantize(fp8_array: np.ndarray, scale: float) -> np.ndarray:
    """q / s in float32: the value each fp8 number stands for (multiplied by 1/s, rounded once)."""
    return to_float32(fp8_array) * inverse(scale)


def is_zero(fp8_array: np.ndarray) -> np.ndarray:
    """True where the code is +0 or -0 (every bit but the sign bit clear, in both formats)."""
    return (fp8_array.view(np.uint8) & 0x7F) == 0
