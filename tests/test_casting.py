"""Float16 facts, each a property test: the numbers every lesson and docstring relies on."""

import math

import ml_dtypes
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import (
    FLOAT16_MAX,
    SMALLEST_SUBNORMAL,
    finite_float16,
    float16_bits,
    normal_range_floats,
)

from minimp import Tensor
from minimp.precision import casting

f16 = np.float16


@given(normal_range_floats())
def test_cast_round_trip_error_is_at_most_2_to_the_minus_11_relative(value):
    rounded = float(f16(value))
    assert abs(rounded - value) <= 2.0**-11 * abs(value)


def test_largest_float16_and_where_overflow_starts():
    assert float(f16(65504)) == FLOAT16_MAX == float(np.finfo(f16).max)
    # below the midpoint to the next (missing) step: rounds down
    assert float(f16(65519)) == 65504.0
    assert np.isinf(f16(65520))  # the midpoint 65520 rounds to even, which is the overflow to inf


@given(st.floats(0.0, 2.0**-25, exclude_max=True))
def test_values_under_2_to_the_minus_25_flush_to_zero(value):
    assert float(f16(value)) == 0.0


@given(st.floats(0.0, 2.0**-14, allow_nan=False))
def test_subnormals_keep_an_absolute_spacing_of_2_to_the_minus_24(value):
    rounded = float(f16(value))
    assert abs(rounded - value) <= SMALLEST_SUBNORMAL / 2
    assert (rounded / SMALLEST_SUBNORMAL).is_integer()


@given(st.integers(-1000, 1000), st.integers(-14, 15))
def test_ties_round_to_even(mantissa_step, exponent):
    """A value exactly halfway between neighbouring float16 numbers goes to the even mantissa."""
    lower = float(f16(2.0**exponent * (1 + (abs(mantissa_step) % 1023) / 1024)))
    upper = float(np.nextafter(f16(lower), f16(np.inf)))
    if not math.isfinite(upper):
        return
    midpoint = (lower + upper) / 2  # exact in float64
    lower_is_even = np.array(lower, f16).view(np.uint16) % 2 == 0
    assert float(f16(midpoint)) == (lower if lower_is_even else upper)


def test_2049_rounds_to_2048_and_2051_to_2052():
    assert float(f16(2049)) == 2048.0 and float(f16(2051)) == 2052.0


def test_sequential_float16_accumulation_stalls_at_2048_float32_does_not():
    assert f16(2048) + f16(1) == f16(2048)
    running16, running32 = f16(0), np.float32(0)
    for _ in range(3000):
        running16 = f16(running16 + f16(1))
        running32 = np.float32(running32 + np.float32(f16(1)))
    assert float(running16) == 2048.0
    assert float(running32) == 3000.0


def test_numpy_float16_sum_does_not_stall_where_cumsum_does():
    """np.sum of float16 adds in float32 and rounds once (tests/lessons/test_lesson01.py tells it
    apart from a pairwise float16 sum); cumsum keeps float16 between additions and stalls."""
    ones = np.ones(3000, f16)
    assert float(np.sum(ones)) == 3000.0 and float(np.cumsum(ones)[-1]) == 2048.0


def test_minimp_sum_of_float16_ones_accumulates_in_float32():
    ones = Tensor(np.ones(3000, f16))
    assert ones.sum().item() == 3000.0  # stored in float16: 3000 is representable (multiple of 2)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 64), st.integers(1, 300), st.integers(1, 16), st.integers(0, 2**31 - 1))
