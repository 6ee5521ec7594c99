"""fp8 delayed scaling pinned: the scale from a tiny amax, whatever the caller's errstate."""

import numpy as np

from minimp.precision.fp8_scaling import scale_from_amax


def test_a_quotient_past_float32_is_float32s_max_quietly_whatever_the_callers_errstate():
    # 448 / 1e-45 (a float32 subnormal) overflows: TE's rule answers float32's largest number
    with np.errstate(all="raise"):
        scale = scale_from_amax(1e-45, 448.0, previous=1.0)
    assert scale == np.finfo(np.float32).max and scale.dtype == np.float32
