"""Pipeline schedules without MPI: order, message pairing (no deadlock), and activation memory."""

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp.parallel.pipeline.schedules.interleaved import interleaved
from minimp.parallel.pipeline.schedules.actions import (
    BACKWARD,
    BACKWARD_INPUT,
    BACKWARD_WEIGHT,
    FORWARD,
    SEND_FORWARD,
    Action,
    format_schedule,
    gpipe,
    one_f_one_b,
    peak_activations,
)
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1

CASES = st.tuples(st.sampled_from(["1f1b", "gpipe"]), st.integers(1, 8), st.integers(1, 16))


@given(CASES)
def test_every_micro_batch_is_forwarded_then_backwarded_once_on_every_stage(case):
    name, stages, micro_batches = case
    for actions in build_schedule(name, stages, micro_batches):
        forwards = [a.micro_batch for a in actions if a.op == "forward"]
        backwards = [a.micro_batch for a in actions if a.op == "backward"]
        assert sorted(forwards) == sorted(backwards) == list(range(micro_batches))
        for mb in range(micro_batches):
            assert actions.index(Action("forward", mb)) < actions.index(Action("backward", mb))


def run_abstractly(schedule):
    """Execute every stage's actions with the strictest MPI semantics: a send completes only
    together with its matching receive, and a paired exchange only together with its mirror.
    Returns True when all stages finish; False means the schedule can deadlock."""
    positions = [0] * len(schedule)
    mirror = {
        "send_forward": "recv_forward",
        "send_backward": "recv_backward",
        "send_forward_recv_backward": "send_backward_recv_forward",
    }
    mirror.update({value: key for key, value in mirror.items()})
    progress = True
    while progress:
        progress = False
        for stage, actions in enumerate(schedule):
            if positions[stage] == len(actions):
                continue
            action = actions[positions[stage]]
            if action.op in ("forward", "backward"):
                positions[stage] += 1
                progress = True
                continue
            neighbour = (
                stage + 1
                if action.op in ("send_forward", "recv_backward", "send_forward_recv_backward")
                else stage - 1
            )
            if not 0 <= neighbour < len(schedule) or positions[neighbour] == len(
                schedule[neighbour]
            ):
                return False
            other = schedule[neighbour][positions[neighbour]]
            if action.received is None:  # a one-way message: the mirror names the same micro-batch
                expected = Action(mirror[action.op], action.micro_batch)
            else:  # a paired exchange: what one side sends, the other receives
                expected = Action(mirror[action.op], action.received, received=action.micro_batch)
            if other == expected:
                positions[stage] += 1
                positions[neighbour] += 1
                progress = True
    return all(p == len(a) for p, a in zip(positions, schedule))


@given(CASES)
def test_sends_and_receives_pair_up_so_no_schedule_deadlocks(case):
    name, stages, micro_batches = case
    assert run_abstractly(build_schedule(name, stages, micro_batches))


def test_the_checker_catches_a_deadlocking_schedule():
    broken = gpipe(2, 2)
    broken[1] = [a for a in broken[1] if a != Action("recv_forward", 1)]
    assert not run_abstractly(broken)


@given(st.integers(1, 8), st.integers(1, 16))
def test_gpipe_holds_m_activations_and_1f1b_at_most_p_minus_stage(stages, micro_batches):
    for stage, actions in enumerate(gpipe(stages, micro_batches)):
        assert peak_activations(actions) == micro_batches
    for stage, actions in enumerate(one_f_one_b(stages, micro_batches)):
        assert peak_activations(actions) == min(stages - stage, micro_batches)


def test_1f1b_with_fewer_micro_batches_than_stages():
    schedule = one_f_one_b(4, 2)
    assert run_abstractly(schedule)
    assert format_schedule(schedule).splitlines()[0] == "stage 0: F0 F1 B0 B1"


def test_format_shows_the_classic_1f1b_picture():
    assert format_schedule(one_f_one_b(2, 3)).splitlines() == [
        "stage 0: F0 F1 B0 F2 B1 B2",
        "stage 1: F0 B0 F1 B1 F2 B2",
    ]


