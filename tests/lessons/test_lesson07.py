"""Lesson 7 (pipelines): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/07_model_parallel.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions
from hypothesis import given
from hypothesis import strategies as st

from minimp.lessons import timelines
from minimp.measure import costmodel
from minimp.parallel import (
    Action,
    gpipe,
    one_f_one_b,
    peak_activations,
    split_stages,
)
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.train import build_model

f16 = np.float16



@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_lesson7_the_step_takes_m_plus_p_minus_1_slots_for_both_schedules(name):
    for P in range(1, 7):
        for M in range(1, 9):
            for forward, backward in ((1.0, 2.0), (1.0, 1.0), (2.0, 1.0)):
                step, busy = timelines.replay(build_schedule(name, P, M), forward, backward)
                assert step == pytest.approx((M + P - 1) * (forward + backward))
                assert all(b == pytest.approx(M * (forward + backward)) for b in busy)


def test_lesson7_peak_activations_gpipe_m_1f1b_p_minus_stage():
    for M in (4, 8, 16):
        assert [peak_activations(a) for a in gpipe(4, M)] == [M] * 4
        assert [peak_activations(a) for a in one_f_one_b(4, M)] == [4, 3, 2, 1]


@given(st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4), st.integers(1, 8))
def test_lesson7_two_stages_the_last_slower_both_ways_only_add_to_the_bubble(times, M):
    """(Not for any unequal stages: a slower first stage can shrink the bubble.)"""
    forward, backward = sorted(times[:2]), sorted(times[2:])
    formula = costmodel.pipeline_bubble_fraction(2, M)
    for schedule in (gpipe(2, M), one_f_one_b(2, M)):
        assert timelines.replayed_bubble(schedule, forward, backward) >= formula - 1e-12


def test_lesson7_a_slower_first_stage_can_shrink_the_bubble():
    bubble = timelines.replayed_bubble(one_f_one_b(2, 2), [1.0, 1.0], [3.0, 2.0])
    assert bubble < costmodel.pipeline_bubble_fraction(2, 2)


def test_lesson7_the_split_of_the_timeline_model():
    model = build_model(64, 10, 512, 8, np.random.default_rng(0))
    stages = split_stages(model.layers, 2)
    shapes = [[tuple(p.shape) for layer in model.layers[a:b] for p in layer.parameters()
               if p.ndim == 2] for a, b in stages]
    assert shapes == [[(512, 64)] + [(512, 512)] * 3, [(512, 512)] * 4 + [(10, 512)]]


@pytest.mark.mpi
def test_lesson7_the_measured_bubble_is_larger_than_the_formula():
    timeline = timelines.measure(2, 4, "gpipe")
    forward, backward = timelines.compute_times(timeline)
    formula = costmodel.pipeline_bubble_fraction(2, 4)
    assert timelines.replayed_bubble(gpipe(2, 4), forward, backward) >= formula
    assert timelines.bubble(timeline) > formula


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def step_time_without_the_drain(P, M, t_forward, t_backward):
    return (P - 1) * t_forward + M * (t_forward + t_backward)


def gpipe_compute(P, M):
    return [[a for a in actions if a.op in ("forward", "backward")] for actions in gpipe(P, M)]


def one_f_one_b_unpaired(P, M):
    """1F1B whose steady-state exchanges are a send, then a receive: every send waits for its
    receiver, and neighbours both send at once."""
    schedule = []
    for actions in solutions(7).one_f_one_b(P, M):
        plain = []
        for a in actions:
            if a.op == "send_forward_recv_backward":
                plain += [Action("send_forward", a.micro_batch)]
                plain += [Action("recv_backward", a.received)]
            elif a.op == "send_backward_recv_forward":
                plain += [Action("send_backward", a.micro_batch)]
                plain += [Action("recv_forward", a.received)]
            else:
                plain.append(a)
        schedule.append(plain)
    return schedule


WRONG = {
    "check_step_time": [
        Wrong(step_time_without_the_drain, ""),
    ],
    "check_one_f_one_b_compute": [
        Wrong(gpipe_compute, ""),
    ],
    "check_one_f_one_b": [
        Wrong(one_f_one_b_unpaired, ""),
        Wrong(lambda: gpipe, "", factory=True),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(7, WRONG)
