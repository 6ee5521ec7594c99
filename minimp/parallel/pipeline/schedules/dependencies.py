"""What makes a pipeline schedule valid, checked without MPI; the messages a compute order needs.

A schedule is a list of Actions per rank. With V chunks per rank (interleaving), chunk c of rank
r is virtual stage s = c P + r of S = P V. Micro-batch m then needs, on virtual stage s:
  forward      the activation of forward(s - 1, m)                     (s > 0)
  backward     its own forward(s, m), and the gradient of backward(s + 1, m)  (s < S - 1)
  (split)      backward_input needs what backward needs; backward_weight needs backward_input(s, m)
`check_schedule` executes every rank's actions in the abstract and lists what is wrong: a compute
that runs twice or never, one that runs before what it needs, a message sent and never received,
a wait that can never end (a deadlock). `rendezvous=True` makes every send wait for its receive
(MPI's protocol past the eager limit: the strictest); False lets sends complete at once (what
non-blocking sends give).
"""

from typing import Callable

from minimp.parallel.pipeline.schedules import actions as s
from minimp.parallel.pipeline.schedules.actions import Action, Schedule

INPUT_GRADIENT = (s.BACKWARD, s.BACKWARD_INPUT)  # the computes that send a gradient back
Message = tuple[int, int, int]  # (ACTIVATION or GRADIENT, micro-batch, the virtual stage receiving)
Reached = tuple[Action, list[Message], list[Message]]  # a rank's next action, what it sends, gets


def virtual_stage(rank: int, chunk: int, stages: int) -> int:
    return chunk * stages + rank


def with_messages(computes: list[list[Action]], stages: int, chunks: int) -> Schedule:
    """The compute orders with their messages: each receive just before the compute that needs
    it, each send just after the compute that produced it (runs with non-blocking sends)."""
    last = stages * chunks - 1
    schedule = []
    for rank, order in enumerate(computes):
        actions: list[Action] = []
        for action in order:
            here = virtual_stage(rank, action.chunk, stages)
            needs_activation = action.op == s.FORWARD and here > 0
            needs_gradient = action.op in INPUT_GRADIENT and here < last
            if needs_activation or needs_gradient:
                op = s.RECV_FORWARD if needs_activation else s.RECV_BACKWARD
                actions.append(Action(op, action.micro_batch, chunk=action.chunk))
            actions.append(action)
            if action.op == s.FORWARD and here < last:
                actions.append(Action(s.SEND_FORWARD, action.micro_batch, chunk=action.chunk))
            if action.op in INPUT_GRADIENT and here > 0:
                actions.append(Action(s.SEND_BACKWARD, action.micro_batch, chunk=action.chunk))
        schedule.append(actions)
    return schedule


def messages(action: Action, rank: int, stages: int) -> tuple[list[Message], list[Message]]:
    """(keys sent, keys received) by an action; a key names one message: (ACTIVATION or GRADIENT,
    micro-batch, the virtual stage that receives it)."""
    here = virtual_stage(rank, action.chunk, stages)
    send, receive = s.MESSAGES.get(action.op, (None, None))
    mb = action.received if action.received is not None else action.micro_batch
    # an activation goes to the next virtual stage, a gradient back to the previous one
    step = 1 if send == s.ACTIVATION else -1
    sent = [] if send is None else [(send, action.micro_batch, here + step)]
    return sent, [] if receive is None else [(receive, mb, here)]


