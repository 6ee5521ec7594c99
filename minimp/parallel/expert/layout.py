"""Which experts an expert-parallel rank holds, and how many parameters it keeps.

Rank r of an ep group holds experts r E/ep .. (r + 1) E/ep - 1 of every mixture (contiguous, as
Megatron-Core's): the rows a rank sends to one rank are then one contiguous run of its rows sorted
by expert. A rank keeps every dense parameter and E/ep of each mixture's experts:

    held parameters = dense + (E / ep) x per_expert x mixtures

(dense: every parameter outside the experts, routers included; per_expert: one expert's). Its
masters, gradients and optimizer state scale with it; tests/test_parallel_expert.py checks the
trainer's model_state_by_kind against it to the byte.
"""

import re

EXPERT_NAME = re.compile(r"(^|\.)experts\.(\d+)\.")  # "1.mlp.experts.3.c_fc.weight": expert 3


def expert_index(name: str) -> int | None:
    """The expert a parameter name belongs to (MoE's `experts` Sequential), None for a dense one."""
    match = EXPERT_NAME.search(name)
    return int(match.group(2)) if match else None


def local_experts(experts: int, ep: int, ep_rank: int) -> range:
    """The experts ep_rank holds: E/ep of them, contiguous."""
    if ep < 1 or experts % ep:
        raise ValueError(f"{experts} experts do not split over {ep} expert-parallel ranks (choose "
                         "an ep that divides the experts)")
    share = experts // ep
    return range(ep_rank * share, (ep_rank + 1) * share)


def held_parameters(dense: int, per_expert: int, experts: int, mixtures: int, ep: int) -> int:
    """dense + (E / ep) x per_expert x mixtures: the parameters one expert-parallel rank holds."""
    return dense + experts // ep * per_expert * mixtures


def memory_by_kind(dense: int, experts_held: int, dp: int, ep: int, compute_bytes: int,
                   slots: int, wire_bytes: int = 4) -> dict[str, int]:
    """The bytes one rank holds between steps with --ep (data parallelism, ZeRO's stage 0), by
    kind: P = dense + experts_held (held_parameters's two terms) parameters, each c bytes (the
    compute dtype) in the model, 4 in its float32 accumulator, 4 in its master (none when c = 4:
    the master is the compute copy), 4 k in the optimizer's k float32 slots; and the all-reduce's
    send and receive buffers, w bytes per element, for the dense parameters when dp > 1 and for
    the experts when dp/ep > 1 (alone in its expert group a rank sends nothing):

        buffers = 2 w (dense [dp > 1] + experts_held [dp/ep > 1])"""
    held = dense + experts_held
    buffered = dense * (dp > 1) + experts_held * (dp // ep > 1)
    return {"parameters": compute_bytes * held, "accumulators": 4 * held,
            "masters": 0 if compute_bytes == 4 else 4 * held, "optimizer_state": 4 * slots * held,
            "buffers": 2 * wire_bytes * buffered}
