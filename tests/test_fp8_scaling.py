"""fp8 scaling: delayed scaling's trajectory is Transformer Engine's, current scaling's scale is the
tensor's own, the counts of lost values are what their names say, the state saves and loads."""

import numpy as np
import pytest

from minimp.precision import fp8
from minimp.precision.fp8 import E4M3, E5M2
from minimp.precision.fp8_scaling import (
    FLOAT32_MAX,
    DelayedScaling,
    Float8CurrentScaling,
    Fp8Quantizer,
    NoScaling,
    delayed_scaling_update,
    load_quantizers_state_dict,
    quantizers_state_dict,
    scale_from_amax,
    update_scales,
)


def transformer_engine_trajectory(amaxes, length, fp8_max, margin):
    """The scales of TE's amax_and_scale_update kernel (common/recipe/delayed_scaling.cu), step by
    step, in its own layout: row 0 holds the step's amax; the update takes the max over all rows,
    then rolls the history up by one (row 0 moves to the end) and zeroes row 0."""
    history, scale, scales = np.zeros(length, np.float32), np.float32(1.0), []
    scaled_max = np.float32(fp8_max) * np.float32(2.0**-margin)
    for amax in amaxes:
        history[0] = amax
        window = np.float32(max(history[1:].max(initial=0), history[0]))
        history = np.concatenate([[0.0], history[2:], [history[0]]]).astype(np.float32)
        if length == 1:
            history = np.zeros(1, np.float32)
        if np.isfinite(window) and window > 0:
            scale = np.float32(scaled_max / window)
        scales.append(scale)
    return scales


@pytest.mark.parametrize("length, margin", [(1, 0), (4, 0), (16, 2)])
def test_delayed_scaling_follows_transformer_engines_trajectory(length, margin, rng):
    amaxes = (2.0 ** rng.uniform(-10, 10, 60)).astype(np.float32)
    amaxes[[7, 30]] = 0.0  # nothing recorded: the scale stays
    amaxes[[12, 45]] = np.inf  # an overflow: the scale stays while it is in the window
    history, scale, ours = np.zeros(length, np.float32), np.float32(1.0), []
    for amax in amaxes:
        history, scale = delayed_scaling_update(history, amax, scale, 448.0, margin)
        ours.append(scale)
    expected = transformer_engine_trajectory(amaxes, length, 448.0, margin)
    assert [float(s) for s in ours] == [float(s) for s in expected]


def test_the_scale_aims_the_largest_amax_of_the_window_at_the_maximum():
    history = np.zeros(3, np.float32)
    scales = []
    for amax in (2.0, 8.0, 1.0, 1.0, 1.0):
        history, scale = delayed_scaling_update(history, amax, 1.0, 448.0, margin=1)
        scales.append(float(scale))
    # 8 stays in the window of 3 steps, then leaves it; the margin halves every scale.
    assert scales == [112.0, 28.0, 28.0, 28.0, 224.0]


def test_scale_from_amax_keeps_the_previous_scale_for_amaxes_that_say_nothing():
    for amax in (0.0, np.inf, np.nan):
        assert scale_from_amax(amax, 448.0, previous=3.0) == np.float32(3.0)
    assert scale_from_amax(1e-45, 448.0, previous=1.0) == FLOAT32_MAX  # 448 / 1e-45 overflows
    assert scale_from_amax(7.0, 448.0, previous=1.0) == np.float32(64.0)


def test_current_scaling_puts_the_tensors_own_amax_at_the_maximum(rng):
    quantizer = Fp8Quantizer(E4M3, Float8CurrentScaling())
    x = rng.standard_normal(1000).astype(np.float32) * 1e-3
    q, inverse = quantizer.quantize(x)
    assert quantizer.scale == np.float32(448.0) / np.float32(np.abs(x).max())
    assert np.abs(fp8.to_float32(q)).max() == 448.0 and inverse == 1 / quantizer.scale
    assert quantizer.underflow == quantizer.saturated == 0
    zeros, _ = quantizer.quantize(np.zeros(4, np.float32))
    assert quantizer.scale == 1.0 and not fp8.to_float32(zeros).any()


def test_the_counts_say_which_values_were_lost(rng):
    """underflow: nonzero values that became 0; saturated: values farther beyond the maximum than
    rounding reaches (464 for E4M3), which only the clip brings back; amax over the step."""
    x = np.array([5e-4, -9e-4, 0.0, 1.0, 460.0, -500.0, 1e9, np.nan], np.float32)  # 2^-10: 9.8e-4
    quantizer = Fp8Quantizer(E4M3, NoScaling())
    quantizer.quantize(x)
    quantizer.quantize(x[:4])
    assert (quantizer.underflow, quantizer.saturated, quantizer.count) == (4, 2, 12)
    assert quantizer.step_amax == np.inf  # NaN recorded as inf
    quantizer.quantize(x, record=False)  # an evaluation's forward changes nothing
    assert (quantizer.underflow, quantizer.saturated, quantizer.count) == (4, 2, 12)
    grad = Fp8Quantizer(E5M2, NoScaling())
    grad.quantize(np.array([1e-3, 60000.0, 70000.0], np.float32))  # E5M2 reaches 57344
    assert (grad.underflow, grad.saturated) == (0, 1)


