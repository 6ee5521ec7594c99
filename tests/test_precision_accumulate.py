"""The limited-precision accumulator and the blockwise GEMM of DeepSeek-V3's technical report,
section 3.3 ("Increasing Accumulation Precision", "Fine-Grained Quantization"): the rounding to
n significant bits against a float64 definition, the accumulator against its recurrence run step
by step, and both GEMMs against float64 within the error bounds derived in accumulate.py."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp.precision.accumulate import blockwise_matmul, limited_accumulation
from minimp.precision import accumulate_numba
from minimp.precision.accumulate import _limited_numpy, round_to_significant_bits

FLOAT32_MAX = float(np.finfo(np.float32).max)
UNIT_FP32 = 2.0**-24  # float32's unit roundoff: a rounding to nearest moves a value by <= this


def reference_round(x: np.ndarray, bits: int) -> np.ndarray:
    """float64 values of x rounded to `bits` significant bits, from the definition: the spacing
    in [2^e, 2^(e+1)) is 2^(e - bits + 1), float32's subnormals take the smallest normals' (e =
    -126), np.rint rounds half to even, past float32's max is inf; the sign kept, NaN is NaN."""
    with np.errstate(invalid="ignore"):  # NaNs (signalling ones too) pass through quietly
        magnitude = np.abs(x.astype(np.float64))
        _, exponent = np.frexp(magnitude)  # magnitude = m 2^exponent, m in [0.5, 1)
        spacing = np.ldexp(1.0, np.maximum(exponent - 1, -126) - bits + 1)
        rounded = np.rint(magnitude / spacing) * spacing
        rounded = np.where(rounded > FLOAT32_MAX, np.inf, rounded)
        return np.where(np.isnan(x), np.nan, np.copysign(rounded, x))


def assert_same_values(actual: np.ndarray, expected: np.ndarray) -> None:
    """Equal as numbers, zeros' signs included, NaN where NaN."""
    nan = np.isnan(expected)
    assert np.array_equal(np.isnan(actual), nan)
    actual, expected = actual[~nan], expected[~nan]
    wrong = np.flatnonzero((actual != expected) | (np.signbit(actual) != np.signbit(expected)))
    assert wrong.size == 0, (
        f"{wrong.size} differ, first {actual[wrong[0]]!r} vs {expected[wrong[0]]!r}")


def rounding_cases(bits: int, rng: np.random.Generator) -> np.ndarray:
    """Every sign and exponent (zeros, subnormals, infinities and NaNs included) with an even and
    an odd last kept bit, the dropped bits at 0, 1, a tie less one, a tie, a tie plus one and all
    ones, and random bits above; then 100,000 random bit patterns."""
    dropped = 24 - bits
    tie = 1 << max(dropped - 1, 0)
    low = np.array([0, 1, tie - 1, tie, tie + 1, (1 << dropped) - 1], np.int64) % (1 << dropped)
    sign_exponent = np.arange(512, dtype=np.uint32) << np.uint32(23)
    last_kept = np.array([0, 1 << dropped], np.uint32)
    above_last_kept = np.uint32(0xFFFFFFFF ^ ((2 << dropped) - 1))
    above = rng.integers(0, 1 << 23, 4, dtype=np.uint32) & above_last_kept
    patterns = (sign_exponent[:, None, None, None] | last_kept[None, :, None, None]
                | above[None, None, :, None] | low.astype(np.uint32)[None, None, None, :])
    random = rng.integers(0, 2**32, 100_000, dtype=np.uint32)
    return np.concatenate([patterns.ravel(), random]).view(np.float32)


@pytest.mark.parametrize("bits", [2, 3, 7, 8, 11, 14, 23, 24])
def test_rounding_to_significant_bits_is_the_float64_definition(bits, rng):
    x = rounding_cases(bits, rng)
    assert_same_values(round_to_significant_bits(x, bits), reference_round(x, bits))


@given(st.floats(width=32), st.integers(2, 24))
def test_rounding_of_any_float32_is_the_float64_definition(value, bits):
    x = np.array([value], np.float32)  # hypothesis' floats include subnormals, inf and NaN
    assert_same_values(round_to_significant_bits(x, bits), reference_round(x, bits))


def fp8_values(rng: np.random.Generator, shape: tuple, low: float | None = None) -> np.ndarray:
    """float32 arrays holding E4M3 values: normal draws (or uniform in [low, 4*low]) cast."""
    draws = rng.normal(size=shape) if low is None else rng.uniform(low, 4 * low, shape)
    return draws.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def recurrence(a: np.ndarray, b: np.ndarray, interval: int, bits: int) -> np.ndarray:
    """The accumulator of section 3.3 run product by product: s <- round_bits(fl32(s + fl32(a_k
    b_k))) with the float64 definition of the rounding, restarting every interval; intervals
    summed in float32 one after the other."""
    total = np.zeros((a.shape[0], b.shape[1]), np.float32)
    for start in range(0, a.shape[1], interval):
        s = np.zeros_like(total)
        for k in range(start, start + interval):
            s = reference_round(s + a[:, k, None] * b[None, k, :], bits).astype(np.float32)
        total = total + s
    return total


@pytest.mark.parametrize("interval, bits", [(128, 14), (256, 14), (64, 8), (32, 20)])
def test_the_accumulator_is_its_recurrence_to_the_bit(interval, bits, rng):
    a = rng.normal(size=(3, 256)).astype(np.float32)
    b = rng.normal(size=(256, 5)).astype(np.float32)
    expected = recurrence(a, b, interval, bits)
    assert_same_values(limited_accumulation(a, b, interval, bits), expected)


