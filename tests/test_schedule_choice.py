"""The schedules by name: each one valid with buffered sends at every size tried; GPipe and
1F1B valid with sends that wait for their receives too, the interleaved and zero-bubble
schedules not (which is why the runner buffers their sends); sizes a schedule cannot run are
named."""

import pytest

from minimp.parallel.pipeline.schedules.dependencies import check_schedule
from minimp.parallel.pipeline.schedules import CHOICES, build_schedule, schedule_problem
from minimp.parallel.pipeline.simulator import Costs, simulate_schedule

SIZES = [(2, 2, 1), (2, 4, 1), (4, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (2, 6, 3), (3, 9, 2)]


def runnable(name):
    return [(p, m, v) for p, m, v in SIZES if not schedule_problem(name, p, m, v)]


@pytest.mark.parametrize("name", CHOICES)
def test_every_schedule_is_valid_with_buffered_sends(name):
    assert runnable(name)
    for stages, micro_batches, chunks in runnable(name):
        schedule = build_schedule(name, stages, micro_batches, chunks)
        assert check_schedule(schedule, micro_batches, chunks) == [], (stages, micro_batches)


@pytest.mark.parametrize("name", CHOICES)
def test_only_the_schedules_the_runner_buffers_deadlock_on_waiting_sends(name):
    deadlocks = []
    for stages, micro_batches, chunks in runnable(name):
        schedule = build_schedule(name, stages, micro_batches, chunks)
        problems = check_schedule(schedule, micro_batches, chunks, rendezvous=True)
        deadlocks.append(any(problem.startswith("deadlock") for problem in problems))
    assert any(deadlocks) == CHOICES[name].buffered_sends, deadlocks


def test_sizes_a_schedule_cannot_run_are_named():
    problem = schedule_problem("interleaved", 2, 3, 2)
    assert problem.endswith("--micro-batches 3 is not a multiple of 2")
    assert "--pp 2 or more" in schedule_problem("interleaved", 1, 4, 2)
    assert schedule_problem("1f1b", 2, 4, 2) == "--virtual-stages 2 needs --schedule interleaved"
    assert schedule_problem("zb-h1", 2, 4, 0).startswith("--virtual-stages must be 1 or more")
    assert schedule_problem("zigzag", 2, 4, 1).startswith("unknown schedule 'zigzag'")
    assert all(schedule_problem(name, 2, 4, 1) == "" for name in CHOICES)


def test_an_unknown_schedule_s_message_lists_every_name_to_choose_from():
    problem = schedule_problem("zigzag", 2, 4, 1)
    assert problem.startswith("unknown schedule 'zigzag' (choose from ") and problem.endswith(")")
    listed = problem.removeprefix("unknown schedule 'zigzag' (choose from ").removesuffix(")")
    assert listed.split(", ") == list(CHOICES)


@pytest.mark.parametrize("name", CHOICES)
def test_each_schedules_bubble_formula_is_what_the_simulator_finds(name):
    """Equal costs: F = 1 and B = 2 (B = W = 1 where backward is split), messages free."""
    for stages, micro_batches, chunks in runnable(name):
        schedule = build_schedule(name, stages, micro_batches, chunks)
        costs = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
        step = simulate_schedule(schedule, costs)
        expected = CHOICES[name].bubble(stages, micro_batches, chunks)
        assert step.bubble == pytest.approx(expected), (stages, micro_batches, chunks)
