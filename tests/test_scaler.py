"""Loss scalers: the dynamic scaler's trajectory rules, hysteresis, min_scale, state round trips."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp import DynamicLossScaler, NoLossScaler, StaticLossScaler, Tensor


def gradscaler_reference(found_infs, scale, growth_factor, backoff_factor, growth_interval):
    """torch.amp.GradScaler's update rule (aten _amp_update_scale_), written out independently:
    on inf/NaN scale *= backoff and the tracker resets; else tracker += 1 and at growth_interval the
    scale grows (only if the grown float32 value is finite) and the tracker resets."""
    scale, tracker, trajectory = np.float32(scale), 0, []
    for found_inf in found_infs:
        if found_inf:
            scale, tracker = np.float32(scale * np.float32(backoff_factor)), 0
        else:
            tracker += 1
            if tracker == growth_interval:
                grown = np.float32(scale * np.float32(growth_factor))
                scale = grown if np.isfinite(grown) else scale
                tracker = 0
        trajectory.append(float(scale))
    return trajectory


@given(
    st.lists(st.booleans(), max_size=200),
    st.sampled_from([2.0, 3.0, 1.5]),
    st.sampled_from([0.5, 0.25, 0.7]),
    st.integers(1, 6),
)
def test_dynamic_scaler_follows_gradscaler_above_min_scale(found_infs, growth, backoff, interval):
    init = 2.0**20
    scaler = DynamicLossScaler(
        init_scale=init,
        growth_factor=growth,
        backoff_factor=backoff,
        growth_interval=interval,
        min_scale=1e-30,
    )
    ours = []
    for found_inf in found_infs:
        scaler.update(found_inf)
        ours.append(scaler.loss_scale)
    assert ours == gradscaler_reference(found_infs, init, growth, backoff, interval)


def test_scale_never_grows_to_a_non_finite_float32():
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    for _ in range(5):
        scaler.update(False)
    assert scaler.loss_scale == 2.0**127


def test_hysteresis_tolerates_overflows_until_the_allowance_is_spent():
    scaler = DynamicLossScaler(init_scale=1024.0, hysteresis=3, growth_interval=2)
    scaler.update(True)
    scaler.update(True)
    assert scaler.loss_scale == 1024.0  # two overflows tolerated
    scaler.update(True)
    assert scaler.loss_scale == 512.0  # the third backs off
    scaler.update(True)
    assert scaler.loss_scale == 256.0  # allowance spent: every overflow backs off until a growth
    scaler.update(False)
    scaler.update(False)
    assert scaler.loss_scale == 512.0  # grew, and the allowance refilled
    scaler.update(True)
    assert scaler.loss_scale == 512.0


def test_min_scale_stops_shrinking_and_says_so():
    scaler = DynamicLossScaler(init_scale=4.0, min_scale=1.0)
    scaler.update(True)
    scaler.update(True)
    assert scaler.loss_scale == 1.0 and not scaler.hit_min_scale
    scaler.update(True)
    assert scaler.loss_scale == 1.0 and scaler.hit_min_scale
    scaler.update(False)
    assert not scaler.hit_min_scale


def test_state_dict_round_trip_continues_the_same_trajectory():
    a = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    for flag in [False, True, False, True, True, False]:
        a.update(flag)
    b = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2)
    b.load_state_dict(a.state_dict())
    for flag in [False, False, False, True, True]:
        a.update(flag)
        b.update(flag)
        assert a.loss_scale == b.loss_scale


def test_static_scaler_scales_and_never_changes():
    scaler = StaticLossScaler(128.0)
    scaler.update(True)
    assert scaler.loss_scale == 128.0
    with pytest.raises(ValueError):
        StaticLossScaler(0.0)


def test_a_back_off_below_min_scale_clamps_to_min_scale():
    scaler = DynamicLossScaler(init_scale=3.0, min_scale=2.0)
    scaler.update(True)  # 1.5 would be below the floor: DeepSpeed and Megatron clamp to it
    assert scaler.loss_scale == 2.0 and scaler.hit_min_scale


def test_a_default_scaler_that_loads_a_state_continues_its_trajectory():
    a = DynamicLossScaler(init_scale=2.0**10, growth_interval=3, hysteresis=2, min_scale=4.0)
    for flag in [False, True, False]:
        a.update(flag)
    b = DynamicLossScaler()  # every setting differs from a's
    b.load_state_dict(a.state_dict())
    for flag in [False, False, False, True, True, True, True, False]:
        a.update(flag)
        b.update(flag)
        assert (a.loss_scale, a.growth_tracker, a.hysteresis_tracker) == (
            b.loss_scale,
            b.growth_tracker,
            b.hysteresis_tracker,
        )


@pytest.mark.parametrize(
    "arguments",
    [
        {"init_scale": float("nan")},
        {"init_scale": float("inf")},
        {"init_scale": 1e39},  # beyond float32
        {"init_scale": -1.0},
        {"init_scale": "abc"},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.5},
        {"backoff_factor": float("nan")},
        {"growth_interval": 2.5},
        {"growth_interval": 0},
        {"growth_interval": True},
        {"hysteresis": 0},
        {"min_scale": 0.0},
        {"min_scale": 2.0**20},  # above init_scale
    ],
)
def test_dynamic_scaler_refuses_bad_arguments(arguments):
    with pytest.raises(ValueError):
        DynamicLossScaler(**arguments)


@pytest.mark.parametrize("scale", ["abc", None, float("nan"), float("inf"), 0.0, -2.0])
def test_static_scaler_refuses_what_is_not_a_positive_finite_number(scale):
    with pytest.raises(ValueError, match="^loss scale must be a positive finite"):
        StaticLossScaler(scale)


def test_static_scaler_flags_are_the_protocols_bools():
    scaler = StaticLossScaler(8.0)
    assert scaler.hit_min_scale is False and scaler.applied is False  # nothing scaled yet
    assert float(scaler.scale(Tensor(np.float32(3.0))).data) == 24.0 and scaler.applied is True
    scaler.update(found_inf=True)
    assert (scaler.loss_scale, scaler.applied, scaler.hit_min_scale) == (8.0, False, False)
    assert scaler.applied is False and scaler.hit_min_scale is False


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "static"},
        {"loss_scale": float("nan")},
        {"loss_scale": 0.0},
        {"growth_tracker": -1},
        {"growth_tracker": 2000},
        {"hysteresis_tracker": 2},  # above hysteresis (1)
        {"hysteresis_tracker": 1.0},
        {"growth_interval": "x"},
    ],
)
def test_load_state_dict_refuses_a_bad_state_and_changes_nothing(change):
    scaler = DynamicLossScaler(init_scale=256.0)
    before = scaler.state_dict()
    with pytest.raises(ValueError):
        scaler.load_state_dict({**DynamicLossScaler().state_dict(), **change})
    assert scaler.state_dict() == before


def test_growth_at_float32s_edge_ignores_the_callers_overflow_setting():
    # the grown scale overflows float32: _times must return inf quietly, whatever np.errstate says
    scaler = DynamicLossScaler(init_scale=2.0**127, growth_interval=1)
    with np.errstate(over="raise"):
        scaler.update(False)
    assert scaler.loss_scale == 2.0**127 and scaler.growth_tracker == 0


def test_load_state_dict_names_the_missing_keys():
    state = DynamicLossScaler().state_dict()
    del state["growth_factor"], state["min_scale"]
    with pytest.raises(ValueError, match=r"state lacks \['growth_factor', 'min_scale'\]$"):
        DynamicLossScaler().load_state_dict(state)


def test_load_state_dict_restores_every_setting():
    a = DynamicLossScaler(
        init_scale=2.0**10, growth_factor=3.0, backoff_factor=0.25, growth_interval=5,
        hysteresis=3, min_scale=256.0,
    )
    a.update(True)
    b = DynamicLossScaler()  # every setting differs from a's
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    assert (b.growth_factor, b.backoff_factor, b.min_scale) == (3.0, 0.25, 256.0)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"growth_tracker": 1.0}, "^growth_tracker must be an integer, got 1.0$"),
        ({"hysteresis_tracker": 1.0}, "^hysteresis_tracker must be an integer, got 1.0$"),
        ({"growth_tracker": 2000}, "^growth_tracker must be below growth_interval$"),
        ({"hysteresis_tracker": 2}, "^hysteresis_tracker must not exceed hysteresis$"),
    ],
)
def test_load_state_dict_says_which_field_is_wrong(change, message):
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler().load_state_dict({**DynamicLossScaler().state_dict(), **change})


def test_no_loss_scaler_state_records_scale_one():
    scaler = NoLossScaler()
    assert scaler.state_dict() == {"kind": "none", "loss_scale": 1.0} and scaler.loss_scale == 1.0


SCALERS = {"dynamic": DynamicLossScaler, "static": lambda: StaticLossScaler(2.0)}


@pytest.mark.parametrize(
    "kind, state, found",
    [
        ("dynamic", {"kind": "static", "loss_scale": 4.0}, "'static'"),
        ("static", DynamicLossScaler().state_dict(), "'dynamic'"),
        ("dynamic", {"loss_scale": 4.0}, "None"),  # a dict without a kind
        ("static", [("kind", "static")], "'list'"),  # not a dict: its type is named instead
    ],
)
def test_a_state_of_another_kind_is_refused_naming_what_it_is_for(kind, state, found):
    # the message names both kinds, so a mixed-up checkpoint is recognized at once
    message = f"^this is a {kind} loss scaler; the state is for {found}$"
    with pytest.raises(ValueError, match=message):
        SCALERS[kind]().load_state_dict(state)
