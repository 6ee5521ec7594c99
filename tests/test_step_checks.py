"""The mixed-precision step's helpers pinned: which arrays all_finite checks element by element,
unscale_'s and clip_grad_norm_'s values, the unscaled-loss warning, and the reduce a skipped step
saves."""

import numpy as np
import pytest

from minimp import StaticLossScaler, Tensor, nn, optim
from minimp.precision import BFLOAT16
from minimp.precision import step as step_module
from minimp.precision.step import (
    GradientSync,
    SingleProcess,
    all_finite,
    clip_grad_norm_,
    squared_norm,
    unscale_,
)

F16, F32 = np.float16, np.float32


@pytest.fixture
def exact_checks(monkeypatch):
    """Records each call of the element-by-element check (the per-array isfinite pass, one host
    sync per gradient on a GPU) and how many arrays it was given."""
    calls, exact = [], step_module._each_finite

    def recording(arrays):
        calls.append(len(arrays))
        return exact(arrays)

    monkeypatch.setattr(step_module, "_each_finite", recording)
    return calls


def test_all_finite_of_no_gradients_at_all_is_true():
    # parameters without a gradient this step are None: nothing to find, the step goes on
    assert all_finite([]) is True
    assert all_finite([None, None]) is True


@pytest.mark.parametrize("dtype", [F32, np.float64])
def test_finite_float32_gradients_are_answered_by_one_sum_of_squares(exact_checks, dtype):
    gradients = [np.full(5, 3.0, dtype), None, np.arange(4, dtype=dtype)]
    assert all_finite(gradients) is True
    assert exact_checks == []  # the shortcut decided: no per-array pass


@pytest.mark.parametrize("dtype", [F16, BFLOAT16])
def test_16_bit_gradients_are_checked_element_by_element(exact_checks, dtype):
    # float16 squares overflow from 256 on: the shortcut would often fall through anyway
    gradients = [np.ones(3, F32), np.ones(3, dtype)]
    assert all_finite(gradients) is True
    assert exact_checks == [2]


def test_squares_whose_sum_overflows_are_decided_element_by_element(exact_checks):
    # each square (2.25e38) is finite, their float32 sum is not: only the exact pass can say
    gradients = [np.array([1.5e19], F32), np.array([1.5e19], F32)]
    assert all_finite(gradients) is True
    assert exact_checks == [2]


@pytest.mark.parametrize("scale", [2.0, 0.5, 1024.0])
def test_unscale_divides_every_gradient_by_the_scale_in_place(scale):
    gradients = [np.array([3.0, -6.0], F32), None]
    unscale_(gradients, scale)
    np.testing.assert_array_equal(gradients[0], np.array([3.0, -6.0], F32) / F32(scale))


def test_a_norm_equal_to_max_norm_is_left_unclipped():
    gradient = np.array([3.0, 4.0], F32)  # norm exactly 5
    assert clip_grad_norm_([gradient], 5.0, SingleProcess()) == 5.0
    np.testing.assert_array_equal(gradient, np.array([3.0, 4.0], F32))


def test_clipping_multiplies_by_max_norm_over_the_norm_plus_1e_6():
    # tiny norms show PyTorch's epsilon: 1e-6 / (5e-6 + 1e-6) is 1/6, not 1/5 (nor 1/4)
    gradient = np.array([3e-6, 4e-6], F32)
    norm = clip_grad_norm_([gradient], 1e-6, SingleProcess())
    assert norm == pytest.approx(5e-6, rel=1e-6)
    np.testing.assert_allclose(gradient, np.array([3e-6, 4e-6], F32) / 6, rtol=1e-6)