@pytest.mark.skipif(not accumulate_numba.available(), reason="numba not installed (minimp[fast])")
def test_the_compiled_accumulator_is_the_numpy_loop_to_the_bit(rng):
    """Values spread over 80 binades, a NaN, infinities of both signs and sums that round past
    float32's max: the compiled loop's bit patterns are the NumPy loop's, for two widths."""
    a = (rng.normal(size=(6, 64)) * 2.0 ** rng.integers(-40, 40, size=(6, 64))).astype(np.float32)
    b = rng.normal(size=(64, 37)).astype(np.float32)
    a[0, 3], a[1, 5], a[2, 7], a[3, :] = np.nan, np.inf, -np.inf, FLOAT32_MAX / 2
    for bits in (14, 3):
        compiled = accumulate_numba.interval_sum(a, b, bits)
        with np.errstate(over="ignore", invalid="ignore"):  # the overflows are the point
            numpy_loop = _limited_numpy(a, b, bits)
        assert np.array_equal(compiled.view(np.uint32), numpy_loop.view(np.uint32))
    assert np.isinf(compiled[3]).any() and np.isnan(compiled[0]).all()


def bound(a: np.ndarray, b: np.ndarray, fp32_roundings: int, bits: int, bit_roundings: int
          ) -> np.ndarray:
    """accumulate.py's bound: ((1 + 2^-24)^r32 (1 + 2^-bits)^rb - 1) sum_k |a_ik b_kj|."""
    growth = (1 + UNIT_FP32) ** fp32_roundings * (1 + 2.0**-bits) ** bit_roundings - 1
    return growth * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))


def exact(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a.astype(np.float64) @ b.astype(np.float64)


def test_limited_accumulation_errs_within_its_bound_and_far_beyond_fp32(rng):
    a, b = fp8_values(rng, (32, 512)), fp8_values(rng, (512, 48))
    limited_error = np.abs(limited_accumulation(a, b) - exact(a, b))
    assert (limited_error <= bound(a, b, 128 + 512 // 128, 14, 128)).all()
    fp32_error = np.abs(a @ b - exact(a, b))
    assert limited_error.max() > 50 * fp32_error.max()  # the emulation does something


def test_promoting_every_128_products_keeps_what_a_whole_k_accumulation_loses(rng):
    """Section 3.3: K = 4096 all-positive products; summed whole in 14 bits, the sum swamps the
    products that arrive late; promoted to fp32 every 128, it loses far less."""
    a, b = fp8_values(rng, (4, 4096), low=0.5), fp8_values(rng, (4096, 4), low=0.5)
    promoted = np.abs(limited_accumulation(a, b, interval=128) - exact(a, b)).max()
    whole = np.abs(limited_accumulation(a, b, interval=4096) - exact(a, b)).max()
    assert whole > 20 * promoted
    assert whole <= bound(a, b, 4097, 14, 4096).min()


def block_scales(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """Positive float32 scales over 2^-8 .. 2^8, as amaxes of different tiles would give."""
    return (2.0 ** rng.uniform(-8, 8, shape)).astype(np.float32)


def dequantized(values: np.ndarray, scales: np.ndarray, rows: int, columns: int) -> np.ndarray:
    """values * (each element's tile or block scale), in float64 (exact: 24 x 24 bits)."""
    expanded = np.repeat(np.repeat(scales, rows, axis=0), columns, axis=1)
    return values.astype(np.float64) * expanded[: values.shape[0], : values.shape[1]]


@pytest.mark.parametrize("accumulate", ["fp32", "limited"])
def test_blockwise_matmul_is_the_product_of_the_dequantized_matrices(accumulate, rng):
    """Section 3.3's fine-grained GEMM: a in 1 x 128 tiles, b in 128 x 128 blocks (N = 200: a
    last block of 72 columns). Reference: the float64 product of the dequantized matrices."""
    m, k, n, block = 16, 384, 200, 128
    a, b = fp8_values(rng, (m, k)), fp8_values(rng, (k, n))
    a_scales, b_scales = block_scales(rng, (m, 3)), block_scales(rng, (3, 2))
    a_real, b_real = dequantized(a, a_scales, 1, block), dequantized(b, b_scales, block, block)
    error = np.abs(blockwise_matmul(a, a_scales, b, b_scales, block, accumulate)
                   - a_real @ b_real)
    bits, bit_roundings = (14, block) if accumulate == "limited" else (24, 0)
    # a product, block - 1 sums (limited: block sums), sa sb, P * scale, then Q - 1 = 2 sums
    fp32_roundings = 1 + (block - 1 + (accumulate == "limited")) + 1 + 1 + 2
    assert (error <= bound(a_real, b_real, fp32_roundings, bits, bit_roundings)).all()
    if accumulate == "limited":
        fp32 = blockwise_matmul(a, a_scales, b, b_scales, block, "fp32")
        assert error.max() > 50 * np.abs(fp32 - a_real @ b_real).max()


def test_refusals_say_what_is_wrong(rng):
    a, b = np.ones((2, 256), np.float32), np.ones((256, 128), np.float32)
    with pytest.raises(ValueError, match="not a multiple of the interval 100"):
        limited_accumulation(a, b, interval=100)
    with pytest.raises(ValueError, match=r"needs scales \(2, 2\)"):
        blockwise_matmul(a, np.ones((2, 1)), b, np.ones((2, 1)))
    with pytest.raises(ValueError, match="accumulate must be"):
        blockwise_matmul(a, np.ones((2, 2)), b, np.ones((2, 1)), accumulate="fp16")
    with pytest.raises(ValueError, match="between 2 and 24"):
        round_to_significant_bits(a, 25)
    with pytest.raises(ValueError, match="between 2 and 24"):
        round_to_significant_bits(a, 1)
    with pytest.raises(ValueError, match=r"a \(M, K\) times b \(K, N\)"):
        limited_accumulation(a, b.T)
