"""Loss scalers pinned: the exact message for each bad setting, the float32 edge of a scale, and
the protocol's flags (`applied`, `hit_min_scale`) as the bools they are, at every point."""

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


@pytest.mark.parametrize("name", ["init_scale", "min_scale"])
def test_a_scale_that_rounds_to_0_in_float32_is_refused_naming_float32(name):
    # 1e-50 is a positive float64, but the scale lives in float32, where it is 0: every gradient
    # would become 0 (or NaN); the setting is named, not the check that min_scale <= init_scale
    message = rf"^{name} 1e-50 rounds to 0 in float32, the dtype a scale is kept in; use at least"
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**{"init_scale": 1.0, "min_scale": 1e-60, name: 1e-50})
    with pytest.raises(ValueError, match="^loss scale 1e-50 rounds to 0 in float32"):
        StaticLossScaler(1e-50)
    smallest = float(np.finfo(np.float32).smallest_subnormal)  # the least scale float32 holds
    assert StaticLossScaler(smallest).loss_scale == smallest
    assert DynamicLossScaler(init_scale=smallest, min_scale=smallest).loss_scale == smallest


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
