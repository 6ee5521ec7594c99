"""Lesson 4 (loss scaling): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/04_loss_scaling.ipynb became false, or a checker passes a wrong answer."""

import math

import ml_dtypes
import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import DynamicLossScaler, Tensor, mixed_precision_step, nn, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_digits
from minimp.precision import NoLossScaler
from minimp.train import TrainConfig, train

f16 = np.float16


def lesson4_mlp():
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(64, 128, rng=rng), nn.ReLU(), nn.Linear(128, 128, rng=rng),
                         nn.ReLU(), nn.Linear(128, 10, rng=rng))


def activation_gradients(loss_factor):
    digits, model = load_digits(), lesson4_mlp()
    inputs, outputs, h = [], [], Tensor(digits.train_images[:256])
    for layer in model:
        leaf = Tensor(h.data, requires_grad=True)
        h = layer(leaf)
        inputs.append(leaf)
        outputs.append(h)
    (F.cross_entropy(h, digits.train_labels[:256]) * loss_factor).backward()
    for i in range(len(model) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    grads = np.concatenate([leaf.grad.ravel() for leaf in inputs[1:]])
    return np.abs(grads[grads != 0])


def test_lesson4_where_float16_puts_the_activation_gradients():
    plain, tiny = activation_gradients(1.0), activation_gradients(2.0**-16)
    stored = plain.astype(f16)
    assert 0 < np.mean(stored == 0) < 0.0005  # "a few (0.011%)"
    assert np.mean((stored > 0) & (stored < 2**-14)) > 1 / 3  # "more than a third"
    assert plain.max() < 2.0**-10  # "none reaches 2^-10"
    assert np.all(tiny.astype(f16) == 0)  # "every one of them becomes zero"
    scaled = (plain * 2.0**16).astype(f16)
    assert np.all(scaled >= 2**-14) and plain.max() * 2.0**16 < 2.0**6  # normal, room below 65504
    assert np.array_equal(tiny * 2.0**16, plain)  # the divided loss, scaled: the plain one exactly


def lesson4_train(dtype, scaler, make_optimizer, loss_factor=2.0**-16, steps=120):
    digits, model = load_digits(), lesson4_mlp()
    optimizer = make_optimizer(model.parameters())
    model.to(dtype)
    images, labels, losses = digits.train_images.astype(dtype), digits.train_labels, []
    with np.errstate(over="ignore"), limit_cpu_threads(1):
        for step in range(steps):
            rows = np.random.default_rng([0, step]).choice(len(labels), 256, replace=False)
            loss = F.cross_entropy(model(Tensor(images[rows])), labels[rows])
            losses.append(loss.item())
            scaler.scale(loss * loss_factor).backward()
            mixed_precision_step(optimizer, scaler)
    return losses[0], float(np.mean(losses[-10:]))


def test_lesson4_adam_three_curves_together_one_flat_and_eps_costs_a_little():
    def adam(parameters):
        return optim.Adam(parameters, lr=1e-3)

    fp32 = lesson4_train(np.float32, NoLossScaler(), adam)[1]
    first, unscaled = lesson4_train(f16, NoLossScaler(), adam)
    assert unscaled > 0.95 * first  # learns nothing
    assert lesson4_train(f16, DynamicLossScaler(), adam)[1] == pytest.approx(fp32, abs=0.01)
    bf16 = lesson4_train(ml_dtypes.bfloat16, NoLossScaler(), adam)[1]
    assert bf16 == pytest.approx(fp32, abs=0.01)
    plain = lesson4_train(np.float32, NoLossScaler(), adam, loss_factor=1.0)[1]
    assert plain < fp32 - 0.05  # "the division is not quite free" (0.168 against 0.256)


def test_lesson4_sgd_needs_lr_times_2_to_the_16_then_the_scaler_matches_fp32():
    def sgd(lr):
        return lambda parameters: optim.SGD(parameters, lr=lr, momentum=0.9)

    first, same_lr = lesson4_train(np.float32, NoLossScaler(), sgd(0.1), steps=60)
    assert same_lr > 0.95 * first  # does not learn at all
    fp32 = lesson4_train(np.float32, NoLossScaler(), sgd(0.1 * 2**16), steps=60)[1]
    assert fp32 < 0.5
    first, unscaled = lesson4_train(f16, NoLossScaler(), sgd(0.1 * 2**16), steps=60)
    assert unscaled > first  # "ends above where it started"
    scaled = lesson4_train(f16, DynamicLossScaler(), sgd(0.1 * 2**16), steps=60)[1]
    assert scaled == pytest.approx(fp32, abs=0.01)


def weight_gradients(dtype, loss_factor):
    digits, model = load_digits(), lesson4_mlp()
    model.to(dtype)
    rows = np.random.default_rng([0, 0]).choice(len(digits.train_labels), 256, replace=False)
    logits = model(Tensor(digits.train_images[rows].astype(dtype)))
    (F.cross_entropy(logits, digits.train_labels[rows]) * loss_factor).backward()
    return np.concatenate([p.grad.ravel() for p in model.parameters()])


def test_lesson4_almost_every_gradient_flushes_and_adams_sqrt_v_comes_near_eps():
    assert np.mean(weight_gradients(f16, 2.0**-16) == 0) > 0.95
    magnitudes = np.abs(weight_gradients(np.float32, 2.0**-16))
    assert np.median(magnitudes[magnitudes > 0]) < 100 * 1e-8  # Adam's eps


def test_lesson4_sgd_with_lr_times_2_to_the_16_on_the_loss_over_2_to_the_16_takes_the_same_steps():
    def run(lr, loss_factor):
        model, digits = lesson4_mlp(), load_digits()
        optimizer, losses = optim.SGD(model.parameters(), lr=lr, momentum=0.9), []
        for step in range(5):
            rows = np.random.default_rng([0, step]).choice(len(digits.train_labels), 256, False)
            logits = model(Tensor(digits.train_images[rows]))
            loss = F.cross_entropy(logits, digits.train_labels[rows])
            losses.append(loss.item())
            (loss * loss_factor).backward()
            mixed_precision_step(optimizer, NoLossScaler())
        return losses

    assert run(0.1, 1.0) == run(0.1 * 2**16, 2.0**-16)


def test_lesson4_the_scaler_trace_an_injected_and_a_real_overflow():
    config = TrainConfig(steps=200, loss_scale_growth_interval=50, inject_overflow="40:0",
                         log_every=1000, threads=1)
    history = train(config, log=lambda line: None)["history"]
    assert [(r["step"], r["loss_scale"]) for r in history if r["skipped"]] == [
        (40, 65536.0), (151, 131072.0)]
    grown = [r["step"] for a, r in zip(history, history[1:]) if r["loss_scale"] > a["loss_scale"]]
    assert grown == [91, 141] and history[41]["loss_scale"] == 32768.0
    assert history[-1]["loss_scale"] == 65536.0


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


WRONG = {
    "check_scale_window": [
        Wrong(window_with_the_ties_inside, ""),
    ],
    "check_dynamic_scaler": [
        Wrong(ScalerThatKeepsCounting, ""),
    ],
    "check_hysteresis": [
        Wrong(ScalerRefillingEveryStep, ""),
        Wrong(ScalerWithoutHysteresis, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(4, WRONG)
