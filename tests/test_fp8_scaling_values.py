"""fp8 scaling pinned: scale_from_amax, delayed scaling's update and the quantizer's state."""

import numpy as np
import pytest

from minimp.precision import fp8
from minimp.precision.fp8 import E4M3
from minimp.precision.fp8_scaling import (
    DelayedScaling,
    Float8CurrentScaling,
    Fp8Quantizer,
    NoScaling,
    delayed_scaling_update,
    scale_from_amax,
)


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


def test_delayed_scaling_uses_the_stored_scale_as_float32():
    scale = DelayedScaling().scale_for(4.0, 1000.0, E4M3)  # the tensor's own amax plays no part
    assert scale == 4.0 and scale.dtype == np.float32


def test_a_new_quantizer_keeps_a_float32_history_of_zeros():
    history = Fp8Quantizer(E4M3, DelayedScaling(amax_history_len=3)).amax_history
    assert history.dtype == np.float32
    np.testing.assert_array_equal(history, np.zeros(3, np.float32))


def test_delayed_scaling_does_not_measure_the_amax_of_what_it_does_not_record(monkeypatch):
    # evaluation (record=False) under delayed scaling: the stored scale is used, so the amax
    # pass over the tensor is skipped; the stateless recipes still need it for their scale
    measured = []
    amax = fp8.amax
    monkeypatch.setattr(fp8, "amax", lambda array: measured.append(1) or amax(array))
    values = np.array([1.0, -3.0], np.float32)
    q, inverse = Fp8Quantizer(E4M3, DelayedScaling()).quantize(values, record=False)
    assert measured == [] and inverse == 1.0  # the stored scale: TE starts every scale at 1
    np.testing.assert_array_equal(q.astype(np.float32), values)
    q, inverse = Fp8Quantizer(E4M3, Float8CurrentScaling()).quantize(values, record=False)
    assert measured == [1] and inverse == np.float32(3.0) / np.float32(448.0)


def test_an_all_zero_step_keeps_the_delayed_scale():
    quantizer = Fp8Quantizer(E4M3, DelayedScaling())
    quantizer.end_step(0.0)  # nothing to scale by: the previous scale stays
    assert quantizer.scale == 1.0 and quantizer.scale.dtype == np.float32


def test_a_value_exactly_at_the_saturation_threshold_is_not_counted_as_saturated():
    # only values beyond the threshold needed the clip; the threshold itself rounds to max
    quantizer = Fp8Quantizer(E4M3, NoScaling())
    quantizer.quantize(np.array([E4M3.saturation_threshold], np.float32))
    assert quantizer.saturated == 0
    quantizer.quantize(np.array([np.nextafter(np.float32(E4M3.saturation_threshold), 1e9)]))
    assert quantizer.saturated == 1


def test_end_step_scales_by_the_recipes_margin():
    quantizer = Fp8Quantizer(E4M3, DelayedScaling(margin=1))
    quantizer.end_step(4.0)
    assert quantizer.scale == np.float32(448.0 / 2 / 4.0)  # (max / 2^margin) / amax


def test_fp8_meta_names_its_recipe():
    from minimp.precision import DelayedScaling, Float8CurrentScaling, Fp8Meta

    assert repr(Fp8Meta(DelayedScaling())) == "Fp8Meta(DelayedScaling)"
    assert repr(Fp8Meta(Float8CurrentScaling())) == "Fp8Meta(Float8CurrentScaling)"


def test_a_stateless_recipe_keeps_the_last_amax_in_front_of_its_history():
    """Current scaling needs no history to scale, but the quantizer still records the step's
    amax in front, as delayed scaling does (what lesson 15 and a reader of amax_history see)."""
    from minimp.precision import Float8CurrentScaling
    from minimp.precision.fp8 import E4M3
    from minimp.precision.fp8_scaling import Fp8Quantizer

    quantizer = Fp8Quantizer(E4M3, Float8CurrentScaling())
    quantizer.end_step(3.0)
    assert quantizer.amax_history.dtype == np.float32
    assert quantizer.amax_history[0] == np.float32(3.0)


def test_a_history_that_is_not_one_amax_per_step_is_refused_in_one_line():
    for history in (np.zeros((4, 2), np.float32), np.zeros((4, 1), np.float32), np.float32(0)):
        with pytest.raises(ValueError, match=r"1-D history; got shape .*one tensor's history"):
            delayed_scaling_update(history, 1.0, 1.0, E4M3.max)


def test_the_refusal_is_one_sentence_that_names_the_shape_it_was_given():
    with pytest.raises(ValueError) as refused:
        delayed_scaling_update(np.zeros((4, 2), np.float32), 1.0, 1.0, E4M3.max)
    assert str(refused.value) == (
        "delayed scaling keeps one amax per step, a 1-D history; got shape (4, 2): "
        "pass one tensor's history at a time"
    )