def test_float16_matmul_with_float32_accumulation_meets_the_classic_error_bound(m, k, n, seed):
    """|fl(A @ B) - A @ B| <= u16 |A @ B| + 2^-25 + gamma_k(fp32) |A| @ |B|
    (Higham, Accuracy and Stability, eq. 3.13), where u16 = 2^-11 is the final rounding to float16,
    2^-25 the absolute error of a result that lands among float16's subnormals (half their spacing;
    Higham's model of underflow, section 2.1) and gamma_k = k u / (1 - k u), u = 2^-24."""
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)).astype(f16)
    b = rng.standard_normal((k, n)).astype(f16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    computed = (Tensor(a) @ Tensor(b)).data
    assert computed.dtype == f16
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    bound = 2.0**-11 * np.abs(exact) + 2.0**-25 + gamma * (
        np.abs(a).astype(np.float64) @ np.abs(b).astype(np.float64)
    )
    assert np.all(np.abs(computed.astype(np.float64) - exact) <= bound * (1 + 1e-12))


@given(st.floats(2.0**-40, 2.0**-25, exclude_max=True))
def test_loss_scaling_by_a_power_of_two_recovers_gradients_float16_flushes(gradient):
    assert float(f16(gradient)) == 0.0  # lost without scaling
    scale = 2.0 ** (-math.floor(math.log2(gradient)) - 4)  # moves the gradient to about 2^-4
    recovered = np.float32(f16(gradient * scale)) / np.float32(scale)
    assert abs(float(recovered) - gradient) <= 2.0**-11 * gradient


def test_loss_scaling_through_the_engine():
    """A real backward pass: gradient 2^-26 per weight vanishes in float16
    and survives a 2^16 scale."""
    weight = Tensor(np.ones(4, f16), requires_grad=True)
    (weight * 2.0**-13).sum().astype(np.float32).__mul__(2.0**-13).backward()
    assert np.all(weight.grad == 0)  # 2^-26 flushed to zero
    weight = Tensor(np.ones(4, f16), requires_grad=True)
    ((weight * 2.0**-13).sum().astype(np.float32) * 2.0**-13 * 2.0**16).backward()
    np.testing.assert_array_equal(weight.grad.astype(np.float32) / 2.0**16, np.full(4, 2.0**-26))


def test_an_update_of_half_a_gap_moves_a_float32_master_but_not_a_float16_weight():
    assert float(np.spacing(f16(1.0))) == 2.0**-10  # the ulp of 1.0 in float16
    update = 2.0**-12  # half the 2^-11 gap below 1.0: 1 - 2^-12 is a tie, and ties go to even (1.0)
    weight16, master32 = f16(1.0), np.float32(1.0)
    for _ in range(1000):
        weight16 = f16(weight16 - f16(update))
        master32 = np.float32(master32 - np.float32(update))
    assert float(weight16) == 1.0
    assert float(master32) == 1.0 - 1000 * update
    assert float(f16(master32)) != 1.0  # the rounded copy the model computes with has moved too


@given(float16_bits())
def test_relu_on_float16_matches_numpy_maximum_bit_for_bit(value):
    x = np.array([value], f16)
    ours = Tensor(x).relu().data
    theirs = np.maximum(x, f16(0))
    if np.isnan(theirs[0]):
        assert np.isnan(ours[0])
    else:
        assert ours[0] == theirs[0]


@given(finite_float16())
def test_negation_by_sign_bit_is_exact(value):
    assert float((-Tensor(np.array([value], f16))).data[0]) == -value


def test_exp_overflows_float16_just_above_11_09():
    assert np.isfinite(f16(math.exp(11.08))) and np.isinf(f16(math.exp(11.1)))


def test_a_loss_above_one_times_2_to_the_16_overflows_float16():
    assert np.isinf(f16(1.0 * 2.0**16)) and np.isfinite(np.float32(1.0 * 2.0**16))


def test_bfloat16_covers_float32_range_with_fewer_bits():
    info = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert float(info.max) > 3e38 and float(info.smallest_normal) == np.finfo(np.float32).tiny
    assert float(np.spacing(np.array(1.0, ml_dtypes.bfloat16))) == 2.0**-7


def test_widen_and_round_to():
    x = np.array([1.5], f16)
    assert casting.widen(x).dtype == np.float32
    y = np.array([1.0], np.float32)
    assert casting.widen(y) is y and casting.round_to(y, np.float32) is y


def test_a_dot_product_accumulated_in_fp16_is_far_less_accurate_than_in_fp32():
    """Lesson 9: fp16 is not 'more numerically stable'."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(4096), rng.standard_normal(4096)
    exact = float(a @ b)
    errors = {}
    for dtype in (f16, np.float32):
        total = dtype(0)
        for x, y in zip(a.astype(dtype), b.astype(dtype)):
            total = dtype(total + dtype(x * y))
        errors[dtype] = abs(float(total) - exact)
    assert errors[f16] > 100 * errors[np.float32]
