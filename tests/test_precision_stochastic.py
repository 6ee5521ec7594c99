"""Stochastic rounding float32 -> bfloat16 (llm.c's law), tested exactly: over all 2^16 values of
its random bits the rounded results average to the float32 input, to the bit, in float64; and
round-to-nearest-even equals ml_dtypes' bfloat16 cast on every bfloat16 pattern's neighbours."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp.precision.stochastic import draw_random_bits, round_to_bfloat16
from minimp.precision.stochastic import round_to_bfloat16_stochastic

EVERY_RANDOM_BITS = np.arange(1 << 16, dtype=np.uint32)  # r = 0 .. 65535, each once
BFLOAT16_MAX = 0x7F7F0000  # float32 pattern of bfloat16's largest finite value, 3.3895e38


def from_bits(*patterns: int) -> np.ndarray:
    return np.array(patterns, dtype=np.uint32).view(np.float32)


def every_rounding(x: np.ndarray) -> np.ndarray:
    """(len(x), 65536) float64: x[i] rounded with each of the 2^16 random values."""
    return round_to_bfloat16_stochastic(x[:, None], EVERY_RANDOM_BITS[None, :]).astype(np.float64)


def inputs(rng: np.random.Generator) -> np.ndarray:
    """Random normals of both signs and many binades, random subnormals, exact bfloat16 values
    (low bits 0), zeros, values whose rounding up carries into the next binade (the largest
    subnormal to the smallest normal, 1 - 2^-24 to 1) and values just below bfloat16's max."""
    exponents = rng.integers(1, 254, 64, dtype=np.uint32) << np.uint32(23)
    normals = exponents | rng.integers(0, 1 << 23, 64, dtype=np.uint32)
    subnormals = rng.integers(1, 1 << 23, 16, dtype=np.uint32)
    exact = normals[:16] & np.uint32(0xFFFF0000)
    edges = np.array([0, 1, 0x007FFFFF, 0x3F7FFFFF, BFLOAT16_MAX - 1, BFLOAT16_MAX - 0x8000,
                      BFLOAT16_MAX], np.uint32)
    patterns = np.concatenate([normals, subnormals, exact, edges])
    return np.concatenate([patterns, patterns | np.uint32(0x80000000)]).view(np.float32)


def test_the_mean_over_all_random_bits_is_the_input_exactly(rng):
    x = inputs(rng)
    rounded = every_rounding(x)
    # exact: two values of 8 significant bits, 2^16 of them, sum in float64 without rounding
    assert np.array_equal(rounded.mean(axis=1), x.astype(np.float64))
    low = x.view(np.uint32) & np.uint32(0xFFFF)
    truncated = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32).astype(np.float64)
    assert np.array_equal((rounded != truncated[:, None]).sum(axis=1), low)  # up: low of 2^16


def test_beyond_bfloat16_max_rounds_to_inf_for_low_of_the_random_values():
    x = from_bits(BFLOAT16_MAX + 1, BFLOAT16_MAX + 0x8000, 0x7F7FFFFF)  # the last: float32 max
    x = np.concatenate([x, -x])
    rounded = every_rounding(x)
    low = x.view(np.uint32) & np.uint32(0xFFFF)
    bf16_max = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)
    assert np.array_equal(np.isinf(rounded).sum(axis=1), low)
    assert (np.abs(rounded[np.isfinite(rounded)]) == bf16_max).all()


def test_infinities_and_nans_are_kept_for_every_random_value():
    infinities = np.array([np.inf, -np.inf], np.float32)
    assert (every_rounding(infinities) == infinities[:, None]).all()
    nans = from_bits(0x7FC00000, 0x7F800001, 0x7FFFFFFF, 0xFFFFFFFF, 0xFF80FFFF)  # low payloads too
    rounded = round_to_bfloat16_stochastic(nans[:, None], EVERY_RANDOM_BITS[None, :])
    assert (rounded.view(np.uint16) == ml_dtypes_bits(nans)[:, None]).all()  # quiet, signed


def ml_dtypes_bits(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' float32 -> bfloat16 cast, as uint16 patterns."""
    with np.errstate(invalid="ignore"):  # it says so for NaN, which it casts as NaN
        return x.astype(ml_dtypes.bfloat16).view(np.uint16)


def test_round_to_nearest_even_is_ml_dtypes_cast_around_every_bfloat16_pattern(rng):
    """Every 16-bit upper half with the low halves that decide a rounding: 0, 1, a tie less one,
    the tie 0x8000, a tie plus one, all ones and random."""
    low = np.concatenate([[0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], rng.integers(0, 1 << 16, 4)])
    upper = np.arange(1 << 16, dtype=np.uint32) << np.uint32(16)
    x = (upper[:, None] | low.astype(np.uint32)[None, :]).ravel().view(np.float32)
    assert np.array_equal(round_to_bfloat16(x).view(np.uint16), ml_dtypes_bits(x))


@given(st.floats(width=32), st.integers(0, (1 << 16) - 1))
def test_any_float32_rounds_to_one_of_its_two_bfloat16_neighbours(value, r):
    x = np.array([value], np.float32)  # subnormals, infinities and NaN included
    assert np.array_equal(round_to_bfloat16(x).view(np.uint16), ml_dtypes_bits(x))
    stochastic = round_to_bfloat16_stochastic(x, np.array([r], np.uint32)).view(np.uint16)
    towards_zero = x.view(np.uint32) >> np.uint32(16)
    if not np.isnan(value):
        assert int(stochastic[0]) - int(towards_zero[0]) in (0, 1)


def test_random_bits_come_from_the_generator_passed_in():
    first = draw_random_bits(np.random.default_rng(7), (1000,))
    assert first.dtype == np.uint32 and first.max() < 1 << 16 and len(np.unique(first)) > 900
    assert np.array_equal(first, draw_random_bits(np.random.default_rng(7), (1000,)))
    x = np.full(1000, 1 + 2.0**-9, np.float32)  # a quarter of the way from 1 to the next bf16
    rounded = round_to_bfloat16_stochastic(x, first).astype(np.float64)
    assert set(rounded) == {1.0, 1 + 2.0**-7}


def test_random_bits_outside_16_bits_are_refused():
    x = np.ones(2, np.float32)
    with pytest.raises(ValueError, match="below 2"):
        round_to_bfloat16_stochastic(x, np.array([0, 1 << 16], np.uint32))
    with pytest.raises(ValueError, match="uint32"):
        round_to_bfloat16_stochastic(x, np.array([0, 1]))
