"""The ZB-H1 schedule (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", section 3) as data.

Backward splits in two: B computes the gradient of the stage's input (what the previous stage
waits for) and W the gradients of its weights (what nobody waits for until the optimizer step).
So W can move to where a stage would otherwise idle. ZB-H1 keeps 1F1B's forwards and B's, and
stage i runs each W i micro-batches late: W(m) after B(m + i), the last i of them after its last
B. Those W's fill the drain at the end of the step, where 1F1B's stages wait for gradients.

With every F, B and W taking the same time t (and no message time), the bubble is (P - 1) t per
stage instead of 1F1B's (P - 1) 3t: a third, (P - 1)(T_F + T_B - T_W) in the paper's terms, for
M >= P. As a share of the step: (P - 1) / (3M + P - 1). Every stage holds at most min(P, M)
micro-batches (from forward to W), the first stage's peak under 1F1B: the same peak memory, now
on every stage.
"""

from minimp.parallel.pipeline.schedules.actions import (BACKWARD_INPUT, BACKWARD_WEIGHT, FORWARD,
                                                       Action, Schedule, check_sizes)
from minimp.parallel.pipeline.schedules.dependencies import with_messages


def zb_h1(stages: int, micro_batches: int) -> Schedule:
    """Each stage's actions for one ZB-H1 step (B = backward_input, W = backward_weight)."""
    check_sizes(stages, micro_batches)
    computes = [_compute_order(stage, stages, micro_batches) for stage in range(stages)]
    return with_messages(computes, stages, 1)


def _compute_order(stage: int, stages: int, micro_batches: int) -> list[Action]:
    warmup = min(stages - stage - 1, micro_batches)  # 1F1B's warm-up forwards
    order = [Action(FORWARD, mb) for mb in range(warmup)]
    forward = warmup
    for backward in range(micro_batches):
        if forward < micro_batches:  # 1F1B's steady state: one forward, one backward
            order.append(Action(FORWARD, forward))
            forward += 1
        order.append(Action(BACKWARD_INPUT, backward))
        if backward - stage >= 0:  # W runs `stage` micro-batches late
            order.append(Action(BACKWARD_WEIGHT, backward - stage))
    late = range(max(0, micro_batches - stage), micro_batches)
    return order + [Action(BACKWARD_WEIGHT, mb) for mb in late]
