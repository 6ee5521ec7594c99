"""The interleaved 1F1B schedule (Narayanan et al. 2021, "Efficient Large-Scale Language Model
Training on GPU Clusters", section 2.2) as data: each rank holds V chunks of layers.

The model is cut into P x V chunks (virtual stages); rank r holds chunks r, r + P, ..., r + (V-1) P,
so a micro-batch visits every rank V times on its way through the model. Each visit does 1/V of the
work, and the pipeline fills V times faster: the bubble falls from (P - 1)/M of the ideal compute
time to (P - 1)/(V M), for V times as many messages. Micro-batches go through in groups of P.

The compute order is Megatron-LM's (`forward_backward_pipelining_with_interleaving`): virtual
step k of a rank is micro-batch (k // (P V)) P + k % P of chunk (k // P) % V (forward; the chunks
run in reverse order backward); rank r warms up with 2 (P - r - 1) + (V - 1) P forwards, then
alternates one forward, one backward, then drains. The messages between consecutive virtual stages
are then inserted by `with_messages` (minimp/parallel/pipeline/schedules/dependencies.py).
"""

from minimp.parallel.pipeline.schedules.actions import BACKWARD, FORWARD, Action, Schedule
from minimp.parallel.pipeline.schedules.dependencies import with_messages


def check_interleaving(stages: int, micro_batches: int, virtual_stages: int) -> None:
    """Raise ValueError unless the interleaved schedule exists for these sizes."""
    if stages < 2:
        raise ValueError(f"interleaving needs --pp 2 or more, got --pp {stages}")
    if virtual_stages < 1 or micro_batches < 1:
        raise ValueError(f"interleaving needs --virtual-stages and --micro-batches of 1 or more, "
                         f"got {virtual_stages} and {micro_batches}")
    if micro_batches % stages:
        raise ValueError(f"the interleaved schedule sends micro-batches in groups of --pp: "
                         f"--micro-batches {micro_batches} is not a multiple of {stages}")


def interleaved(stages: int, micro_batches: int, virtual_stages: int) -> Schedule:
    """Each rank's actions for one interleaved 1F1B step; Action.chunk is the rank's chunk."""
    check_interleaving(stages, micro_batches, virtual_stages)
    computes = [_compute_order(rank, stages, micro_batches, virtual_stages)
                for rank in range(stages)]
    return with_messages(computes, stages, virtual_stages)


def _compute_order(rank: int, stages: int, micro_batches: int, chunks: int) -> list[Action]:
    total = micro_batches * chunks  # virtual steps of each direction on this rank
    if micro_batches == stages:  # one group: the whole step is warm-up, then drain
        warmup = total
    else:
        warmup = min((stages - rank - 1) * 2 + (chunks - 1) * stages, total)

    def action(step: int, op: str) -> Action:
        group, position = divmod(step, stages * chunks)
        chunk = position // stages
        if op == BACKWARD:
            chunk = chunks - 1 - chunk  # backward visits the chunks in reverse
        return Action(op, group * stages + step % stages, chunk=chunk)

    order = [action(k, FORWARD) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action(warmup + k, FORWARD), action(k, BACKWARD)]
    order += [action(k, BACKWARD) for k in range(total - warmup, total)]
    return order
