"""The schedule simulator: with equal costs every schedule's bubble is its paper's formula; its
timeline is the --timeline trace format; and the dependency checker catches broken schedules."""

import json

import pytest

from minimp.parallel.pipeline.schedules import actions as s
from minimp.parallel.pipeline.schedules.dependencies import check_schedule, with_messages
from minimp.parallel.pipeline.schedules.interleaved import interleaved
from minimp.parallel.pipeline.schedules.actions import Action, gpipe, one_f_one_b
from minimp.parallel.pipeline.simulator import Costs, simulate_schedule, simulated_trace
from minimp.measure.trace import read_timeline
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1

SIZES = [(P, M) for P in (2, 3, 4, 5) for M in (1, 2, 3, 4, 6, 8, 9)]


@pytest.mark.parametrize("P,M", SIZES)
@pytest.mark.parametrize("schedule", [gpipe, one_f_one_b])
def test_gpipe_and_1f1b_bubbles_are_the_formula(schedule, P, M):
    step = simulate_schedule(schedule(P, M), Costs(forward=1.0, backward=2.0))
    assert step.bubble == pytest.approx((P - 1) / (M + P - 1))
    assert step.span == pytest.approx(3.0 * (M + P - 1))


@pytest.mark.parametrize("P,M", [(P, M) for P, M in SIZES if M % P == 0])
@pytest.mark.parametrize("V", [1, 2, 3])
def test_interleaving_over_v_chunks_divides_the_bubble_by_v(P, M, V):
    """Narayanan et al. 2021: bubble time (P - 1)/(V M) of the ideal compute time, that is
    (P - 1)/(V M + P - 1) of the step, when each chunk's work is 1/V of a stage's."""
    step = simulate_schedule(interleaved(P, M, V), Costs(forward=1.0 / V, backward=2.0 / V))
    assert step.bubble == pytest.approx((P - 1) / (V * M + P - 1))


@pytest.mark.parametrize("P,M", [(P, M) for P, M in SIZES if M >= P])
def test_zb_h1_keeps_a_third_of_1f1bs_bubble(P, M):
    """Qi et al. 2023 with T_F = T_B = T_W: idle (P - 1) T per stage, a third of 1F1B's."""
    costs = Costs(forward=1.0, backward=2.0, backward_input=1.0, backward_weight=1.0)
    zero_bubble, plain = simulate_schedule(zb_h1(P, M), costs), simulate_schedule(
        one_f_one_b(P, M), costs
    )
    assert zero_bubble.bubble == pytest.approx((P - 1) / (3 * M + P - 1))
    idle = [zero_bubble.span - busy for busy in zero_bubble.busy]
    assert idle == pytest.approx([(P - 1) * 1.0] * P)
    assert [plain.span - b for b in plain.busy] == pytest.approx([(P - 1) * 3.0] * P)
    # the same peak memory as 1F1B (its first stage's), on every stage
    assert max(zero_bubble.peak_stored) == max(plain.peak_stored) == min(P, M)


@pytest.mark.parametrize("P,M", SIZES)
def test_1f1b_holds_at_most_p_minus_s_micro_batches_and_gpipe_all(P, M):
    plain = simulate_schedule(one_f_one_b(P, M), Costs(1.0, 2.0))
    assert plain.peak_stored == [min(P - stage, M) for stage in range(P)]
    assert simulate_schedule(gpipe(P, M), Costs(1.0, 2.0)).peak_stored == [M] * P


def test_message_time_stretches_the_step_by_the_pipes_crossings():
    P, M, message = 3, 4, 0.25
    free = simulate_schedule(gpipe(P, M), Costs(1.0, 1.0))
    paid = simulate_schedule(gpipe(P, M), Costs(1.0, 1.0, message=message))
    # the fill and the drain each cross P - 1 links one after the other
    assert paid.span == pytest.approx(free.span + 2 * (P - 1) * message)


def test_per_stage_costs_make_the_slowest_stage_the_pace():
    step = simulate_schedule(one_f_one_b(2, 8), Costs(forward=[1.0, 3.0], backward=[2.0, 6.0]))
    assert step.busy == pytest.approx([24.0, 72.0])
    assert step.span >= 72.0 + 1.0  # the slow stage waits at least for the first forward


