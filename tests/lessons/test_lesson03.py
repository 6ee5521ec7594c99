"""Lesson 3 (mixed precision): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/03_mixed_precision.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
from exercising import Wrong, exercise_tests

from minimp import Tensor, nn
from minimp import functional as F
from minimp.data import load_digits
from minimp.tensor import saved_bytes

f16 = np.float16


def lesson3_mlp(dtype):
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(64, 256, rng=rng), nn.ReLU(), nn.Linear(256, 256, rng=rng),
                         nn.ReLU(), nn.Linear(256, 10, rng=rng)).to(dtype)


def test_lesson3_bytes_kept_for_backward_and_why_not_exactly_half():
    digits = load_digits()
    kept = {}
    for dtype in (np.float32, f16):
        net = lesson3_mlp(dtype)
        loss = F.cross_entropy(net(Tensor(digits.train_images[:128].astype(dtype))),
                               digits.train_labels[:128])
        kept[dtype] = saved_bytes(loss, exclude=[p.data for p in net.parameters()])
    assert (kept[np.float32], kept[f16]) == (301_056, 151_040)
    targets = 128 * np.dtype(digits.train_labels.dtype).itemsize
    assert targets == 1024 and kept[np.float32] - targets == 2 * (kept[f16] - targets)


def test_lesson3_model_to_casts_in_place_so_a_sequential_of_its_layers_is_no_copy():
    model = lesson3_mlp(np.float32)
    nn.Sequential(*[layer for layer in model]).to(f16)
    assert model[0].weight.dtype == f16


def test_lesson3_the_update_of_2_to_the_minus_12_at_1_is_a_tie_to_even():
    assert float(np.spacing(f16(1 - 2.0**-11))) == 2.0**-11  # below 1.0 the gap is 2^-11 ...
    assert float(np.spacing(f16(1))) == 2.0**-10
    assert float(f16(1 - 2.0**-12)) == 1.0  # ... so 1 - 2^-12 is halfway, and goes to 1.0
    assert np.array(1.0, f16).view(np.uint16) & 0x3FF == 0  # 1.0's mantissa: all 0
    assert np.array(1 - 2.0**-11, f16).view(np.uint16) & 0x3FF == 0x3FF  # the other's: all 1


def test_lesson3_the_copy_of_the_master_moves_from_the_second_update():
    master, copies = np.float32(1.0), []
    for _ in range(1000):
        master = np.float32(master - np.float32(2.0**-12))
        copies.append(float(f16(master)))
    assert copies[0] == 1.0 and copies[1] < 1.0
    assert float(master) == 0.755859375 == copies[-1] == 1 - 1000 * 2.0**-12


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


WRONG = {
    "check_activation_bytes": [
        Wrong(activation_bytes_with_the_output, ""),
    ],
    "check_sgd_step": [
        Wrong(sgd_step_on_the_copies, ""),
        Wrong(sgd_step_without_skipping, ""),
    ],
    "check_stochastic_round": [
        Wrong(round_to_nearest, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(3, WRONG)
