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
