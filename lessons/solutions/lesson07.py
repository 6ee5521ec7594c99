"""Reference solutions to lesson 7's exercises (pipelines). Try them yourself first."""

from minimp.parallel import Action


def step_time(P, M, t_forward, t_backward):
    """The last stage starts its first forward after P - 1 forwards, then runs its M forwards
    and M backwards back to back; the first stage's last backward ends P - 1 backwards after the
    last stage's. Altogether (P - 1) t_f + M (t_f + t_b) + (P - 1) t_b."""
    return (M + P - 1) * (t_forward + t_backward)


def one_f_one_b_compute(P, M):
    """Warm-up forwards, then one forward and one backward at a time, then the last backwards."""
    schedule = []
    for stage in range(P):
        warmup = min(P - stage - 1, M)
        actions = [Action("forward", mb) for mb in range(warmup)]
        for mb in range(M - warmup):  # steady state
            actions += [Action("forward", warmup + mb), Action("backward", mb)]
        actions += [Action("backward", mb) for mb in range(M - warmup, M)]  # cool-down
        schedule.append(actions)
    return schedule


def one_f_one_b(P, M):
    """The same order with its messages. In the steady state a stage's send of an activation
    and its receive of a gradient happen together (one Sendrecv with the next stage), and so do
    its send of a gradient and its receive of the next activation (with the previous stage)."""
    schedule = []
    for stage in range(P):
        first, last = stage == 0, stage == P - 1
        warmup = min(P - stage - 1, M)
        steady = M - warmup
        actions, forward_mb, backward_mb = [], 0, 0
        for _ in range(warmup):
            actions += [] if first else [Action("recv_forward", forward_mb)]
            actions += [Action("forward", forward_mb)]
            actions += [] if last else [Action("send_forward", forward_mb)]
            forward_mb += 1
        if steady and not first:
            actions.append(Action("recv_forward", forward_mb))
        for index in range(steady):
            actions.append(Action("forward", forward_mb))
            if not last:
                actions.append(
                    Action("send_forward_recv_backward", forward_mb, received=backward_mb)
                )
            forward_mb += 1
            actions.append(Action("backward", backward_mb))
            if not first:
                if index == steady - 1:
                    actions.append(Action("send_backward", backward_mb))
                else:
                    actions.append(
                        Action("send_backward_recv_forward", backward_mb, received=forward_mb)
                    )
            backward_mb += 1
        for _ in range(warmup):
            actions += [] if last else [Action("recv_backward", backward_mb)]
            actions += [Action("backward", backward_mb)]
            actions += [] if first else [Action("send_backward", backward_mb)]
            backward_mb += 1
        schedule.append(actions)
    return schedule
