"""Reference solutions to lesson 13's exercises (shrinking the bubble). Try them yourself first."""

from minimp.parallel import Action


def interleaved_compute(P, M, V):
    """Megatron-LM's order: virtual step k of a rank is micro-batch (k // (P V)) P + k % P on
    chunk (k // P) % V, the chunks reversed backward; rank r warms up with 2 (P - r - 1) +
    (V - 1) P forwards (every one when M = P), then alternates a forward and a backward."""

    def action(op, k):
        group, position = divmod(k, P * V)
        chunk = position // P
        if op == "backward":
            chunk = V - 1 - chunk
        return Action(op, group * P + k % P, chunk=chunk)

    schedule = []
    for rank in range(P):
        total = M * V
        warmup = total if M == P else min(2 * (P - rank - 1) + (V - 1) * P, total)
        order = [action("forward", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [action("forward", warmup + k), action("backward", k)]
        order += [action("backward", k) for k in range(total - warmup, total)]
        schedule.append(order)
    return schedule


def zb_h1_bubble(P, M, t_forward, t_input, t_weight):
    """A stage computes M (F + B + W) and idles (P - 1)(F + B - W): the fill and the drain of
    1F1B, less the W's that run in the drain."""
    idle = (P - 1) * (t_forward + t_input - t_weight)
    return idle / (M * (t_forward + t_input + t_weight) + idle)
