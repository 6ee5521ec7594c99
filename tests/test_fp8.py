"""The fp8 cast bit for bit against a reference written from the formats' definition (float64, no
ml_dtypes), on every float16 and on scaled float32 values, ties and saturation included; ml_dtypes
agrees with the reference wherever nothing saturates."""

import ml_dtypes
import numpy as np
import pytest

from minimp.precision import codes, fp8
from minimp.precision.fp8 import E4M3, E5M2

# The formats as the OCP 8-bit floating point specification (v1.0) defines them, written here
# independently of ml_dtypes: exponent bits, exponent bias, fraction bits, and what the top
# exponent field holds (E4M3: normal numbers, but S.1111.111 is NaN, so the largest finite is
# 1.110 x 2^8 = 448; E5M2: infinities and NaN, as IEEE, so the largest is 1.11 x 2^15 = 57344).
DEFINITIONS = {
    "E4M3": dict(exponent_bits=4, bias=7, fraction_bits=3, ieee_top_exponent=False),
    "E5M2": dict(exponent_bits=5, bias=15, fraction_bits=2, ieee_top_exponent=True),
}
FORMATS = [E4M3, E5M2]


def decode_from_definition(code: int, name: str) -> float:
    """The value of an 8-bit code: (-1)^s 2^(e - bias) 1.f for normals, 2^(1 - bias) 0.f for
    e = 0; the top exponent field as the definition says."""
    d = DEFINITIONS[name]
    fraction_bits, exponent_bits = d["fraction_bits"], d["exponent_bits"]
    sign = -1.0 if code >> 7 else 1.0
    exponent = (code >> fraction_bits) & ((1 << exponent_bits) - 1)
    fraction = code & ((1 << fraction_bits) - 1)
    top = (1 << exponent_bits) - 1
    if d["ieee_top_exponent"] and exponent == top:
        return sign * np.inf if fraction == 0 else np.nan
    if not d["ieee_top_exponent"] and exponent == top and fraction == (1 << fraction_bits) - 1:
        return np.nan
    if exponent == 0:
        return sign * 2.0 ** (1 - d["bias"]) * fraction / 2**fraction_bits
    return sign * 2.0 ** (exponent - d["bias"]) * (1 + fraction / 2**fraction_bits)


def finite_values(name: str) -> np.ndarray:
    """Every finite value of the format, sorted (each zero once)."""
    values = {decode_from_definition(code, name) for code in range(256)}
    return np.array(sorted(v for v in values if np.isfinite(v)))


def largest(name: str) -> float:
    return float(finite_values(name).max())


def reference_quantize(array: np.ndarray, scale: float, name: str) -> np.ndarray:
    """float64 values of saturate(round(float32(x * s))) from the definition: the product exact in
    float64 then rounded once to float32, then rounded to nearest even at the format's spacing
    (2^(e - fraction bits) for a value in [2^e, 2^(e+1)), the smallest normal's spacing for the
    subnormals), and saturated at +-largest (infinities too); NaN stays NaN."""
    d = DEFINITIONS[name]
    with np.errstate(invalid="ignore", over="ignore"):  # NaN in, NaN out; float32 overflows: inf
        product = array.astype(np.float64) * np.float64(np.float32(scale))  # exact: 24 x 24 bits
        scaled = product.astype(np.float32).astype(np.float64)
    magnitude = np.abs(scaled)
    with np.errstate(invalid="ignore"):
        _, exponent = np.frexp(magnitude)  # magnitude = m 2^exponent with m in [0.5, 1)
        binade = np.maximum(exponent - 1, 1 - d["bias"])
        spacing = np.ldexp(1.0, binade - d["fraction_bits"])
        rounded = np.rint(magnitude / spacing) * spacing  # np.rint rounds half to even
        rounded = np.where(magnitude > largest(name), largest(name), rounded)
    return np.where(np.isnan(scaled), np.nan, np.copysign(rounded, scaled))