def check_schedule(schedule: Schedule, micro_batches: int, chunks: int = 1,
                   rendezvous: bool = False) -> list[str]:
    """Everything wrong with the schedule, in words (an empty list: it is valid)."""
    stages = len(schedule)
    problems = _check_computes(schedule, micro_batches, chunks)
    position = [0] * stages
    posted: set[Message] = set()  # messages on their way
    arrived: set[Message] = set()  # messages received
    done: set[tuple] = set()  # (op, micro-batch, virtual stage) of the computes that ran
    last = stages * chunks - 1

    def current(rank: int) -> Reached | None:
        if position[rank] == len(schedule[rank]):
            return None
        action = schedule[rank][position[rank]]
        return action, *messages(action, rank, stages)

    def run(rank: int, action: Action) -> None:
        if not _inputs_ready(action, rank, stages, last, done, arrived):
            problems.append(f"rank {rank}: {action!r} runs before what it needs")
        arrived.update(messages(action, rank, stages)[1])
        done.add((action.op, action.micro_batch, virtual_stage(rank, action.chunk, stages)))
        position[rank] += 1

    progress = True
    while progress:
        progress = False
        for rank in range(stages):
            while (here := current(rank)) is not None:
                action, out, into = here
                if not out and not into:  # a compute
                    run(rank, action)
                elif not rendezvous:
                    posted.update(out)  # a send is on its way as soon as it is reached
                    if not all(key in posted for key in into):
                        break
                    run(rank, action)
                elif rendezvous and (partner := _partner(current, out, into, stages)) is not None:
                    run(rank, action)  # sender and receiver meet: both go on at once
                    run(*partner)
                else:
                    break
                progress = True
    stuck = [rank for rank in range(stages) if current(rank) is not None]
    if stuck:
        what = "; ".join(f"rank {r} at {schedule[r][position[r]]!r}" for r in stuck)
        problems.append(f"deadlock: {what} can never go on")
    return problems


def _partner(current: Callable[[int], Reached | None], out: list[Message], into: list[Message],
             stages: int) -> tuple[int, Action] | None:
    """(rank, action) of the rank whose current action receives exactly what this one sends and
    sends exactly what this one receives (a send that must wait for its receive, or a Sendrecv
    pair), or None."""
    receiver_stage = (out + into)[0][2]
    for stage in (receiver_stage, receiver_stage - 1, receiver_stage + 1):
        rank = stage % stages
        other = current(rank)
        if other is None:
            continue
        if sorted(other[2]) == sorted(out) and sorted(other[1]) == sorted(into):
            return rank, other[0]
    return None


def _inputs_ready(action: Action, rank: int, stages: int, last: int, done: set[tuple],
                  arrived: set[Message]) -> bool:
    """What a compute needs has run on this rank or arrived in a message it received: forward
    the previous virtual stage's activation; backward its forward and the next virtual stage's
    gradient; backward_weight its backward_input."""
    here, mb = virtual_stage(rank, action.chunk, stages), action.micro_batch

    def ran(ops: tuple, stage: int) -> bool:
        return any((op, mb, stage) in done for op in ops)

    def from_stage(stage: int, ops: tuple, carries: int) -> bool:
        if stage % stages == rank:  # the neighbouring chunk is on this rank: no message
            return ran(ops, stage)
        return (carries, mb, here) in arrived

    send = s.MESSAGES.get(action.op, (None, None))[0]
    if send is not None:  # what is sent must have been computed
        return ran((s.FORWARD,) if send == s.ACTIVATION else INPUT_GRADIENT, here)
    if action.op == s.FORWARD:
        return here == 0 or from_stage(here - 1, (s.FORWARD,), s.ACTIVATION)
    if action.op in INPUT_GRADIENT:
        own = (s.FORWARD, mb, here) in done
        return own and (here == last or from_stage(here + 1, INPUT_GRADIENT, s.GRADIENT))
    if action.op == s.BACKWARD_WEIGHT:
        return (s.BACKWARD_INPUT, mb, here) in done
    return True


def _check_computes(schedule: Schedule, micro_batches: int, chunks: int) -> list[str]:
    """Every chunk of every rank runs each micro-batch's forward and backward exactly once."""
    problems = []
    for rank, actions in enumerate(schedule):
        for chunk in range(chunks):
            here = [a for a in actions if a.chunk == chunk]
            for name, ops in (("forward", {s.FORWARD}), ("backward", set(INPUT_GRADIENT))):
                ran = sorted(a.micro_batch for a in here if a.op in ops)
                if ran != list(range(micro_batches)):
                    problems.append(f"rank {rank} chunk {chunk}: {name} of micro-batches {ran}")
            split = sorted(a.micro_batch for a in here if a.op == s.BACKWARD_WEIGHT)
            if split and split != list(range(micro_batches)):
                problems.append(f"rank {rank} chunk {chunk}: backward_weight of {split}")
    return problems
