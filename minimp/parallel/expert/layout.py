"""Which experts an expert-parallel rank holds, and how many parameters it keeps.

Rank r of an ep group holds experts r E/ep .. (r + 1) E/ep - 1 of every mixture (contiguous, as
Megatron-Core's): the rows a rank sends to one rank are then one contiguous run of its rows sorted
by expert. A rank keeps every dense parameter and E/ep of each mixture's experts:

    held parameters = dense + (E / ep) x per_expert x mixtures

(dense: every parameter outside the experts, routers included; per_expert: one expert's). Its
masters, gradients and optimizer state scale with it; with ZeRO (--zero 1-3) the dense ones are
sharded over the dp replicas and the experts over the dp/ep replicas holding the same ones
(minimp/parallel/zero/data_parallel.py), so a rank's share is ZeRO's table with two groups
(`memory_by_kind`), and so are the bytes its collectives send (`zero_bytes_sent`).
tests/test_train_moe.py and tests/test_train_moe_zero.py check the trainer's model_state_by_kind
and bytes against them to the byte, every step.
"""

import re

from minimp.parallel.zero.formulas import bytes_sent_formula, memory_formula

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


def memory_by_kind(dense: list[int], experts: list[int], dp: int, ep: int, dp_rank: int, *,
                   compute_bytes: int, slots: int, wire_bytes: int = 4,
                   zero: int = 0) -> dict[str, int]:
    """The bytes one rank (dp_rank of the dp replicas) holds between steps with --ep, by kind.
    dense and experts: ZeRO's units of each kind (zero/layout.py; stage 0 needs only their
    totals, held_parameters's two terms). Stage 0: P = dense + experts parameters, each c bytes
    (the compute dtype) in the model, 4 in its float32 accumulator, 4 in its master (none when
    c = 4: the master is the compute copy), 4 k in the optimizer's k float32 slots; and the
    all-reduce's send and receive buffers, w bytes per element, for the dense parameters when
    dp > 1 and for the experts when dp/ep > 1 (alone in its expert group a rank sends nothing):

        buffers = 2 w (sum(dense) [dp > 1] + sum(experts) [dp/ep > 1])

    Stages 1-3: ZeRO's table (zero/formulas.py) with the dense units cut over the dp replicas
    and the expert units over the dp/ep holding the same experts (this rank dp_rank // ep)."""
    return memory_formula(zero, unit_sizes=dense, rank=dp_rank, world_size=dp,
                          compute_bytes=compute_bytes, wire_bytes=wire_bytes, slots=slots,
                          expert_unit_sizes=experts, expert_rank=dp_rank // ep,
                          expert_world_size=dp // ep)


def zero_bytes_sent(zero: int, dense: list[int], experts: list[int], dp: int, ep: int,
                    dp_rank: int, *, micro_batches: int, compute_bytes: int, wire_bytes: int,
                    readers: list[int] | None = None) -> dict[str, int]:
    """The bytes one rank sends in a step of ZeRO stage 1-3 with --ep, by collective: the dense
    units' reduce_scatter and all_gather over the dp replicas (bytes_by_group's data_parallel),
    the expert units' expert_reduce_scatter and expert_all_gather over the dp/ep holding the same
    experts (expert_data_parallel; none when ep = dp). readers: how many layers read each dense
    unit (stage 3; an expert unit is read by its block alone). Stage 0 with each kind's buckets
    for units: all_reduce and expert_all_reduce. Without --ep (ep = 1) the experts travel with
    the replicas: their units are among the dense ones, and experts is empty."""
    sent = bytes_sent_formula(zero, sizes=dense, rank=dp_rank, world_size=dp, readers=readers,
                              micro_batches=micro_batches, compute_bytes=compute_bytes,
                              wire_bytes=wire_bytes)
    if not experts:
        return sent
    expert = bytes_sent_formula(zero, sizes=experts, rank=dp_rank // ep, world_size=dp // ep,
                                micro_batches=micro_batches, compute_bytes=compute_bytes,
                                wire_bytes=wire_bytes)
    return {**sent, **{"expert_" + name: count for name, count in expert.items()}}
