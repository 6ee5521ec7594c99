"""Block-scaled casts: a 2-D tensor split into scaling groups, each group's scale, the cast to the
element format with the specs' edge rules, and back to float32.

One scale per tensor (precision/fp8.py) serves while no value strays far from the rest. A group is
a rows x cols tile of the 2-D array with a scale of its own, so a large value costs only its own
group's precision. The group shapes in use:

    tensor          one group: today's per-tensor fp8
    rowwise (1 x K) one scale per row
    1 x 128         DeepSeek-V3 (report section 3.3): activations, per token per 128 channels
    128 x 1         DeepSeek-V3: the activations the weight-gradient GEMM reads, along tokens
    128 x 128       DeepSeek-V3: weights
    1 x 32          OCP Microscaling (MX) v1.0: MXFP8, MXFP6 and MXFP4 blocks
    1 x 16, 16 x 16 NVFP4: activations and gradients; weights

A shape its group does not tile is refused (ValueError, one line), never padded: a padded group's
scale would be chosen from values that do not exist, and the GEMM shapes here are multiples.

What a rule stores is the scale that decoding multiplies by (Transformer Engine's `scale_inv`):
x ~ value * scale_inv (* tensor_scale_inv for NVFP4). The four rules:

    current      scale s = max / amax in float32 for each group (fp8_scaling's current scaling, per
                 group); scale_inv = 1/s in float32
    mx_floor     OCP MX v1.0 section 6.3: X = 2^(floor(log2 amax) - emax), an E8M0 code
    mx_round_up  NVIDIA's variant, X = 2^ceil(log2(amax / max)), an E8M0 code
    nvfp4        a float32 scale for the tensor times an E4M3 scale per group (NVFP4)

MX's floor rule maps amax into [2^emax, 2^(emax+1)), and the format's max lies inside that binade
(448 = 1.75 * 2^8 in E4M3, 6 = 1.5 * 2^2 in E2M1): an amax whose mantissa is above max's (1.75 for
E4M3) lands past max and saturates. Rounding up never does, at the cost of up to one binade of
range for the rest of the group.

Edge rules, the same in every rule: past +-max a value saturates to +-max (MX v1.0's "clamped to
the max normal"; ml_dtypes would give NaN or inf). A group holding a NaN or an infinity decodes as
NaN: its scale is NaN (E8M0 0xFF, E4M3 0x7F, float32 NaN) and its values are stored as 0. A whole
block NaN is what the MX reference implementation (microsoft/microxcaling) gives; the other rules
do the same, so that E2M1, which has no NaN code, loses no NaN (fp8_scaling's current scaling
instead keeps s = 1 there and saturates an infinity). An all-zero group decodes as 0 whatever its
scale: E8M0's smallest, 2^-127, for the mx rules, s = 1 for current scaling (Transformer Engine's
choice), an E4M3 scale of 0 for nvfp4.
"""

from dataclasses import dataclass
from typing import TypeVar

import ml_dtypes
import numpy as np

from minimp.precision import codes
from minimp.precision.stochastic import RANDOM_BITS, checked_random_bits

FLOAT32 = np.dtype(np.float32)
FLOAT32_MAX = np.float32(np.finfo(np.float32).max)

GroupShape = tuple[int | None, int | None]
T = TypeVar("T")


Format = TypeVar("Format", bound="ElementFormat")  # of() builds the class it is called on


