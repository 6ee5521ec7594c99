"""fp8's scale_values pinned: float32 products whatever the input, quiet about inf and NaN."""

import numpy as np

from minimp.precision.fp8 import scale_values


def test_scale_values_of_a_float64_array_is_float32():
    values = np.array([1.0 + 2.0**-40, -3.0, 1e-3], np.float64)
    scaled = scale_values(values, 4.0)
    assert scaled.dtype == np.float32
    expected = np.multiply(values.astype(np.float32), np.float32(4.0), dtype=np.float32)
    np.testing.assert_array_equal(scaled, expected)


def test_scale_values_overflows_and_makes_nan_quietly_whatever_the_callers_errstate():
    with np.errstate(all="raise"):
        too_big = scale_values(np.array([3e38, np.nan], np.float32), 2.0)
        inf_times_zero = scale_values(np.array([np.inf], np.float32), 0.0)
    assert np.isposinf(too_big[0]) and np.isnan(too_big[1])  # inf: the cast then saturates it
    assert np.isnan(inf_times_zero[0])
