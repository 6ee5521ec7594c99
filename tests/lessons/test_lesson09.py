"""Lesson 9 (myths): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/09_myths.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import distributed as dist
from minimp.lessons import lesson09
from minimp.parallel import split_stages, stage_parameters
from minimp.train import TrainConfig

f16 = np.float16


def test_lesson9_float16_against_float32_bits_range_and_a_summed_dot_product():
    assert np.finfo(f16).nmant + 1 == 11 and np.finfo(np.float32).nmant + 1 == 24
    assert f"{float(np.finfo(f16).max):.6g}" == "65504"
    assert f"{float(np.finfo(np.float32).max):.6g}" == "3.40282e+38"
    rng = np.random.default_rng(lesson09.DOT_SEED)
    a, b = rng.standard_normal(lesson09.DOT_LENGTH), rng.standard_normal(lesson09.DOT_LENGTH)
    errors = []
    for dtype in (f16, np.float32):
        total = dtype(0)
        for x, y in zip(a.astype(dtype), b.astype(dtype)):
            total = dtype(total + dtype(x * y))
        errors.append(f"{abs(float(total) - float(a @ b)):.2e}")
    assert errors == ["2.22e-01", "9.36e-05"]


def test_lesson9_a_replica_holds_what_one_process_holds_plus_its_buffers_and_sends_1_5_gradients():
    parameters = sum(p.size for p in lesson09.build().parameters())
    assert parameters == 59_146
    (single, sent_alone), = dist.simulate(1, lesson09.one_step)
    assert list(single.values()) == [2 * parameters, 4 * parameters, 8 * parameters, 0]
    assert sent_alone == 0
    assert 8 * parameters / (2 * parameters) == 4 and (4 + 8) / 2 == 6  # the optimizer: 6x
    results = dist.simulate(lesson09.REPLICAS, lesson09.one_step)
    for held, _ in results:
        assert list(held.values()) == list(single.values())[:3] + [2 * 4 * parameters]
    sent = [s for _, s in results]
    assert sent[1] == 1.5 * 4 * parameters  # replica 1, printed
    assert sent == [354_872, 354_876, 354_880, 354_876]  # the others within a float32 element


def test_lesson9_what_dp_and_pp_send_and_hold():
    model = lesson09.build()
    bounds = split_stages(model.layers, lesson09.REPLICAS)
    per_stage = [sum(p.size for _, p in stage_parameters(model, b)) for b in bounds]
    assert per_stage == [8320, 16512, 16512, 17802] and sum(per_stage) == 59_146
    assert np.mean(lesson09.training_bytes_per_step(dp=4)) == 1.5 * 4 * 59_146
    config = TrainConfig(pp=4)
    assert (config.batch_size, config.hidden, config.precision) == (64, 128, "fp16")
    cut = 64 * 128 * 2  # the batch's activations, float16, one way across one cut
    assert cut == 16_384
    assert lesson09.training_bytes_per_step(pp=4) == [cut, 2 * cut, 2 * cut, cut]


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def zero3_keeping_the_weights(stage, p):
    return solutions(9).zero_bytes_per_parameter(min(stage, 2), p)


def zero1_sharding_the_gradients_too(stage, p):
    return solutions(9).zero_bytes_per_parameter(min(stage + 1, 3) if stage else 0, p)


def zero_with_float32_gradients(stage, p):
    return solutions(9).zero_bytes_per_parameter(stage, p) + (2.0 / p if stage >= 2 else 2.0)


def dp_bytes_of_the_naive_algorithm(parameters, p, itemsize):
    return 2 * parameters * itemsize


def dp_bytes_of_the_reduce_scatter_only(parameters, p, itemsize):
    return (p - 1) / p * parameters * itemsize


def dp_bytes_always_float32(parameters, p, itemsize):
    return 2 * (p - 1) / p * parameters * 4


def zero_sharding_only_each_stages_own_part(stage, p):
    """ZeRO-2 shards the gradients but keeps the whole optimizer state again, and so on."""
    parts = [2.0, 2.0, 12.0]  # weights, gradients, optimizer state
    if stage:
        parts[3 - stage] /= p
    return sum(parts)


def zero_forgetting_the_float32_master(stage, p):
    """Adam's two moments (8 bytes) counted as the whole optimizer state."""
    return solutions(9).zero_bytes_per_parameter(stage, p) - (12.0 - 8.0) / (p if stage else 1)


def dp_bytes_in_whole_bytes(parameters, p, itemsize):
    return 2 * (p - 1) * parameters * itemsize // p


def pp_bytes_both_ways_everywhere(stage, stages, batch, width, itemsize):
    return 2 * batch * width * itemsize


def pp_bytes_forward_only(stage, stages, batch, width, itemsize):
    return batch * width * itemsize if stage < stages - 1 else 0


WRONG = {
    "check_zero_bytes_per_parameter": [
        Wrong(zero3_keeping_the_weights, "ZeRO-3"),
        Wrong(zero1_sharding_the_gradients_too, "ZeRO-1 splits the 12"),
        Wrong(zero_with_float32_gradients, "2 of float16 gradient"),
        Wrong(zero_sharding_only_each_stages_own_part, "ZeRO-2 the gradient too"),
        Wrong(zero_forgetting_the_float32_master, "master"),
    ],
    "check_dp_bytes_sent": [
        Wrong(dp_bytes_of_the_naive_algorithm, "2(p - 1) chunks"),
        Wrong(dp_bytes_of_the_reduce_scatter_only, "all-gather"),
        Wrong(dp_bytes_always_float32, "itemsize"),
        Wrong(dp_bytes_in_whole_bytes, "whole number"),
    ],
    "check_pp_bytes_sent": [
        Wrong(pp_bytes_both_ways_everywhere, "unless it is the last"),
        Wrong(pp_bytes_forward_only, "gradient back"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(9, WRONG)
