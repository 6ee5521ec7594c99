"""Lesson 7 (pipelines): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/07_model_parallel.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp.lessons import lesson07, timelines
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
    for M in lesson07.MEMORY_MICRO_BATCHES:
        assert [peak_activations(a) for a in gpipe(4, M)] == [M] * 4
        assert [peak_activations(a) for a in one_f_one_b(4, M)] == [4, 3, 2, 1]


def test_lesson7_the_printed_replay_agrees_with_the_formula():
    P, M, forward, backward = lesson07.REPLAYED
    for name in ("gpipe", "1f1b"):
        schedule = build_schedule(name, P, M)
        step = (M + P - 1) * (forward + backward)
        assert timelines.replay(schedule, forward, backward)[0] == step
        assert round(timelines.replayed_bubble(schedule, forward, backward), 3) == 0.273
    assert round(costmodel.pipeline_bubble_fraction(P, M), 3) == 0.273


def stage_times(draw, P):
    """t_f and t_b per stage, from 0.05 to 20 (ratios up to 400 between stages)."""
    times = st.lists(st.floats(0.05, 20.0), min_size=P, max_size=P)
    return draw(times), draw(times)


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 8))
def test_lesson7_in_gpipe_unequal_stages_never_shrink_the_bubble(data, P, M):
    """step >= C + (M - 1) c_s for every stage s: their mean is (M + P - 1) C / P."""
    forward, backward = stage_times(data.draw, P)
    formula = costmodel.pipeline_bubble_fraction(P, M)
    assert timelines.replayed_bubble(gpipe(P, M), forward, backward) >= formula - 1e-12


@settings(max_examples=200, deadline=None)
@given(st.data(), st.integers(1, 5), st.integers(1, 8))
def test_lesson7_a_last_stage_at_least_as_slow_as_the_mean_never_shrinks_the_bubble(data, P, M):
    """step >= C + (M - 1) c_{P-1} in any schedule, and c_{P-1} >= C / P."""
    forward, backward = stage_times(data.draw, P)
    last, others = forward[-1] + backward[-1], sum(forward[:-1] + backward[:-1])
    # the last stage at least as slow as the mean of the others (then also as slow as the mean)
    scale = max(1.0, others / max(P - 1, 1) / last)
    forward[-1], backward[-1] = forward[-1] * scale, backward[-1] * scale
    assert forward[-1] + backward[-1] >= sum(forward + backward) / P * (1 - 1e-12)
    formula = costmodel.pipeline_bubble_fraction(P, M)
    for schedule in (gpipe(P, M), one_f_one_b(P, M)):
        assert timelines.replayed_bubble(schedule, forward, backward) >= formula - 1e-12


def test_lesson7_a_slower_first_stage_shrinks_1f1b_bubble_not_gpipes():
    P, M, forward, backward = lesson07.SLOW_FIRST
    assert [f + b for f, b in zip(forward, backward)] == [4.0, 3.0]
    assert round(costmodel.pipeline_bubble_fraction(P, M), 3) == 0.333
    assert round(timelines.replayed_bubble(gpipe(P, M), forward, backward), 3) == 0.364
    assert round(timelines.replayed_bubble(one_f_one_b(P, M), forward, backward), 3) == 0.300


def test_lesson7_the_split_of_the_timeline_model():
    model = build_model(64, 10, 512, 8, np.random.default_rng(0))
    stages = split_stages(model.layers, 2)
    shapes = [[tuple(p.shape) for layer in model.layers[a:b] for p in layer.parameters()
               if p.ndim == 2] for a, b in stages]
    assert shapes == [[(512, 64)] + [(512, 512)] * 3, [(512, 512)] * 4 + [(10, 512)]]


@pytest.mark.mpi
def test_lesson7_the_replayed_and_measured_bubbles_are_larger_than_the_formula():
    """The notebook's recorded runs: both bubbles above the formula's 0.20 in every run."""
    formula = costmodel.pipeline_bubble_fraction(*lesson07.MEASURED)
    assert round(formula, 2) == 0.20
    for name in ("gpipe", "1f1b"):
        timeline = timelines.measure(*lesson07.MEASURED, name)
        forward, backward = timelines.compute_times(timeline)
        schedule = build_schedule(name, *lesson07.MEASURED)
        assert timelines.replayed_bubble(schedule, forward, backward) >= formula - 1e-12
        assert timelines.bubble(timeline) > formula
        assert timeline["peak_stored_micro_batches"] == ([4, 4] if name == "gpipe" else [2, 1])


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def step_time_without_the_drain(P, M, t_forward, t_backward):
    return (P - 1) * t_forward + M * (t_forward + t_backward)


def step_time_without_the_fill(P, M, t_forward, t_backward):
    return M * (t_forward + t_backward) + (P - 1) * t_backward


def step_time_one_slot_too_many(P, M, t_forward, t_backward):
    return (M + P) * (t_forward + t_backward)


def gpipe_compute(P, M):
    return [[a for a in actions if a.op in ("forward", "backward")] for actions in gpipe(P, M)]


def one_f_one_b_compute_warmup_one_too_long(P, M):
    """A warm-up of P - s forwards: the last stage, too, runs two forwards before its backward."""
    schedule = []
    for stage in range(P):
        warmup = min(P - stage, M)
        actions = [Action("forward", mb) for mb in range(warmup)]
        for mb in range(M - warmup):
            actions += [Action("forward", warmup + mb), Action("backward", mb)]
        schedule.append(actions + [Action("backward", mb) for mb in range(M - warmup, M)])
    return schedule


def one_f_one_b_compute_warmup_not_capped_at_m(P, M):
    """A warm-up of P - s - 1 forwards even when there are fewer micro-batches."""
    schedule = []
    for stage in range(P):
        warmup = P - stage - 1
        actions = [Action("forward", mb) for mb in range(warmup)]
        for mb in range(M - warmup):
            actions += [Action("forward", warmup + mb), Action("backward", mb)]
        schedule.append(actions + [Action("backward", mb) for mb in range(M - warmup, M)])
    return schedule


def one_f_one_b_without_the_first_steady_receive(P, M):
    """Forgets that stage s > 0 receives the steady state's first activation before its forward."""
    schedule = []
    for stage, actions in enumerate(solutions(7).one_f_one_b(P, M)):
        warmup = min(P - stage - 1, M)
        schedule.append([a for a in actions
                         if not (a.op == "recv_forward" and a.micro_batch == warmup)])
    return schedule


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