def assert_same_values(actual: np.ndarray, expected: np.ndarray, what: str) -> None:
    """Equal as numbers, zeros' signs included, NaN where NaN."""
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan), f"{what}: NaN in different places"
    actual, expected = actual[~nan], expected[~nan]
    wrong = np.flatnonzero((actual != expected) | (np.signbit(actual) != np.signbit(expected)))
    assert wrong.size == 0, f"{what}: {wrong.size} differ, first {actual[wrong[0]]} vs " + (
        f"{expected[wrong[0]]}"
    )


ALL_FLOAT16 = np.arange(65536, dtype=np.uint16).view(np.float16)
SCALES = [1.0, 2.0**-4, 2.0**10, 0.3, 1000.0, 3.0e-5]


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_every_code_decodes_as_the_definition_says(fmt):
    ours = fp8.to_float32(np.arange(256, dtype=np.uint8).view(fmt.dtype)).astype(np.float64)
    expected = np.array([decode_from_definition(code, fmt.name) for code in range(256)])
    assert_same_values(ours, expected, f"{fmt.name} decoding")


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_the_limits_read_from_ml_dtypes_are_the_definitions(fmt):
    values = finite_values(fmt.name)
    positive = values[values > 0]
    assert fmt.max == values.max() == {"E4M3": 448.0, "E5M2": 57344.0}[fmt.name]
    assert fmt.smallest_subnormal == positive.min()
    assert fmt.smallest_normal == 2.0 ** (1 - DEFINITIONS[fmt.name]["bias"])
    assert fmt.mantissa_bits == DEFINITIONS[fmt.name]["fraction_bits"]
    assert fmt.saturation_threshold == {"E4M3": 464.0, "E5M2": 61440.0}[fmt.name]


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_all_65536_float16_values_quantize_as_the_reference(fmt, scale):
    ours = fp8.to_float32(fp8.quantize(ALL_FLOAT16, scale, fmt)).astype(np.float64)
    expected = reference_quantize(ALL_FLOAT16, scale, fmt.name)
    assert_same_values(ours, expected, f"{fmt.name}, scale {scale}")
    saturated = np.abs(fp8.scale_values(ALL_FLOAT16, scale)) > fmt.max
    assert scale != 1.0 or saturated.any()  # scale 1 reaches beyond both maxima: 65504