def one_float32_step(scaler, monkeypatch):
    """mixed_precision_step on a 1-parameter model whose loss was not scaled; returns the
    warnings.warn calls (arguments, keyword arguments) the step made."""
    parameter = nn.Parameter(np.ones(2, F32))
    optimizer = optim.SGD([parameter], lr=0.5)
    (Tensor(np.ones(2, F32)) * parameter).sum().backward()  # not scaler.scale(loss)
    calls = []
    monkeypatch.setattr(step_module.warnings, "warn", lambda *a, **k: calls.append((a, k)))
    step_module.mixed_precision_step(optimizer, scaler)
    return calls


def test_an_unscaled_loss_warns_for_any_scale_but_one(monkeypatch):
    assert len(one_float32_step(StaticLossScaler(2.0), monkeypatch)) == 1
    assert one_float32_step(StaticLossScaler(1.0), monkeypatch) == []  # dividing by 1: harmless


def test_the_unscaled_loss_warning_says_what_to_call_and_names_the_caller(monkeypatch):
    # stacklevel 3: warn <- _warn_if_scale_unused <- mixed_precision_step <- the training loop.
    # The argument is checked, not the warning's file: a mutation tool runs each function one
    # frame deeper (its trampoline), which moves the file the warning names
    message = (
        "mixed_precision_step: the loss scaler's scale was not applied since its last update; "
        "call scaler.scale(loss).backward(), not loss.backward()"
    )
    assert one_float32_step(StaticLossScaler(4.0), monkeypatch) == [((message,), {"stacklevel": 3})]


class HalvingSync(GradientSync):
    """Two ranks, the other one's gradients all zero: the reduced mean is half of ours.
    Counts its reduces; `overflow` makes the reduce overflow (a float16 wire)."""

    def __init__(self, overflow=False):
        self.reduces, self.overflow = 0, overflow

    def any_rank(self, found_inf):
        return found_inf  # the other rank has nothing to add to the decision

    def reduce(self, gradients):
        self.reduces += 1
        for grad in gradients:
            grad *= np.inf if self.overflow else 0.5

    def global_squared_norm(self, gradients):
        return squared_norm(gradients)


def one_parameter_step(gradient, sync, scaler=None):
    parameter = nn.Parameter(np.ones(2, F32))
    optimizer = optim.SGD([parameter], lr=0.5)
    parameter.grad = np.array(gradient, F32)
    result = step_module.mixed_precision_step(optimizer, scaler or StaticLossScaler(1.0), sync=sync)
    return result, parameter.data


def test_the_step_updates_with_the_reduced_gradients():
    sync = HalvingSync()
    result, weight = one_parameter_step([1.0, -2.0], sync)
    assert not result.skipped and sync.reduces == 1
    np.testing.assert_array_equal(weight, np.array([0.75, 1.5], F32))  # 1 - 0.5 * g / 2


def test_a_step_found_non_finite_before_the_reduce_skips_it_and_reports_an_infinite_norm():
    sync = HalvingSync()
    result, weight = one_parameter_step([1.0, np.inf], sync, StaticLossScaler(8.0))
    assert sync.reduces == 0  # every rank skips: nothing worth averaging
    assert (result.skipped, result.loss_scale, result.grad_norm) == (True, 8.0, np.inf)
    np.testing.assert_array_equal(weight, np.ones(2, F32))


def test_a_reduce_that_overflows_skips_the_step():
    result, weight = one_parameter_step([1.0, 2.0], HalvingSync(overflow=True))
    assert result.skipped and result.grad_norm == np.inf
    np.testing.assert_array_equal(weight, np.ones(2, F32))


class RecordingScaler(StaticLossScaler):
    def update(self, found_inf):
        self.heard = found_inf
        super().update(found_inf)


@pytest.mark.parametrize("gradient, found_inf", [([1.0, 2.0], False), ([np.nan, 2.0], True)])
def test_the_scaler_hears_found_inf_as_the_protocols_bool(gradient, found_inf):
    scaler = RecordingScaler(1.0)
    one_parameter_step(gradient, SingleProcess(), scaler)
    assert scaler.heard is found_inf