def one_f_one_b_compute_cool_down_reversed(P, M):
    """The cool-down's backwards last micro-batch first, as GPipe runs them."""
    schedule = []
    for stage, actions in enumerate(solutions(7).one_f_one_b_compute(P, M)):
        cool_down = len(actions) - min(P - stage - 1, M)
        schedule.append(actions[:cool_down] + actions[cool_down:][::-1])
    return schedule


def one_f_one_b_compute_same_warmup_everywhere(P, M):
    """Every stage warms up with the first stage's P - 1 forwards."""
    schedule = []
    for _ in range(P):
        warmup = min(P - 1, M)
        actions = [Action("forward", mb) for mb in range(warmup)]
        for mb in range(M - warmup):
            actions += [Action("forward", warmup + mb), Action("backward", mb)]
        schedule.append(actions + [Action("backward", mb) for mb in range(M - warmup, M)])
    return schedule


def one_f_one_b_receiving_the_wrong_micro_batch(P, M):
    """send_backward_recv_forward(k) receives micro-batch k again instead of the next forward's."""
    return [[Action(a.op, a.micro_batch, received=a.micro_batch)
             if a.op == "send_backward_recv_forward" else a for a in actions]
            for actions in solutions(7).one_f_one_b(P, M)]


WRONG = {
    "check_step_time": [
        Wrong(step_time_without_the_drain, "drain"),
        Wrong(step_time_without_the_fill, "fill"),
        Wrong(step_time_one_slot_too_many, "P - 1"),
    ],
    "check_one_f_one_b_compute": [
        Wrong(gpipe_compute, "GPipe"),
        Wrong(one_f_one_b_compute_warmup_one_too_long, "warm-up"),
        Wrong(one_f_one_b_compute_warmup_not_capped_at_m, "min(P - s - 1, M)"),
        Wrong(one_f_one_b_compute_cool_down_reversed, "too late"),
        Wrong(one_f_one_b_compute_same_warmup_everywhere, "P - s"),
    ],
    "check_one_f_one_b": [
        Wrong(one_f_one_b_unpaired, "pair them"),
        Wrong(lambda: gpipe, "warm-up", factory=True),
        Wrong(one_f_one_b_without_the_first_steady_receive, "recv_forward"),
        Wrong(one_f_one_b_receiving_the_wrong_micro_batch, "recv_forward"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(7, WRONG)
