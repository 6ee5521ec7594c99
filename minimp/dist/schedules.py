"""Pipeline schedules as data: for each stage, the ordered list of actions one runner executes.

An action is a tuple: ("forward", mb), ("backward", mb), ("recv_forward", mb), ("send_forward", mb),
("recv_backward", mb), ("send_backward", mb), or the paired exchanges ("send_forward_recv_backward",
mb_sent, mb_received) and ("send_backward_recv_forward", mb_sent, mb_received), which stage i and
stage i + 1 perform at the same moment as one Sendrecv each: a send that waits for its receiver (any
message past MPI's eager limit does) can then never block both neighbours at once.

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


def gpipe(stages, micro_batches):
    """Each stage's actions for one GPipe step."""
    _check(stages, micro_batches)
    schedule = []
    for stage in range(stages):
        first, last = stage == 0, stage == stages - 1
        actions = []
        for mb in range(micro_batches):
            actions += ([] if first else [("recv_forward", mb)]) + [("forward", mb)]
            actions += [] if last else [("send_forward", mb)]
        for mb in reversed(range(micro_batches)):
            actions += ([] if last else [("recv_backward", mb)]) + [("backward", mb)]
            actions += [] if first else [("send_backward", mb)]
        schedule.append(actions)
    return schedule


def one_f_one_b(stages, micro_batches):
    """Each stage's actions for one 1F1B step (warm-up, steady state, cool-down)."""
    _check(stages, micro_batches)
    return [_one_f_one_b_stage(stage, stages, micro_batches) for stage in range(stages)]


def _one_f_one_b_stage(stage, stages, micro_batches):
    first, last = stage == 0, stage == stages - 1
    warmup = min(stages - stage - 1, micro_batches)
    steady = micro_batches - warmup
    actions, forward_mb, backward_mb = [], 0, 0
    for _ in range(warmup):
        actions += ([] if first else [("recv_forward", forward_mb)]) + [("forward", forward_mb)]
        actions += [] if last else [("send_forward", forward_mb)]
        forward_mb += 1
    if steady and not first:
        actions.append(("recv_forward", forward_mb))
    for index in range(steady):
        actions.append(("forward", forward_mb))
        if not last:  # hand this activation down and take the gradient of the oldest one back
            actions.append(("send_forward_recv_backward", forward_mb, backward_mb))
        forward_mb += 1
        actions.append(("backward", backward_mb))
        if not first:
            if index == steady - 1:
                actions.append(("send_backward", backward_mb))
            else:  # hand the gradient up and take the next activation in
                actions.append(("send_backward_recv_forward", backward_mb, forward_mb))
        backward_mb += 1
    for _ in range(warmup):
        actions += ([] if last else [("recv_backward", backward_mb)]) + [("backward", backward_mb)]
        actions += [] if first else [("send_backward", backward_mb)]
        backward_mb += 1
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def _check(stages, micro_batches):
    if stages < 1 or micro_batches < 1:
        raise ValueError(
            f"a schedule needs stages >= 1 and micro_batches >= 1, got {stages}, {micro_batches}"
        )


def peak_activations(actions):
    """The most micro-batches whose activations a stage holds at once (forwarded, not yet
    backwarded)."""
    alive = peak = 0
    for action in actions:
        if action[0] == "forward":
            alive += 1
            peak = max(peak, alive)
        elif action[0] == "backward":
            alive -= 1
    return peak


def format_schedule(schedule):
    """One line per stage, F3 / B3 for compute (communication left out): for printing in a
    lesson."""
    lines = []
    for stage, actions in enumerate(schedule):
        compute = [f"{a[0][0].upper()}{a[1]}" for a in actions if a[0] in ("forward", "backward")]
        lines.append(f"stage {stage}: " + " ".join(compute))
    return "\n".join(lines)