def test_update_scales_agrees_once_and_only_for_delayed_scaling():
    calls = []

    def reduce_amax(amaxes):
        calls.append(amaxes.copy())
        return amaxes * 2  # as if another rank had seen twice as much

    delayed = [Fp8Quantizer(E4M3, DelayedScaling()) for _ in range(3)]
    for quantizer, value in zip(delayed, (1.0, 2.0, 4.0)):
        quantizer.quantize(np.array([value], np.float32))
    update_scales(delayed, reduce_amax)
    assert len(calls) == 1 and calls[0].tolist() == [1.0, 2.0, 4.0]
    assert [float(q.scale) for q in delayed] == [224.0, 112.0, 56.0]
    assert all(q.step_amax == 0 and q.count == 0 for q in delayed)  # a new step
    current = [Fp8Quantizer(E4M3, Float8CurrentScaling())]
    update_scales(current, reduce_amax)
    assert len(calls) == 1  # stateless: nothing to agree on


def test_the_delayed_state_saves_and_loads_and_refuses_what_does_not_fit():
    recipe = DelayedScaling(amax_history_len=4)
    named = [("a.input", Fp8Quantizer(E4M3, recipe)), ("a.grad_output", Fp8Quantizer(E5M2, recipe))]
    for _, quantizer in named:
        quantizer.quantize(np.array([3.0], np.float32))
    update_scales([q for _, q in named])
    state = quantizers_state_dict(named)
    assert sorted(state) == [
        "a.grad_output/amax_history", "a.grad_output/scale", "a.input/amax_history", "a.input/scale"
    ]  # fmt: skip
    fresh = [(name, Fp8Quantizer(q.fmt, recipe)) for name, q in named]
    load_quantizers_state_dict(fresh, state)
    assert all(f.scale == q.scale for (_, f), (_, q) in zip(fresh, named))
    with pytest.raises(KeyError, match="lacks a.input/scale"):
        load_quantizers_state_dict(fresh, {k: v for k, v in state.items() if k != "a.input/scale"})
    short = {**state, "a.grad_output/amax_history": np.zeros(2, np.float32)}
    with pytest.raises(ValueError, match="amax_history of shape"):
        load_quantizers_state_dict(fresh, short)
    assert quantizers_state_dict([("x", Fp8Quantizer(E4M3, NoScaling()))]) == {}


@pytest.mark.parametrize("scale", [0.5, 3.0])
def test_a_loaded_scale_below_or_above_one_is_taken_as_is(scale):
    quantizer = Fp8Quantizer(E4M3, DelayedScaling(amax_history_len=2))
    quantizer.load_state_dict({"amax_history": np.zeros(2, np.float32), "scale": np.array([scale])})
    assert quantizer.scale == np.float32(scale) and quantizer.scale.dtype == np.float32


@pytest.mark.parametrize("scale", [0.0, -1.0, np.inf, np.nan])
def test_a_loaded_scale_must_be_positive_and_finite(scale):
    quantizer = Fp8Quantizer(E4M3, DelayedScaling(amax_history_len=2))
    state = {"amax_history": np.zeros(2, np.float32), "scale": np.array([scale], np.float32)}
    with pytest.raises(ValueError, match="is not a positive finite number"):
        quantizer.load_state_dict(state)
    assert quantizer.scale == 1.0  # unchanged


def test_check_only_checks_the_state_and_loads_nothing():
    recipe = DelayedScaling(amax_history_len=2)
    named = [("a.input", Fp8Quantizer(E4M3, recipe))]
    state = {"a.input/amax_history": np.array([3.0, 1.0], np.float32),
             "a.input/scale": np.array([8.0], np.float32)}  # fmt: skip
    load_quantizers_state_dict(named, state, check_only=True)
    assert named[0][1].scale == 1.0 and not named[0][1].amax_history.any()
    with pytest.raises(ValueError, match="scale 0.0 is not"):
        load_quantizers_state_dict(named, {**state, "a.input/scale": np.zeros(1)}, check_only=True)
    load_quantizers_state_dict(named, state)
    assert named[0][1].scale == 8.0 and named[0][1].amax_history.tolist() == [3.0, 1.0]