def random_float32(rng: np.random.Generator, count: int) -> np.ndarray:
    """Random signs, random 23-bit fractions and exponents from 2^-40 to 2^40."""
    exponents = rng.integers(127 - 40, 127 + 40, count, dtype=np.uint32)
    bits = (rng.integers(0, 2, count, dtype=np.uint32) << 31) | (exponents << 23)
    return (bits | rng.integers(0, 2**23, count, dtype=np.uint32)).view(np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_scaled_float32_values_quantize_as_the_reference(fmt, rng):
    values = random_float32(rng, 200_000)
    for scale in 2.0 ** rng.uniform(-24, 24, 8):
        ours = fp8.to_float32(fp8.quantize(values, scale, fmt)).astype(np.float64)
        assert_same_values(ours, reference_quantize(values, scale, fmt.name), f"scale {scale}")


def ties_and_neighbours(name: str) -> np.ndarray:
    """Every finite value, every midpoint between neighbours (exact in float32), the float32
    numbers on either side of each, and values past the largest: where rounding goes wrong."""
    values = finite_values(name).astype(np.float32)
    positive = values[values >= 0]
    beyond = largest(name) * np.array([1.0 + 2.0**-6, 1.0 + 2.0**-4, 1.5, 2.0, 1e6], np.float32)
    middles = ((positive[:-1].astype(np.float64) + positive[1:]) / 2).astype(np.float32)
    top_spacing = 2.0 ** (np.floor(np.log2(largest(name))) - DEFINITIONS[name]["fraction_bits"])
    middles = np.concatenate([middles, [largest(name) + top_spacing / 2]])  # past max: a "tie"
    around = [np.nextafter(middles, np.float32(np.inf)), np.nextafter(middles, np.float32(0))]
    points = np.concatenate([positive, middles, *around, beyond, [np.inf]]).astype(np.float32)
    return np.concatenate([points, -points, [np.nan]]).astype(np.float32)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_ties_go_to_even_and_values_past_the_maximum_saturate(fmt):
    values = ties_and_neighbours(fmt.name)
    ours = fp8.to_float32(fp8.quantize(values, 1.0, fmt)).astype(np.float64)
    assert_same_values(ours, reference_quantize(values, 1.0, fmt.name), f"{fmt.name} ties")
    for beyond in (np.float32(1e6), np.float32(np.inf)):  # saturate, never NaN or inf
        assert fp8.to_float32(fp8.quantize(np.array([beyond, -beyond]), 1.0, fmt)).tolist() == [
            fmt.max,
            -fmt.max,
        ]
    # 0.5 * 2^-9 (E4M3) is a tie between 0 and the smallest subnormal: it goes to 0, the even one.
    half_tiny = np.array([fmt.smallest_subnormal / 2], np.float32)
    assert fp8.to_float32(fp8.quantize(half_tiny, 1.0, fmt))[0] == 0.0


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_ml_dtypes_agrees_with_the_reference_wherever_nothing_saturates(fmt, rng):
    parts = [ALL_FLOAT16.astype(np.float32), random_float32(rng, 100_000)]
    values = np.concatenate([*parts, ties_and_neighbours(fmt.name)])
    in_range = ~(np.abs(values) > fmt.max)  # NaN included: it stays NaN
    values = values[in_range]
    with np.errstate(invalid="ignore"):
        theirs = values.astype(fmt.dtype).astype(np.float64)
    assert_same_values(theirs, reference_quantize(values, 1.0, fmt.name), f"ml_dtypes {fmt.name}")
    # ... and where values saturate, ml_dtypes' own cast gives NaN (E4M3) or inf (E5M2): the
    # reason minimp clips before casting.
    overflowed = np.array([fmt.max * 2], np.float32).astype(fmt.dtype).astype(np.float32)[0]
    assert np.isnan(overflowed) if fmt is E4M3 else np.isinf(overflowed)


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_dequantize_multiplies_by_the_float32_inverse_of_the_scale(fmt, rng):
    values = rng.standard_normal(1000).astype(np.float32)
    scale = np.float32(37.5)
    q = fp8.quantize(values, scale, fmt)
    expected = (fp8.to_float32(q).astype(np.float64) * np.float64(np.float32(1) / scale)).astype(
        np.float32
    )  # exact in float64 (4 x 24 bits), rounded once: what a float32 multiply gives
    assert np.array_equal(fp8.dequantize(q, scale), expected)
    assert np.abs(fp8.dequantize(q, scale) - values).max() <= np.abs(values).max() * 2.0**-2


def test_the_decoding_table_is_ml_dtypes_own_decoding():
    for fmt in FORMATS:
        codes = np.arange(256, dtype=np.uint8).view(fmt.dtype)
        ours, theirs = fp8.to_float32(codes), codes.astype(np.float32)
        assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32))  # NaN bits too
        transposed = fp8.to_float32(codes.reshape(16, 16).T)  # a strided view decodes too
        assert np.array_equal(transposed.view(np.uint32), theirs.reshape(16, 16).T.view(np.uint32))
        assert ml_dtypes.finfo(fmt.dtype).bits == 8


@pytest.mark.parametrize("fmt", FORMATS, ids=repr)
def test_the_decoding_table_holds_each_codes_float32_value(fmt):
    # codes._table is built once per format and cached, which the tests above only read: a
    # mutation tool that swaps functions after import never reaches the builder unless a test
    # calls it uncached, as here
    table = codes._table.__wrapped__(np.dtype(fmt.dtype))
    assert table.dtype == np.float32 and table.shape == (256,)
    expected = np.array([decode_from_definition(code, fmt.name) for code in range(256)])
    assert_same_values(table.astype(np.float64), expected, f"{fmt} decoding table")
    cached = codes._table(np.dtype(fmt.dtype))
    assert np.array_equal(cached.view(np.uint32), table.view(np.uint32))