def test_format_names_the_chunk_when_a_rank_holds_several():
    assert format_schedule(interleaved(2, 2, 2)).splitlines()[0] == (
        "stage 0: F0c0 F1c0 F0c1 F1c1 B0c1 B1c1 B0c0 B1c0"
    )


# Megatron-LM's warm-up in its interleaved schedule (micro-batches in groups of P): rank r runs
# 2 (P - r - 1) + (V - 1) P forwards before its steady state, or all M V when M == P (then every
# forward comes first and every backward after). Written out rank by rank, not computed.
INTERLEAVED_WARMUPS = {  # (P, V, M): the warm-up forwards of ranks 0 .. P - 1
    (2, 1, 4): [2, 0],
    (2, 2, 4): [4, 2],
    (2, 2, 2): [4, 4],
    (3, 3, 6): [10, 8, 6],
    (4, 2, 4): [8, 8, 8, 8],
    (4, 2, 8): [10, 8, 6, 4],
    (4, 3, 8): [14, 12, 10, 8],
}


def test_interleaved_warm_up_counts_are_megatron_s():
    """Each rank's computations: its warm-up forwards, then one forward and one backward at a
    time, then the warm-up's backwards (cool-down)."""
    for (stages, chunks, micro_batches), warmups in INTERLEAVED_WARMUPS.items():
        schedule = interleaved(stages, micro_batches, chunks)
        for rank, (actions, warmup) in enumerate(zip(schedule, warmups, strict=True)):
            ops = [a.op for a in actions if a.op in (FORWARD, BACKWARD)]
            steady = micro_batches * chunks - warmup
            expected = [FORWARD] * warmup + [FORWARD, BACKWARD] * steady + [BACKWARD] * warmup
            assert ops == expected, f"P={stages} V={chunks} M={micro_batches} rank {rank}"


def test_bad_sizes_are_rejected():
    with pytest.raises(ValueError):
        gpipe(0, 1)


@pytest.mark.parametrize("stages, micro_batches", [(0, 3), (2, 0)])
def test_zb_h1_refuses_zero_stages_or_micro_batches(stages, micro_batches):
    message = f"a schedule needs stages >= 1 and micro_batches >= 1, got {stages}, {micro_batches}"
    with pytest.raises(ValueError, match=f"^{message}$"):
        zb_h1(stages, micro_batches)


def test_zb_h1_on_one_stage_runs_each_w_right_after_its_b():
    """One stage: nothing to wait for, so W(m) comes at once (stage 0 runs W 0 micro-batches
    late), and there are no messages."""
    F, B, W = FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT
    assert zb_h1(1, 2) == [[Action(F, 0), Action(B, 0), Action(W, 0),
                            Action(F, 1), Action(B, 1), Action(W, 1)]]  # fmt: skip


@pytest.mark.parametrize(
    "micro_batches, virtual_stages, message",
    [
        (4, 0, "--virtual-stages and --micro-batches of 1 or more, got 0 and 4"),
        (0, 2, "--virtual-stages and --micro-batches of 1 or more, got 2 and 0"),
        # one micro-batch is 1 or more: what is wrong is the group of --pp 2
        (1, 2, "--micro-batches 1 is not a multiple of 2"),
    ],
)
def test_interleaving_names_the_size_that_cannot_work(micro_batches, virtual_stages, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        interleaved(2, micro_batches, virtual_stages)


def test_peak_activations_counts_a_micro_batch_until_its_weight_gradient():
    """The peak may come after a backward: F0 F1 B0 F2 B1(input) W1 F3 F4 holds 1 2 1 2 2 1 2 3."""
    actions = [Action(FORWARD, 0), Action(FORWARD, 1), Action(BACKWARD, 0), Action(FORWARD, 2),
               Action(BACKWARD_INPUT, 1), Action(BACKWARD_WEIGHT, 1), Action(FORWARD, 3),
               Action(FORWARD, 4)]  # fmt: skip
    assert peak_activations(actions) == 3


def test_an_action_prints_as_its_label_or_op_and_micro_batch():
    assert [str(Action(op, 3)) for op in (FORWARD, BACKWARD_WEIGHT, SEND_FORWARD)] == [
        "F3", "W3", "send_forward3",
    ]  # fmt: skip