SCHEDULES = {
    "gpipe": lambda P, M: gpipe(P, M),
    "1f1b": lambda P, M: one_f_one_b(P, M),
    "interleaved": lambda P, M: interleaved(P, M, 2),
    "zb-h1": lambda P, M: zb_h1(P, M),
}


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("P,M", [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_every_schedule_passes_the_dependency_checker(name, P, M):
    chunks = 2 if name == "interleaved" else 1
    assert check_schedule(SCHEDULES[name](P, M), M, chunks) == []


@pytest.mark.parametrize("P,M", [(2, 1), (2, 4), (4, 8), (3, 2)])
def test_the_paired_exchanges_of_1f1b_survive_sends_that_wait_for_their_receive(P, M):
    assert check_schedule(one_f_one_b(P, M), M, rendezvous=True) == []
    assert check_schedule(gpipe(P, M), M, rendezvous=True) == []


def test_a_forward_before_its_activation_arrives_is_caught():
    schedule = gpipe(2, 2)
    stage1 = schedule[1]
    receive = stage1.index(Action(s.RECV_FORWARD, 0))
    stage1[receive], stage1[receive + 1] = stage1[receive + 1], stage1[receive]
    problems = check_schedule(schedule, 2)
    assert any("runs before what it needs" in p and "forward" in p for p in problems)


def test_a_missing_send_is_a_deadlock_and_a_missing_backward_is_named():
    schedule = gpipe(2, 2)
    schedule[0].remove(Action(s.SEND_FORWARD, 1))
    assert any(p.startswith("deadlock:") and "rank 1 at" in p for p in check_schedule(schedule, 2))
    with pytest.raises(RuntimeError, match="deadlocks"):
        simulate_schedule(schedule, Costs(1.0, 2.0))
    schedule = gpipe(2, 2)
    schedule[1].remove(Action(s.BACKWARD, 0))
    assert "rank 1 chunk 0: backward of micro-batches [1]" in check_schedule(schedule, 2)


def test_sends_facing_each_other_deadlock_only_when_sends_wait_for_their_receive():
    """1F1B's compute order with plain sends and receives: stage 0 sends forward 1 while stage 1
    sends backward 0, each before receiving. Buffered (eager) sends pass each other; sends that
    wait for their receiver (past MPI's eager limit) wait for ever: why 1F1B pairs them."""
    computes = [[a for a in actions if a.op in (s.FORWARD, s.BACKWARD)] for actions in
                one_f_one_b(2, 2)]  # fmt: skip
    schedule = with_messages(computes, stages=2, chunks=1)
    assert check_schedule(schedule, 2) == []
    problems = check_schedule(schedule, 2, rendezvous=True)
    assert problems == [
        "deadlock: rank 0 at Action(op='send_forward', micro_batch=1, received=None, chunk=0); "
        "rank 1 at Action(op='send_backward', micro_batch=0, received=None, chunk=0) "
        "can never go on"
    ]


def test_with_messages_surrounds_computes_with_the_messages_they_need():
    computes = [[Action(s.FORWARD, 0), Action(s.BACKWARD, 0)]] * 2
    schedule = with_messages(computes, stages=2, chunks=1)
    assert [a.op for a in schedule[0]] == [s.FORWARD, s.SEND_FORWARD, s.RECV_BACKWARD, s.BACKWARD]
    assert [a.op for a in schedule[1]] == [s.RECV_FORWARD, s.FORWARD, s.BACKWARD, s.SEND_BACKWARD]


def test_interleaving_refuses_micro_batches_that_are_not_a_multiple_of_the_stages():
    with pytest.raises(ValueError, match="not a multiple of 4"):
        interleaved(4, 6, 2)
    with pytest.raises(ValueError, match="--pp 2 or more"):
        interleaved(1, 4, 2)


def test_the_simulated_timeline_is_the_trace_format(tmp_path):
    step = simulate_schedule(zb_h1(3, 6), Costs(1.0, 2.0))
    path = tmp_path / "simulated.json"
    path.write_text(json.dumps(simulated_trace(step, "zb-h1", 6)))
    timeline = read_timeline(str(path))
    assert timeline["schedule"] == "zb-h1" and timeline["simulated"] is True
    assert len(timeline["events"]) == 3 * 6 * 3  # F, B and W of 6 micro-batches on 3 stages
    weights = [e for e in timeline["events"] if e["op"] == "backward_weight"]
    assert len(weights) == 18 and all(e["kind"] == "backward" for e in weights)
    last = max(e["end"] for e in timeline["events"])
    assert last == pytest.approx(step.span)


def test_a_step_that_takes_no_time_has_no_bubble():
    step = simulate_schedule(gpipe(2, 2), Costs(0.0, 0.0))
    assert step.span == 0.0 and step.bubble == 0.0 and step.busy == [0.0, 0.0]


def test_the_simulated_trace_names_its_sizes_and_calls_its_step_1():
    step = simulate_schedule(one_f_one_b(3, 4), Costs(1.0, 2.0))
    document = simulated_trace(step, "1f1b", 4)
    assert document["otherData"] == {
        "schedule": "1f1b",
        "stages": 3,
        "replicas": 1,
        "micro_batches": 4,
        "peak_stored_micro_batches": [3, 2, 1],  # 1F1B: at most P - s on stage s
        "stage_of_rank": {"0": 0, "1": 1, "2": 2},
        "replica_0_ranks": [0, 1, 2],
        "simulated": True,
    }
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    assert len(events) == 3 * 4 * 2 and all(e["args"]["step"] == 1 for e in events)
    assert all(row[1] == 1 for rank_rows in step.rows for row in rank_rows)
