"""Lesson 4 (loss scaling): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/04_loss_scaling.ipynb became false, or a checker passes a wrong answer."""

import math

import ml_dtypes
import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import DynamicLossScaler
from minimp.lessons.lesson04 import (
    ADAM_STEPS,
    EPS,
    SCALER_TRACE,
    SGD_STEPS,
    S,
    TOKENS,
    activation_gradients,
    adam,
    sgd,
    train_digits,
    weight_gradients,
)
from minimp.precision import NoLossScaler
from minimp.train import train

f16 = np.float16


def final(losses):
    """What the notebook prints as the final loss: the mean of the last 10 steps."""
    return float(np.mean(losses[-10:]))


def test_lesson4_where_float16_puts_the_activation_gradients():
    plain, tiny = activation_gradients(1.0), activation_gradients(1 / TOKENS)
    stored = plain.astype(f16)
    assert 0 < np.sum(stored == 0) == 11 and np.mean(stored == 0) < 0.0005  # "11, 0.011%"
    assert np.all(plain[stored == 0] <= 2.0**-25)  # "at 2^-25 or below"
    assert np.mean((stored > 0) & (stored < 2**-14)) > 1 / 3  # "more than a third"
    assert plain.max() < 2.0**-10  # "none reaches 2^-10"
    assert np.all(tiny.astype(f16) == 0)  # "every one of them becomes zero"
    scaled = (plain * S).astype(f16)
    assert np.all(scaled >= 2**-14) and plain.max() * S < 65504 / 2**8  # normal, room to spare
    assert np.array_equal(tiny * S, plain)  # the divided loss, scaled: the plain one exactly


def test_lesson4_adam_three_curves_together_one_flat_and_eps_costs_a_little():
    fp32 = final(train_digits(np.float32, NoLossScaler(), adam))
    unscaled = train_digits(f16, NoLossScaler(), adam)
    assert len(unscaled) == ADAM_STEPS
    assert final(unscaled) > 0.95 * unscaled[0]  # learns nothing
    assert final(train_digits(f16, DynamicLossScaler(), adam)) == pytest.approx(fp32, abs=0.01)
    bf16 = final(train_digits(ml_dtypes.bfloat16, NoLossScaler(), adam))
    assert bf16 == pytest.approx(fp32, abs=0.01)  # "so does bfloat16"
    plain = final(train_digits(np.float32, NoLossScaler(), adam, loss_factor=1.0))
    assert plain < fp32 - 0.05  # "the division is not quite free" (0.168 against 0.256)


def test_lesson4_sgd_needs_lr_times_2_to_the_16_then_the_scaler_matches_fp32():
    large = sgd(0.1 * TOKENS)
    same_lr = train_digits(np.float32, NoLossScaler(), sgd(0.1), steps=SGD_STEPS)
    assert final(same_lr) > 0.95 * same_lr[0]  # does not learn at all
    fp32 = final(train_digits(np.float32, NoLossScaler(), large, steps=SGD_STEPS))
    assert fp32 < 0.5
    unscaled = train_digits(f16, NoLossScaler(), large, steps=SGD_STEPS)
    assert final(unscaled) > unscaled[0]  # "ends above where it started"
    scaled = final(train_digits(f16, DynamicLossScaler(), large, steps=SGD_STEPS))
    assert scaled == pytest.approx(fp32, abs=0.01)


def test_lesson4_sgd_with_lr_times_2_to_the_16_on_the_loss_over_2_to_the_16_takes_the_same_steps():
    assert (train_digits(np.float32, NoLossScaler(), sgd(0.1), loss_factor=1.0, steps=5)
            == train_digits(np.float32, NoLossScaler(), sgd(0.1 * TOKENS), steps=5))


def test_lesson4_almost_every_gradient_flushes_and_adams_sqrt_v_comes_near_eps():
    assert round(float(np.mean(weight_gradients(f16) == 0)), 3) == 0.973  # "97.3%"
    assert 0.15 < np.mean(weight_gradients(np.float32) == 0) < 0.25  # "a fifth"
    magnitudes = np.abs(weight_gradients(np.float32))
    assert EPS / 10 < np.median(magnitudes[magnitudes > 0]) < 10 * EPS  # "near eps"


def test_lesson4_bfloat16_has_float32s_range_and_8_significant_bits():
    info = ml_dtypes.finfo(ml_dtypes.bfloat16)
    assert float(info.smallest_normal) == float(np.finfo(np.float32).smallest_normal)
    assert info.nmant + 1 == 8 and np.float16(1e-10) == 0
    assert float(np.float32(1e-10).astype(ml_dtypes.bfloat16)) == pytest.approx(1e-10, rel=2**-8)


def test_lesson4_the_scaler_trace_an_injected_and_a_real_overflow():
    history = train(SCALER_TRACE, log=lambda line: None)["history"]
    assert [r["step"] for r in history] == list(range(1, 201))
    assert [(r["step"], r["loss_scale"]) for r in history if r["skipped"]] == [
        (40, 65536.0), (151, 131072.0)]
    changes = [(r["step"], r["loss_scale"]) for a, r in zip(history, history[1:])
               if r["loss_scale"] != a["loss_scale"]]
    assert changes == [(41, 32768.0), (91, 65536.0), (141, 131072.0), (152, 65536.0)]


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def window_with_the_ties_inside(gradients):
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    lowest = math.ceil(math.log2(2.0**-25 / magnitudes.min()))
    highest = math.floor(math.log2(65504 / magnitudes.max()))
    return 2.0**lowest, 2.0**highest


