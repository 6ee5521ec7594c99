"""Lesson 3 (mixed precision): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/03_mixed_precision.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
from exercising import Wrong, exercise_tests

from minimp import nn
from minimp.data import load_digits
from minimp.lessons import lesson03 as lesson

f16 = np.float16


def test_lesson3_bytes_kept_for_backward_and_why_not_exactly_half():
    digits = load_digits()
    images, labels = digits.train_images[:lesson.BATCH], digits.train_labels[:lesson.BATCH]
    kept = {dtype: lesson.kept_bytes(dtype, images, labels) for dtype in (np.float32, f16)}
    assert (kept[np.float32], kept[f16]) == (301_056, 151_040)
    assert round(kept[f16] / kept[np.float32], 3) == 0.502
    targets = lesson.BATCH * labels.dtype.itemsize
    assert targets == 1024 and labels.dtype == np.int64
    # x, the two ReLU outputs and the logits, each BATCH rows, in the model's dtype; plus targets
    for dtype, count in kept.items():
        assert count == lesson.BATCH * (64 + 256 + 256 + 10) * np.dtype(dtype).itemsize + targets
    assert kept[np.float32] - targets == 2 * (kept[f16] - targets)


def test_lesson3_model_to_casts_in_place_so_a_sequential_of_its_layers_is_no_copy():
    model = lesson.mlp(np.random.default_rng(0))
    nn.Sequential(*[layer for layer in model]).to(f16)
    assert model[0].weight.dtype == f16


def test_lesson3_a_float32_parameter_is_its_own_master_until_the_model_is_cast():
    from minimp import optim

    model = lesson.mlp(np.random.default_rng(0))
    optimizer = optim.Adam(model.parameters(), lr=1e-3)
    first = model[0].weight.data
    assert optimizer.master_weights[0] is first
    model.to(f16)
    assert model[0].weight.dtype == f16 and optimizer.master_weights[0] is first


def test_lesson3_the_update_of_2_to_the_minus_12_at_1_is_a_tie_to_even():
    assert float(np.spacing(f16(1 - 2.0**-11))) == 2.0**-11  # below 1.0 the gap is 2^-11 ...
    assert float(np.spacing(f16(1))) == 2.0**-10
    assert lesson.UPDATE == 2.0**-12
    assert float(f16(1 - lesson.UPDATE)) == 1.0  # ... so 1 - 2^-12 is halfway, and goes to 1.0
    assert np.array(1.0, f16).view(np.uint16) & 0x3FF == 0  # 1.0's mantissa: all 0
    assert np.array(1 - 2.0**-11, f16).view(np.uint16) & 0x3FF == 0x3FF  # the other's: all 1


def test_lesson3_the_copy_of_the_master_first_moves_at_the_second_update():
    master, weight, copies, weights = np.float32(1.0), f16(1.0), [], []
    for _ in range(lesson.UPDATES):
        master = np.float32(master - np.float32(lesson.UPDATE))
        weight = f16(weight - f16(lesson.UPDATE))
        copies.append(float(f16(master)))
        weights.append(float(weight))
    assert copies[0] == 1.0 and copies[1] < 1.0 and set(weights) == {1.0}
    assert float(master) == 0.755859375 == copies[-1] == 1 - 1000 * 2.0**-12
    # the master takes every update exactly: 1 - k 2^-12 = (4096 - k) / 4096, 12 bits at most
    assert all(abs(c - (1 - k * 2.0**-12)) <= 2.0**-12 for k, c in enumerate(copies, start=1))


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def activation_bytes_with_the_output(batch, widths, itemsize):
    return batch * sum(widths) * itemsize


def sgd_step_on_the_copies(params, grads, masters, lr, loss_scale):
    if not all(np.isfinite(g).all() for g in grads):
        return True
    for param, grad, master in zip(params, grads, masters):
        param -= np.float16(lr) * (grad / np.float16(loss_scale))  # no master involved
        master[...] = param
    return False


def sgd_step_without_skipping(params, grads, masters, lr, loss_scale):
    for param, grad, master in zip(params, grads, masters):
        master -= np.float32(lr) * grad.astype(np.float32) / np.float32(loss_scale)
        param[...] = master.astype(np.float16)
    return False


def round_to_nearest(x, rng):
    return x.astype(np.float16)


def activation_bytes_without_the_input(batch, widths, itemsize):
    return batch * sum(widths[1:-1]) * itemsize


def activation_bytes_counting_relu_twice(batch, widths, itemsize):
    return batch * (widths[0] + 2 * sum(widths[1:-1])) * itemsize


def sgd_step_unscaling_in_float16(params, grads, masters, lr, loss_scale):
    if not all(np.isfinite(g).all() for g in grads):
        return True
    for param, grad, master in zip(params, grads, masters):
        master -= np.float32(lr) * (grad / np.float16(loss_scale)).astype(np.float32)
        param[...] = master.astype(np.float16)
    return False


def sgd_step_replacing_the_arrays(params, grads, masters, lr, loss_scale):
    if not all(np.isfinite(g).all() for g in grads):
        return True
    for i, grad in enumerate(grads):
        masters[i] = masters[i] - np.float32(lr) * grad.astype(np.float32) / np.float32(loss_scale)
        params[i] = masters[i].astype(np.float16)  # new arrays: the model's are left as they were
    return False


def round_always_down(x, rng):
    nearest = x.astype(np.float16)
    lower = np.nextafter(nearest, np.float16(-np.inf))
    return np.where(nearest.astype(np.float32) > x, lower, nearest)


def round_up_with_the_reversed_probability(x, rng):
    nearest = x.astype(np.float16)
    below = np.where(nearest.astype(np.float32) > x,
                     np.nextafter(nearest, np.float16(-np.inf)), nearest)
    above = np.nextafter(below, np.float16(np.inf))
    gap = above.astype(np.float32) - below.astype(np.float32)
    up = rng.random(x.shape) < (above.astype(np.float32) - x) / gap
    return np.where(up & (below.astype(np.float32) != x), above, below)


def round_with_numpys_global_generator(x, rng):
    nearest = x.astype(np.float16)
    below = np.where(nearest.astype(np.float32) > x,
                     np.nextafter(nearest, np.float16(-np.inf)), nearest)
    above = np.nextafter(below, np.float16(np.inf))
    gap = above.astype(np.float32) - below.astype(np.float32)
    up = np.random.random(x.shape) < (x - below.astype(np.float32)) / gap  # not rng
    return np.where(up, above, below)


WRONG = {
    "check_activation_bytes": [
        Wrong(activation_bytes_with_the_output, "last output"),
        Wrong(activation_bytes_without_the_input, "keeps its input"),
        Wrong(activation_bytes_counting_relu_twice, "counted once"),
    ],
    "check_sgd_step": [
        Wrong(sgd_step_on_the_copies, "master"),
        Wrong(sgd_step_without_skipping, "skip"),
        Wrong(sgd_step_unscaling_in_float16, "float32"),
        Wrong(sgd_step_replacing_the_arrays, "in place"),
    ],
    "check_stochastic_round": [
        Wrong(round_to_nearest, "nearest"),
        Wrong(round_always_down, "always down"),
        Wrong(round_up_with_the_reversed_probability, "(x - below) / (above - below)"),
        Wrong(round_with_numpys_global_generator, "np.random"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(3, WRONG)
