"""Pipeline schedules as data: for each stage, the ordered list of Actions one runner executes.

An Action names an op and the micro-batch it works on. Compute: FORWARD and BACKWARD. Messages:
RECV_FORWARD / SEND_FORWARD (activations, stage s -> s + 1), RECV_BACKWARD / SEND_BACKWARD (their
gradients, s + 1 -> s), and the paired exchanges SEND_FORWARD_RECV_BACKWARD and
SEND_BACKWARD_RECV_FORWARD, which stage s and stage s + 1 perform at the same moment as one Sendrecv
each (`micro_batch` is sent, `received` comes back): a send that waits for its receiver (any message
past MPI's eager limit does) can then never block both neighbours at once. An Action also has room
for what newer schedules need: a `chunk` (the virtual stage of an interleaved schedule) and a
backward split into BACKWARD_INPUT and BACKWARD_WEIGHT (zero-bubble schedules).

GPipe (Huang et al. 2019): all M forwards, then all M backwards. Simple; every stage holds the
activations of all M micro-batches at the peak.

1F1B (PipeDream-Flush, Narayanan et al. 2021; Megatron-LM's default):
  warm-up    stage s runs min(P - s - 1, M) forwards, filling the pipe below it;
  steady     then alternates one forward, one backward, so a finished micro-batch frees its
             activations at once;
  cool-down  the backwards of the warm-up micro-batches.
Same bubble as GPipe, (P - 1)/(M + P - 1) of the step, but at most P - s micro-batches are alive on
stage s, whatever M is. Works for any M >= 1, including M < P.
"""

from typing import NamedTuple

FORWARD = "forward"
BACKWARD = "backward"  # input and weight gradients together
BACKWARD_INPUT = "backward_input"  # only the gradient sent to the previous stage (zero bubble: B)
BACKWARD_WEIGHT = "backward_weight"  # only the weights' gradients, later (zero bubble: W)
RECV_FORWARD = "recv_forward"
SEND_FORWARD = "send_forward"
RECV_BACKWARD = "recv_backward"
SEND_BACKWARD = "send_backward"
SEND_FORWARD_RECV_BACKWARD = "send_forward_recv_backward"
SEND_BACKWARD_RECV_FORWARD = "send_backward_recv_forward"
COMPUTE_LABELS = {FORWARD: "F", BACKWARD: "B", BACKWARD_INPUT: "B", BACKWARD_WEIGHT: "W"}
ACTIVATION, GRADIENT = 0, 1  # what a message carries: its direction, in the runner's tags
# op -> (what it sends, what it receives): an activation travels to the next virtual stage, its
# gradient back to the previous one; a paired exchange does both at once
MESSAGES = {
    RECV_FORWARD: (None, ACTIVATION),
    SEND_FORWARD: (ACTIVATION, None),
    RECV_BACKWARD: (None, GRADIENT),
    SEND_BACKWARD: (GRADIENT, None),
    SEND_FORWARD_RECV_BACKWARD: (ACTIVATION, GRADIENT),
    SEND_BACKWARD_RECV_FORWARD: (GRADIENT, ACTIVATION),
}


class Action(NamedTuple):
    """One entry of a stage's schedule. op: one of the names above; micro_batch: the micro-batch
    worked on (a paired exchange: the one whose data is sent); received: a paired exchange's
    micro-batch whose data comes back (else None); chunk: which of this rank's model chunks
    (virtual stages; 0 without interleaving)."""

    op: str
    micro_batch: int
    received: int | None = None
    chunk: int = 0

    def __str__(self) -> str:
        label = COMPUTE_LABELS.get(self.op, self.op)
        return f"{label}{self.micro_batch}"


Schedule = list[list[Action]]  # one list of actions per stage


def gpipe(stages: int, micro_batches: int) -> Schedule:
    """Each stage's actions for one GPipe step."""
    check_sizes(stages, micro_batches)
    schedule = []
    for stage in range(stages):
        first, last = stage == 0, stage == stages - 1
        forwards = [a for mb in range(micro_batches) for a in _forward(mb, first, last)]
        backwards = [a for mb in reversed(range(micro_batches)) for a in _backward(mb, first, last)]
        schedule.append(forwards + backwards)
    return schedule


def one_f_one_b(stages: int, micro_batches: int) -> Schedule:
    """Each stage's actions for one 1F1B step (warm-up, steady state, cool-down)."""
    check_sizes(stages, micro_batches)
    return [_one_f_one_b_stage(stage, stages, micro_batches) for stage in range(stages)]


def _one_f_one_b_stage(stage: int, stages: int, micro_batches: int) -> list[Action]:
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    actions = [a for mb in range(warmup) for a in _forward(mb, first, last)]
    if steady and not first:
        actions.append(Action(RECV_FORWARD, warmup))
    for oldest in range(steady):  # the oldest micro-batch alive goes backward
        newest = warmup + oldest
        actions.append(Action(FORWARD, newest))
        if not last:  # hand this activation down and take the gradient of the oldest one back
            actions.append(Action(SEND_FORWARD_RECV_BACKWARD, newest, received=oldest))
        actions.append(Action(BACKWARD, oldest))
        if not first:
            if oldest == steady - 1:
                actions.append(Action(SEND_BACKWARD, oldest))
            else:  # hand the gradient up and take the next activation in
                actions.append(Action(SEND_BACKWARD_RECV_FORWARD, oldest, received=newest + 1))
    return actions + [a for mb in range(steady, micro_batches) for a in _backward(mb, first, last)]


def _forward(mb: int, first: bool, last: bool) -> list[Action]:
    """A forward, its input received before it (not on the first stage) and its output sent on
    after it (not on the last)."""
    received = [] if first else [Action(RECV_FORWARD, mb)]
    return received + [Action(FORWARD, mb)] + ([] if last else [Action(SEND_FORWARD, mb)])


def _backward(mb: int, first: bool, last: bool) -> list[Action]:
    """A backward, its output's gradient received before it (not on the last stage) and its
    input's gradient sent back after it (not on the first)."""
    received = [] if last else [Action(RECV_BACKWARD, mb)]
    return received + [Action(BACKWARD, mb)] + ([] if first else [Action(SEND_BACKWARD, mb)])


def check_sizes(stages: int, micro_batches: int) -> None:
    """Raise ValueError unless there are stages and micro-batches to schedule."""
    if stages < 1 or micro_batches < 1:
        raise ValueError(f"a schedule needs stages >= 1 and micro_batches >= 1, got {stages}, "
                         f"{micro_batches}")


def peak_activations(actions: list[Action]) -> int:
    """The most micro-batches whose activations a stage holds at once: from its forward until the
    backward that is done with them (the weight-gradient half, when backward is split)."""
    alive = peak = 0
    for action in actions:
        if action.op == FORWARD:
            alive += 1
            peak = max(peak, alive)
        elif action.op in (BACKWARD, BACKWARD_WEIGHT):
            alive -= 1
    return peak


def format_schedule(schedule: Schedule) -> str:
    """One line per stage, for printing in a lesson.
    F3 / B3 / W3 for compute, F3c1 for chunk 1's when a rank holds chunks; communication is
    left out."""
    chunked = any(action.chunk for actions in schedule for action in actions)
    lines = []
    for stage, actions in enumerate(schedule):
        compute = [f"{action}c{action.chunk}" if chunked else str(action)
                   for action in actions if action.op in COMPUTE_LABELS]
        lines.append(f"stage {stage}: " + " ".join(compute))
    return "\n".join(lines)
