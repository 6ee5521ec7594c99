"""minimp/parallel/pipeline/schedules/dependencies.py pinned on hand-made schedules: which
problems check_schedule finds, their words and their order, on one rank with two chunks, three
ranks, split backwards."""

from minimp.parallel.pipeline.schedules import actions as s
from minimp.parallel.pipeline.schedules.dependencies import check_schedule
from minimp.parallel.pipeline.schedules.actions import Action

F, B = s.FORWARD, s.BACKWARD


def before(action: Action, rank: int) -> str:
    return f"rank {rank}: {action!r} runs before what it needs"


def test_one_rank_with_two_chunks_passes_its_activation_and_gradient_to_itself():
    # Virtual stage 1 is chunk 1 of rank 0: its forward needs chunk 0's forward, and chunk 0's
    # backward needs chunk 1's, both run on this rank (no message).
    f0, f1, b0, b1 = (Action(op, 0, chunk=c) for op, c in ((F, 0), (F, 1), (B, 0), (B, 1)))
    assert check_schedule([[f0, f1, b1, b0]], 1, chunks=2) == []
    assert check_schedule([[f1, f0, b1, b0]], 1, chunks=2) == [before(f1, 0)]
    assert check_schedule([[f0, f1, b0, b1]], 1, chunks=2) == [before(b0, 0)]


def test_the_last_stages_backward_needs_its_own_forward():
    assert check_schedule([[Action(B, 0), Action(F, 0)]], 1) == [before(Action(B, 0), 0)]


def test_a_gradient_is_sent_only_after_the_backward_that_computes_it():
    schedule = [
        [Action(F, 0), Action(s.SEND_FORWARD, 0), Action(s.RECV_BACKWARD, 0), Action(B, 0)],
        # the send of the gradient before the backward, after the forward
        [Action(s.RECV_FORWARD, 0), Action(F, 0), Action(s.SEND_BACKWARD, 0), Action(B, 0)],
    ]
    assert check_schedule(schedule, 1) == [
        "rank 1: Action(op='send_backward', micro_batch=0, received=None, chunk=0) runs before "
        "what it needs"
    ]


def test_missing_computes_are_named_forward_backward_and_backward_weight():
    ops = [(F, 1), (s.BACKWARD_INPUT, 0), (s.BACKWARD_INPUT, 1), (s.BACKWARD_WEIGHT, 1)]
    schedule = [[Action(op, micro_batch) for op, micro_batch in ops]]
    problems = check_schedule(schedule, 2)
    assert problems[:2] == [
        "rank 0 chunk 0: forward of micro-batches [1]",
        "rank 0 chunk 0: backward_weight of [1]",
    ]


def test_a_receive_met_first_finds_its_sender_on_the_next_stage():
    # Three ranks, sends wait for their receive. Rank 0 reaches its receive of rank 1's gradient
    # first (rank 2 has finished): the pair runs at rank 0's turn, so rank 0's next compute is
    # checked before rank 1's. Were rank 0 to wait for rank 1's turn, rank 1 would go first.
    late_backward_0, late_backward_1 = Action(B, 0), Action(B, 1)
    send = Action(s.SEND_BACKWARD, 0)
    schedule = [[Action(s.RECV_BACKWARD, 0), late_backward_0], [send, late_backward_1], []]
    problems = [p for p in check_schedule(schedule, 1, rendezvous=True) if "runs before" in p]
    assert problems == [before(send, 1), before(late_backward_0, 0), before(late_backward_1, 1)]


def test_a_receive_met_first_finds_its_sender_on_the_previous_stage():
    # Rank 1 reaches its receive of rank 0's activation during its own turn, after rank 0 stopped
    # at the send: the pair runs at rank 1's turn, so rank 1's next compute is checked before
    # rank 0's, which waits for the next sweep.
    first, send = Action(B, 2), Action(s.SEND_FORWARD, 0)
    then_0, then_1 = Action(B, 1), Action(B, 0)
    schedule = [[send, then_0], [first, Action(s.RECV_FORWARD, 0), then_1], []]
    problems = [p for p in check_schedule(schedule, 1, rendezvous=True) if "runs before" in p]
    assert problems == [before(first, 1), before(send, 0), before(then_1, 1), before(then_0, 0)]