@dataclass(frozen=True)
class ElementFormat:
    """A format the values of a group take, its limits read from `ml_dtypes.finfo`.

    max: the largest finite value (E4M3 448, E5M2 57344, E2M1 6, E2M3 7.5, E3M2 28); emax: its
    exponent, the largest normal's (8, 15, 2, 2, 4), which MX's shared exponent subtracts;
    mantissa_bits: the fraction bits (3, 2, 1, 3, 2); min_exponent: the smallest normal's exponent
    (-6, -14, 0, 0, -2), below which the spacing stays 2^(min_exponent - mantissa_bits); has_nan:
    whether a code means NaN (E4M3 and E5M2; E2M1 and the fp6s have none).
    """

    name: str
    dtype: np.dtype
    max: float
    emax: int
    mantissa_bits: int
    min_exponent: int
    has_nan: bool

    @classmethod
    def of(cls: type[Format], name: str, dtype: type) -> Format:
        """The format of an ml_dtypes type; has_nan is whether ml_dtypes casts NaN to a NaN."""
        info = ml_dtypes.finfo(dtype)
        nan = np.array(np.nan, FLOAT32).astype(dtype).astype(FLOAT32)
        return cls(name, np.dtype(dtype), float(info.max), int(info.maxexp) - 1, int(info.nmant),
                   int(info.minexp), bool(np.isnan(nan)))

    def __repr__(self) -> str:
        return self.name


E4M3 = ElementFormat.of("E4M3", ml_dtypes.float8_e4m3fn)
E5M2 = ElementFormat.of("E5M2", ml_dtypes.float8_e5m2)
E2M1 = ElementFormat.of("E2M1", ml_dtypes.float4_e2m1fn)
E2M3 = ElementFormat.of("E2M3", ml_dtypes.float6_e2m3fn)
E3M2 = ElementFormat.of("E3M2", ml_dtypes.float6_e3m2fn)
ELEMENT_FORMATS = {f.name: f for f in (E4M3, E5M2, E2M1, E2M3, E3M2)}

# E8M0 (MX v1.0 section 5.4.1): a float32 exponent alone, bias 127, exponents -127..127 in codes
# 0..254, 0xFF NaN, no zero and no infinity.
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
E8M0_MIN_EXPONENT = int(ml_dtypes.finfo(E8M0).minexp)  # -127
E8M0_MAX_EXPONENT = int(ml_dtypes.finfo(E8M0).maxexp) - 1  # 127
E8M0_BIAS = -E8M0_MIN_EXPONENT

GROUP_SHAPES: dict[str, GroupShape] = {
    "tensor": (None, None), "rowwise": (1, None), "1x128": (1, 128), "128x1": (128, 1),
    "128x128": (128, 128), "1x32": (1, 32), "1x16": (1, 16), "16x16": (16, 16),
}
RULES = ("current", "mx_floor", "mx_round_up", "nvfp4")


@dataclass(frozen=True, eq=False)
class BlockQuantized:
    """A 2-D array in an element format with a scale per group.

    data: the values in fmt's dtype, the input's shape (R, C); scale_inv: one per group, shape
    (R / rows, C / cols), in E8M0 (mx rules), E4M3 (nvfp4) or float32 (current); tensor_scale_inv:
    NVFP4's float32 scale for the whole tensor, 1 for the other rules; group_shape: (rows, cols).
    """

    data: np.ndarray
    scale_inv: np.ndarray
    tensor_scale_inv: np.float32
    group_shape: tuple[int, int]
    fmt: ElementFormat
    rule: str


def resolve_group_shape(shape: tuple[int, ...], group_shape: GroupShape | str) -> tuple[int, int]:
    """(rows, cols) of a group, a name from GROUP_SHAPES or None read as the whole dimension; a
    ValueError in one line for an array that is not 2-D and non-empty, or that the group does not
    tile."""
    if isinstance(group_shape, str):
        group_shape = _named(GROUP_SHAPES, group_shape, "group shape")
    if len(shape) != 2 or 0 in shape:
        raise ValueError(f"minimp.precision.blocks: scaling groups tile a non-empty 2-D array, "
                         f"got shape {tuple(shape)}")
    rows, cols = (size if g is None else g for size, g in zip(shape, group_shape))
    for dimension, size, extent in (("rows", shape[0], rows), ("columns", shape[1], cols)):
        if extent < 1 or size % extent:
            raise ValueError(f"minimp.precision.blocks: {rows}x{cols} groups need the {dimension}"
                             f" ({size}) to be a multiple of {extent}; pad the {shape[0]}x"
                             f"{shape[1]} tensor or choose a group shape that divides it")
    return rows, cols