class ScalerThatKeepsCounting(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.loss_scale *= self.backoff_factor  # the count of clean steps goes on
            return
        self.clean_steps += 1
        if self.clean_steps % self.growth_interval == 0:
            self.loss_scale *= self.growth_factor


class ScalerWithoutHysteresis(solutions(4).DynamicLossScaler):
    def __init__(self, init_scale, growth_factor, backoff_factor, growth_interval):
        super().__init__(init_scale, growth_factor, backoff_factor, growth_interval)


class ScalerRefillingEveryStep(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        super().update(found_inf)
        if not found_inf:
            self.tolerated = self.hysteresis


def window_at_the_smallest_subnormal(gradients):
    """lowest asks min|g| S >= 2^-24, where anything above 2^-25 already rounds up to 2^-24."""
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    lowest = math.ceil(math.log2(2.0**-24 / magnitudes.min()))
    highest = math.ceil(math.log2(65520 / magnitudes.max())) - 1
    return 2.0**lowest, 2.0**highest


def window_of_normal_numbers(gradients):
    """lowest keeps every gradient normal (2^-14), as if subnormals were lost."""
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    lowest = math.ceil(math.log2(2.0**-14 / magnitudes.min()))
    highest = math.ceil(math.log2(65520 / magnitudes.max())) - 1
    return 2.0**lowest, 2.0**highest


def window_of_signed_gradients(gradients):
    """Forgets the absolute value: the most negative gradient becomes the 'smallest'."""
    values = gradients[gradients != 0].astype(np.float64)
    lowest = math.floor(math.log2(2.0**-25 / values.min())) + 1
    highest = math.ceil(math.log2(65520 / values.max())) - 1
    return 2.0**lowest, 2.0**highest


def window_with_the_zeros(gradients):
    magnitudes = np.abs(gradients).astype(np.float64)
    with np.errstate(divide="ignore"):
        lowest = math.floor(math.log2(2.0**-25 / magnitudes.min())) + 1
    highest = math.ceil(math.log2(65520 / magnitudes.max())) - 1
    return 2.0**lowest, 2.0**highest


class ScalerGrowingOneStepLate(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.loss_scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps > self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.clean_steps = 0


class ScalerThatNeverResetsAfterGrowth(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.loss_scale *= self.backoff_factor
            self.clean_steps = 0
            return
        self.clean_steps += 1
        if self.clean_steps >= self.growth_interval:
            self.loss_scale *= self.growth_factor


class ScalerRefillingOnBackoff(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        backing_off = found_inf and self.tolerated <= 1
        super().update(found_inf)
        if backing_off:
            self.tolerated = self.hysteresis


class ScalerCountingThroughToleratedOverflows(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.tolerated -= 1
            if self.tolerated <= 0:
                self.loss_scale *= self.backoff_factor
                self.clean_steps = 0  # only a back-off restarts the count
            return
        super().update(False)


class ScalerBackingOffBelowZero(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if found_inf:
            self.clean_steps = 0
            self.tolerated -= 1
            if self.tolerated < 0:  # one overflow too many: hysteresis + 1 before backing off
                self.loss_scale *= self.backoff_factor
            return
        super().update(False)


class ScalerCountingConsecutiveOverflows(solutions(4).DynamicLossScaler):
    def update(self, found_inf):
        if not found_inf:
            self.tolerated = self.hysteresis  # a clean step forgives the overflows before it
        super().update(found_inf)
        if found_inf and self.tolerated <= 0:
            self.tolerated = self.hysteresis


WRONG = {
    "check_scale_window": [
        Wrong(window_with_the_ties_inside, "ties to even"),
        Wrong(window_at_the_smallest_subnormal, "above 2^-25"),
        Wrong(window_of_normal_numbers, "subnormal"),
        Wrong(window_of_signed_gradients, "negative"),
        Wrong(window_with_the_zeros, "leave the zeros out"),
    ],
    "check_dynamic_scaler": [
        Wrong(ScalerThatKeepsCounting, "restart the count"),
        Wrong(ScalerGrowingOneStepLate, "not the one after"),
        Wrong(ScalerThatNeverResetsAfterGrowth, "reset the count to 0"),
    ],
    "check_hysteresis": [
        Wrong(ScalerRefillingEveryStep, "not after each clean step"),
        Wrong(ScalerWithoutHysteresis, "hysteresis"),
        Wrong(ScalerRefillingOnBackoff, "only growth refills"),
        Wrong(ScalerCountingThroughToleratedOverflows, "tolerated or not"),
        Wrong(ScalerBackingOffBelowZero, "reaches 0"),
        Wrong(ScalerCountingConsecutiveOverflows, "refill"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(4, WRONG)
