"""fp8 delayed scaling pinned: the scale from a tiny amax, whatever the caller's errstate."""

import numpy as np

from minimp.precision.fp8_scaling import delayed_scaling_update, scale_from_amax


def test_a_quotient_past_float32_is_float32s_max_quietly_whatever_the_callers_errstate():
    # 448 / 1e-45 (a float32 subnormal) overflows: TE's rule answers float32's largest number
    with np.errstate(all="raise"):
        scale = scale_from_amax(1e-45, 448.0, previous=1.0)
    assert scale == np.finfo(np.float32).max and scale.dtype == np.float32



def test_delayed_scaling_without_a_margin_scales_the_largest_amax_to_fp8s_max():
    # margin 0 by default (TE's default): the scale maps the history's largest amax onto 448
    history = np.array([2.0, 4.0, 16.0], np.float32)  # row 0 the newest step
    new_history, scale = delayed_scaling_update(history, 1.0, 1.0, 448.0)
    np.testing.assert_array_equal(new_history, [1.0, 2.0, 4.0])  # 16, the oldest, is dropped
    assert scale == np.float32(448.0) / np.float32(4.0)