def grouped(x: np.ndarray, group_shape: tuple[int, int]) -> np.ndarray:
    """x (R, C) viewed as (R / rows, rows, C / cols, cols): group (i, j) is [i, :, j, :]."""
    rows, cols = group_shape
    return x.reshape(x.shape[0] // rows, rows, x.shape[1] // cols, cols)


def per_group(scales: np.ndarray) -> np.ndarray:
    """A (R / rows, C / cols) array of scales broadcast against grouped()'s view."""
    return scales[:, None, :, None]


def cast_to_element(scaled: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """float32 values rounded to nearest (ties to even) in fmt, saturating at +-max; NaN stays NaN
    where fmt has a NaN code (E2M1 and the fp6s have none: ml_dtypes makes it -0).

    The clip first: ml_dtypes' cast gives NaN (E4M3) or inf (E5M2) past max; within +-max the
    result is ml_dtypes' own cast, bit for bit."""
    with np.errstate(invalid="ignore"):  # NaN is clipped as NaN, as it should be
        return codes.encode(np.clip(scaled, -fmt.max, fmt.max), fmt)


def cast_to_element_stochastic(scaled: np.ndarray, fmt: ElementFormat,
                               random_bits: np.ndarray) -> np.ndarray:
    """float32 values rounded stochastically in fmt, saturating at +-max: |x| (clipped to max)
    lies between two neighbours of fmt, lo <= |x| < lo + ulp; with m the first 16 bits of its
    position, m = floor(2^16 (|x| - lo) / ulp), it rounds to lo + ulp when the random value r
    (uint32 below 2^16, stochastic.draw_random_bits) is below m: for m of the 2^16 values of r.
    Averaged over all of them the result is lo + ulp m / 2^16, which is |x| exactly when its
    position (|x| - lo) / ulp is a multiple of 2^-16 (fmt's own values among them), and below it
    by less than ulp / 2^16 otherwise (the bits past the 16th are truncated, as stochastic.py's
    bfloat16 rounding truncates). Past +-max the value is max and never rounds up; NaN stays NaN
    where fmt has a NaN code (as cast_to_element).

    Every step is exact in float32: ulp is a power of two, |x| / ulp an integer plus a fraction
    of at most 24 significant bits, and the result a fmt value."""
    random_bits = checked_random_bits(random_bits)
    with np.errstate(invalid="ignore"):  # NaN is clipped as NaN
        clipped = np.clip(np.asarray(scaled, FLOAT32), -fmt.max, fmt.max)
    magnitude = np.abs(clipped)
    exponent = np.maximum(floor_log2(magnitude), fmt.min_exponent)  # subnormals: fixed spacing
    ulp = np.ldexp(np.float32(1.0), exponent - fmt.mantissa_bits).astype(FLOAT32)
    units = magnitude / ulp  # exact: a power of two
    lower = np.floor(units)
    position = np.floor((units - lower) * np.float32(1 << RANDOM_BITS))  # m, 0 .. 2^16 - 1
    rounded = (lower + (random_bits < position)) * ulp
    with np.errstate(invalid="ignore"):
        return codes.encode(np.where(np.isnan(clipped), clipped, np.copysign(rounded, clipped)),
                            fmt)


def floor_log2(amax: np.ndarray) -> np.ndarray:
    """floor(log2 a) for positive finite float32 a, exact, from a's bits: np.frexp gives
    a = m * 2^e with m in [0.5, 1), subnormals included, so floor(log2 a) = e - 1."""
    return np.frexp(amax)[1] - 1


def mx_floor_exponent(amax: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """OCP MX v1.0 section 6.3: floor(log2 amax) - emax, clamped to E8M0's exponents. Not by a cast
    to float8_e8m0fnu: that rounds to nearest (1.875 * 2^k would become 2^(k+1)). amax 0, for
    which log2 is -inf and section 6.3 names no power of two, gets the smallest, 2^-127, as the MX
    reference implementation (microsoft/microxcaling) gives; its values are 0 whatever X is."""
    exponent = np.where(amax > 0, floor_log2(amax) - fmt.emax, E8M0_MIN_EXPONENT)
    return np.clip(exponent, E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)


def mx_round_up_exponent(amax: np.ndarray, fmt: ElementFormat) -> np.ndarray:
    """ceil(log2(amax / max)), clamped to E8M0's exponents: the quotient rounded once in float32,
    then its ceiling from its bits (m * 2^e with m in [0.5, 1): e - 1 when m is 0.5, else e). A
    quotient that rounds down onto 2^k leaves amax / 2^k above max by a float32 rounding, which
    the cast rounds to max anyway."""
    with np.errstate(under="ignore"):  # a tiny amax's quotient may be a float32 subnormal or 0
        quotient = amax / np.float32(fmt.max)
    mantissa, exponent = np.frexp(quotient)
    exponent = np.where(quotient > 0, exponent - (mantissa == 0.5), E8M0_MIN_EXPONENT)
    return np.clip(exponent, E8M0_MIN_EXPONENT, E8M0_MAX_EXPONENT)


def _power_of_two_scaled(xg: np.ndarray, exponent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(x / 2^X exactly, X as E8M0 codes). ldexp only rounds a result below float32's normals, far
    under half the smallest subnormal of every element format, so the cast makes it 0 anyway."""
    codes = (exponent + E8M0_BIAS).astype(np.uint8).view(E8M0)
    return np.ldexp(xg, -per_group(exponent)), codes


def _current(xg: np.ndarray, amax: np.ndarray, fmt: ElementFormat):
    """s = max / amax in float32 per group, 1 for amax 0, float32's max when the quotient overflows
    (Transformer Engine's compute_scale_from_amax); x * s rounded once; scale_inv = 1 / s."""
    with np.errstate(divide="ignore", over="ignore"):
        scale = np.where(amax > 0, np.float32(fmt.max) / amax, np.float32(1.0))
    scale = np.minimum(scale, FLOAT32_MAX)
    return xg * per_group(scale), np.float32(1.0) / scale, np.float32(1.0)


def _mx_floor(xg: np.ndarray, amax: np.ndarray, fmt: ElementFormat):
    """x / X with X = 2^(floor(log2 amax) - emax) (OCP MX v1.0 section 6.3); no tensor scale."""
    return (*_power_of_two_scaled(xg, mx_floor_exponent(amax, fmt)), np.float32(1.0))


def _mx_round_up(xg: np.ndarray, amax: np.ndarray, fmt: ElementFormat):
    """x / X with X = 2^ceil(log2(amax / max)) (NVIDIA's variant); no tensor scale."""
    return (*_power_of_two_scaled(xg, mx_round_up_exponent(amax, fmt)), np.float32(1.0))


def _nvfp4(xg: np.ndarray, amax: np.ndarray, fmt: ElementFormat):
    """NVFP4 ("Pretraining Large Language Models with NVFP4", appendix B), in the float32 order of
    Transformer Engine's kernels (core_nvfp4.cuh), with fmt's max in place of E2M1's 6:
      s_enc = 448 * 6 / amax of the tensor (1 when amax is 0; float32's max if it overflows),
      s_dec = 1 / s_enc, the tensor_scale_inv;
      each group's scale_inv: amax_b * (s_enc * (1/6)) cast to E4M3, nearest even, saturating;
      the values: x * min(1 / (scale_inv * s_dec), float32 max), then cast to fmt.
    A group whose E4M3 scale rounds to 0 decodes as 0 (its values saturate; times 0). A tensor
    whose amax is below about 2^-114 (448 * 6 times float32's smallest normal) has a subnormal
    s_dec, short of significant bits: NVFP4 loses precision there."""
    tensor_amax = amax.max()
    with np.errstate(over="ignore"):
        s_enc = np.float32(E4M3.max * fmt.max) / tensor_amax if tensor_amax > 0 else np.float32(1)
    s_enc = min(s_enc, FLOAT32_MAX)
    s_dec = np.float32(1.0) / s_enc
    block_scale = cast_to_element(amax * (s_enc * (np.float32(1.0) / np.float32(fmt.max))), E4M3)
    with np.errstate(divide="ignore", over="ignore"):
        encode = np.minimum(np.float32(1.0) / (codes.to_float32(block_scale) * s_dec), FLOAT32_MAX)
        return xg * per_group(encode), block_scale, s_dec


_RULE_FUNCTIONS = {"current": _current, "mx_floor": _mx_floor, "mx_round_up": _mx_round_up,
                   "nvfp4": _nvfp4}


def _named(table: dict[str, T], name: str, what: str) -> T:
    """table[name], or a ValueError in one line naming the choices."""
    if name not in table:
        raise ValueError(f"minimp.precision.blocks: unknown {what} {name!r}; "
                         f"choose one of {', '.join(table)}")
    return table[name]


def _nan_where(scale_inv: np.ndarray, groups: np.ndarray) -> np.ndarray:
    """scale_inv with NaN, in its own dtype (E8M0 0xFF, E4M3 0x7F, float32), in the groups."""
    return np.where(groups, np.array(np.nan, FLOAT32).astype(scale_inv.dtype), scale_inv)


def quantize(x: np.ndarray, fmt: ElementFormat | str, group_shape: GroupShape | str,
             rule: str, random_bits: np.ndarray | None = None) -> BlockQuantized:
    """x (R, C), rounded to float32 first, as fmt values with a scale per group chosen by rule
    (one of RULES); see the module's docstring for the rules and the edge cases. The scaled
    values round to nearest, or stochastically with random_bits (uint32 below 2^16, shape (R, C)
    or broadcast to it: cast_to_element_stochastic); the scales always round to nearest."""
    fmt = _named(ELEMENT_FORMATS, fmt, "element format") if isinstance(fmt, str) else fmt
    scale_rule = _named(_RULE_FUNCTIONS, rule, "scale rule")
    x = np.asarray(x).astype(FLOAT32, copy=False)
    group = resolve_group_shape(x.shape, group_shape)
    with np.errstate(invalid="ignore"):
        amax = np.abs(grouped(x, group)).max(axis=(1, 3))  # (R / rows, C / cols); NaN propagates
    non_finite = ~np.isfinite(amax)  # a NaN or an inf in the group: the whole group is NaN
    finite = np.where(per_group(non_finite), np.float32(0.0), grouped(x, group))
    scaled, scale_inv, tensor_scale_inv = scale_rule(finite, np.where(non_finite, 0, amax), fmt)
    scaled = scaled.reshape(x.shape)
    data = (cast_to_element(scaled, fmt) if random_bits is None
            else cast_to_element_stochastic(scaled, fmt, random_bits))
    return BlockQuantized(data, _nan_where(scale_inv, non_finite), np.float32(tensor_scale_inv),
                          group, fmt, rule)


def dequantize(q: BlockQuantized) -> np.ndarray:
    """value * scale_inv (* tensor_scale_inv) in float32, shape (R, C). The mx rules decode exactly
    (a short significand times a power of two); nvfp4's value * scale_inv is exact too (E2M1 times
    E4M3: 6 significant bits at most), then rounded once by the tensor scale; current scaling's
    product is rounded once. One exception: under mx_round_up a group whose amax is in float32's
    top binade [2^127, 2^128) may hold a value that rounded up to 2^128, which float32 lacks: inf
    (1.875 * 2^127 in E5M2 is 2^15 * 2^113, a tie rounded to even)."""
    values = grouped(codes.to_float32(q.data), q.group_shape)  # exact: all are float32 values
    with np.errstate(over="ignore"):
        decoded = values * per_group(codes.to_float32(q.scale_inv))
    if q.rule == "nvfp4":
        decoded = decoded * q.tensor_scale_inv
    return decoded.reshape(q.data.shape)


def quantization_error(x: np.ndarray, fmt: ElementFormat | str, group_shape: GroupShape | str,
                       rule: str) -> float:
    """||dequantize(quantize(x)) - x||_F / ||x||_F, computed in float64 on the float32 input."""
    reference = np.asarray(x).astype(FLOAT32).astype(np.float64)
    error = dequantize(quantize(x, fmt, group_shape, rule)) - reference
    return float(np.linalg.norm(error) / np.linalg.norm(reference))
