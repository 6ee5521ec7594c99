"""Loss scalers pinned: the exact message for each bad setting, the float32 edge of a scale, and
the protocol's flags (`applied`, `hit_min_scale`) as the bools they are, at every point."""

import re

import numpy as np
import pytest

from minimp import DynamicLossScaler, StaticLossScaler, Tensor

FLOAT32_MAX = float(np.finfo(np.float32).max)


@pytest.mark.parametrize("name", ["init_scale", "growth_factor", "backoff_factor", "min_scale"])
@pytest.mark.parametrize("value", [0.0, float("inf")])
def test_each_bad_scale_setting_is_named_in_its_error(name, value):
    message = f"^{name} must be a positive finite float32 number, got {value!r}$"
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**{name: value})


@pytest.mark.parametrize("name", ["growth_interval", "hysteresis"])
def test_each_count_below_one_is_named_in_its_error(name):
    with pytest.raises(ValueError, match=f"^{name} must be an integer >= 1, got 0$"):
        DynamicLossScaler(**{name: 0})


@pytest.mark.parametrize("growth, backoff", [(1.0, 0.5), (2.0, 1.0), (0.5, 2.0)])
def test_factors_that_do_not_grow_and_shrink_are_refused(growth, backoff):
    # backoff 1.0 would never back off: an overflowing run would repeat its overflow forever
    message = f"^need growth_factor > 1 and 0 < backoff_factor < 1, got {growth} and {backoff}$"
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(growth_factor=growth, backoff_factor=backoff)


def test_a_min_scale_above_the_initial_scale_is_refused_with_both_values():
    with pytest.raises(ValueError, match=r"^need min_scale <= init_scale, got 4.0 > 2.0$"):
        DynamicLossScaler(init_scale=2.0, min_scale=4.0)


SMALLEST_NORMAL = float(np.finfo(np.float32).smallest_normal)  # 2**-126
SMALLEST_SUBNORMAL = float(np.finfo(np.float32).smallest_subnormal)  # 2**-149, about 1.4e-45
USE_AT_LEAST = ("in float32, the dtype a scale is kept in; use at least 2**-126 = 1.1755e-38 "
                "(float32's smallest normal number), so that the step's 1/scale is finite in "
                "float32")


@pytest.mark.parametrize("name", ["init_scale", "min_scale"])
def test_a_scale_that_rounds_to_0_in_float32_is_refused_naming_float32(name):
    # 1e-50 is a positive float64, but the scale lives in float32, where it is 0: every gradient
    # would become 0 (or NaN); the setting is named, not the check that min_scale <= init_scale
    message = f"^{name} 1e-50 rounds to 0 {re.escape(USE_AT_LEAST)}$"
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**{"init_scale": 1.0, "min_scale": 1e-60, name: 1e-50})
    message = f"^loss scale 1e-50 rounds to 0 {re.escape(USE_AT_LEAST)}$"
    with pytest.raises(ValueError, match=message):
        StaticLossScaler(1e-50)


@pytest.mark.parametrize("scale", [SMALLEST_SUBNORMAL, 1e-45, SMALLEST_NORMAL / 2])
def test_a_scale_that_is_subnormal_in_float32_is_refused_because_its_reciprocal_is_not(scale):
    # float32 holds 1e-45 (a subnormal), but the step multiplies every gradient by 1/scale in
    # float32, where 1/1e-45 is inf: every gradient would become inf or NaN
    with np.errstate(over="ignore"):
        assert np.float32(1.0 / 1e-45) == np.inf
    message = f"^loss scale {re.escape(repr(scale))} is subnormal {re.escape(USE_AT_LEAST)}$"
    with pytest.raises(ValueError, match=message):
        StaticLossScaler(scale)
    with pytest.raises(ValueError, match="^init_scale .* is subnormal in float32"):
        DynamicLossScaler(init_scale=scale, min_scale=scale)
    with pytest.raises(ValueError, match="^the state's loss_scale .* is subnormal in float32"):
        StaticLossScaler(1.0).load_state_dict({"kind": "static", "loss_scale": scale})


def test_the_smallest_normal_float32_is_the_least_valid_scale():
    # its reciprocal, 2**126, is a finite float32: unscaling by it is exact
    assert StaticLossScaler(SMALLEST_NORMAL).loss_scale == SMALLEST_NORMAL
    scaler = DynamicLossScaler(init_scale=SMALLEST_NORMAL, min_scale=SMALLEST_NORMAL)
    assert scaler.loss_scale == SMALLEST_NORMAL
    assert np.float32(1.0 / SMALLEST_NORMAL) == 2.0**126


@pytest.mark.parametrize("value", [True, np.bool_(True), "65536", "2", b"2", None, [2.0]])
def test_a_scale_that_is_not_a_number_is_refused_bools_and_strings_included(value):
    # True used to be a scale of 1, "65536" a scale of 65536: a setting that is not a number is
    # a mistake somewhere (a flag parsed as a bool, a state read as text), not a value
    message = rf"^loss scale must be a positive finite number, got {re.escape(repr(value))} \(a "
    with pytest.raises(ValueError, match=message):
        StaticLossScaler(value)
    with pytest.raises(ValueError, match="^init_scale must be a positive finite number, got "):
        DynamicLossScaler(init_scale=value)
    with pytest.raises(ValueError, match="^the state's loss_scale must be a positive finite"):
        StaticLossScaler(2.0).load_state_dict({"kind": "static", "loss_scale": value})
    state = {**DynamicLossScaler().state_dict(), "loss_scale": value}
    with pytest.raises(ValueError, match="^the state's loss_scale must be a positive finite"):
        DynamicLossScaler().load_state_dict(state)


def test_numpys_numbers_are_scales_as_the_numbers_they_are():
    assert StaticLossScaler(np.float32(8.0)).loss_scale == 8.0
    assert DynamicLossScaler(init_scale=np.float64(4.0), min_scale=np.int64(2)).min_scale == 2.0
    scaler = StaticLossScaler(2.0)
    scaler.load_state_dict({"kind": "static", "loss_scale": np.float32(16.0)})
    assert scaler.loss_scale == 16.0 and type(scaler.loss_scale) is float


def test_the_largest_float32_is_a_valid_scale():
    # finite float32 up to and including its maximum; only what lies beyond is refused
    assert StaticLossScaler(FLOAT32_MAX).loss_scale == FLOAT32_MAX
    assert DynamicLossScaler(init_scale=FLOAT32_MAX).loss_scale == FLOAT32_MAX
    with pytest.raises(ValueError, match="^loss scale must be a positive finite float32"):
        StaticLossScaler(FLOAT32_MAX * 2)  # a Python float past float32's range


def test_dynamic_scaler_flags_are_the_protocols_bools_at_every_point():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=2.0)
    assert scaler.hit_min_scale is False and scaler.applied is False  # nothing scaled yet
    assert float(scaler.scale(Tensor(np.float32(3.0))).data) == 12.0 and scaler.applied is True
    scaler.update(found_inf=False)
    assert (scaler.applied, scaler.hit_min_scale) == (False, False)
    assert scaler.applied is False and scaler.hit_min_scale is False
    scaler.scale(Tensor(np.float32(1.0)))
    scaler.update(found_inf=True)  # 4 -> 2, min_scale reached exactly: not clamped
    assert (scaler.loss_scale, scaler.applied, scaler.hit_min_scale) == (2.0, False, False)
    scaler.update(found_inf=True)  # 2 -> 1 would pass min_scale: clamped, and said so
    assert scaler.loss_scale == 2.0 and scaler.hit_min_scale is True
