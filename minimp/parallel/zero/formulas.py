"""What each ZeRO stage holds and sends, by formula: the numbers the measured accounts must equal.

Memory, per rank r with N replicas, P parameters in its pipeline stage, S_r the elements of its
chunks (minimp/parallel/zero/layout.py), c the compute dtype's bytes, k the optimizer's float32
slots (Adam 2, SGD with momentum 1), w the gradient wire's bytes (stage 0 is plain data
parallelism):

  kind            stage 0            stage 1            stage 2            stage 3
  parameters      c P                c P                c P                c S_r
  accumulators    4 P                4 P                4 S_r              4 S_r
  masters         4 P (0 if c = 4)   4 S_r              4 S_r              4 S_r (0 if c = 4)
  optimizer       4 k P              4 k S_r            4 k S_r            4 k S_r
  buffers         2 w P              (2 w + c) U        (2 w + c) U        2 w U

(U: the largest unit; no buffers when N = 1.) A float32 master vanishes where it is the compute
copy: where the compute copies and the masters cover the same elements (stages 0 and 3). Per
parameter, with S_r = P/N, fp16 and Adam, that is 18, 6 + 12/N, 2 + 16/N and 18/N bytes, where
ZeRO's paper (section 3.1, Adam in fp16) has 16, 4 + 12/N, 2 + 14/N and 16/N: minimp's gradients
are float32 accumulators (4 bytes, where the paper keeps fp16 gradients: 2), held between steps.
The 16-bit gradient backward writes is freed as soon as it is added into them, so it lives inside
a step only, with stage 3's gathered layers and the activations; the peak inside a step is
measured apart (minimp/measure/accounts.py's `PeakMemory`, `peak_formula` here): c P more in
stages 0-1 (every 16-bit gradient, at the end of backward), c U in stage 2 (one layer's), 2 c U in
stage 3 (and that layer gathered).

With a mixture's experts in a group of their own (--ep: the N_e = dp/ep replicas holding the same
experts, zero/data_parallel.py), S_r adds this rank's chunks of the expert units cut over N_e, P
counts them once, U is the largest unit whose group has more than one rank, and stage 0's buffers
hold the dense parameters when N > 1 and the experts when N_e > 1: `memory_formula`'s expert_*
arguments.

Bytes sent per step by rank r, ring collectives over units of s_u elements whose chunk r has c_u(r)
elements (a ring reduce-scatter sends every chunk but its own, an all-gather every chunk but its
right neighbour's), M micro-batches, g_u the layers that read unit u:

  stage 0   all-reduce of each bucket: sum (s - c(r)) w + (s - c(r + 1)) w
  stage 1   one reduce-scatter (w) + one all-gather of the compute copies (c)
  stage 2   M reduce-scatters, one per micro-batch (w) + one all-gather (c)
  stage 3   M reduce-scatters (w) + M (g_u + 1) all-gathers (c): before each layer's forward
            and once before the backward

(the expert units' over their own group: the same formula with N_e and this rank's place there,
counted as expert_reduce_scatter and expert_all_gather).

On the fp8 wire (--grad-comm-dtype fp8, and --param-gather-dtype fp8 for stage 3's all-gathers,
minimp/distributed/ring_fp8.py) w (or c) is 1 and every message also carries its chunk's float32
scale: 4 bytes more for each of a ring collective's N - 1 messages, so 2 (N - 1) 4 more per bucket
of stage 0 and (N - 1) 4 more per unit's reduce-scatter or all-gather (`scale_bytes`,
`gather_scale_bytes`).

With even chunks that is ZeRO's 2 (N - 1)/N P elements (stages 0-2) and 3 (N - 1)/N P (stage 3).
Stage 2 reduce-scatters every micro-batch, (M + 1)(N - 1)/N P elements: reducing once, on the
last, would need a whole float32 accumulator until then, which is stage 1. Scalar all-reduces
(overflow flag, norm, loss) are counted apart, as calls.

Every formula takes the stage as a ZeroStage or as its number (--zero).
"""

from typing import Sequence

from minimp.distributed.ring import chunk_bounds
from minimp.parallel.zero.stages import ZeroStage, zero_stage


def chunk_sizes(sizes: list[int], rank: int, world_size: int) -> list[int]:
    """How many elements of each unit (or bucket) rank holds: its chunk_bounds chunk."""
    return [stop - start for start, stop in (chunk_bounds(s, world_size)[rank] for s in sizes)]


def memory_formula(stage: ZeroStage | int, *, unit_sizes: list[int], rank: int, world_size: int,
                   compute_bytes: int, wire_bytes: int, slots: int,
                   expert_unit_sizes: Sequence[int] = (), expert_rank: int = 0,
                   expert_world_size: int = 1) -> dict[str, int]:
    """The table above, in bytes, for one rank (stage 0's buckets hold P elements in all); the
    expert units, if any, cut over expert_world_size ranks, this one expert_rank of them."""
    stage = zero_stage(stage)
    groups = [(unit_sizes, rank, world_size), (expert_unit_sizes, expert_rank, expert_world_size)]
    total = sum(unit_sizes) + sum(expert_unit_sizes)
    shard = sum(sum(chunk_sizes(list(sizes), r, n)) for sizes, r, n in groups)
    held = shard if stage.shards_optimizer_state else total
    travelling = [size for sizes, _, n in groups if n > 1 for size in sizes]
    c, w = compute_bytes, wire_bytes
    master_is_compute_copy = c == 4 and stage.shards_parameters == stage.shards_optimizer_state
    if not stage.shards_optimizer_state:
        buffers = 2 * w * sum(travelling)  # the buckets' send and receive buffers
    else:  # one unit's reduce-scatter buffers (and, but in stage 3, its all-gather buffer)
        buffers = (2 * w + (0 if stage.shards_parameters else c)) * max(travelling, default=0)
    return {
        "parameters": c * (shard if stage.shards_parameters else total),
        "gradients": 0,
        "accumulators": 4 * (shard if stage.shards_gradients else total),
        "masters": 0 if master_is_compute_copy else 4 * held,
        "optimizer_state": 4 * slots * held,
        "buffers": buffers,
        "gathered": 0,
    }


def peak_formula(stage: ZeroStage | int, *, unit_sizes: list[int], compute_bytes: int) -> int:
    """Bytes held above `memory_formula`'s at the peak inside a step, for models whose units are
    each read by one layer (the MLP): stages 0-1 hold every 16-bit gradient at the end of
    backward, c P; stage 2 one unit's, reduce-scattered as soon as backward completes it, c U;
    stage 3 that and the same unit gathered for its backward, 2 c U."""
    stage = zero_stage(stage)
    largest, c = max(unit_sizes, default=0), compute_bytes
    if not stage.shards_gradients:
        return c * sum(unit_sizes)
    return c * largest * (2 if stage.shards_parameters else 1)


def bytes_sent_formula(stage: ZeroStage | int, *, sizes: list[int], rank: int, world_size: int,
                       micro_batches: int, compute_bytes: int, wire_bytes: int,
                       readers: list[int] | None = None, scale_bytes: int = 0,
                       gather_scale_bytes: int = 0) -> dict[str, int]:
    """Bytes rank sends in one step that is not skipped, by collective. sizes: stage 0's
    buckets, or ZeRO's units; readers: how many layers read each unit (stage 3); scale_bytes,
    gather_scale_bytes: what each message of the gradients' (the parameters') collectives carries
    besides its elements (4 on the fp8 wire: its scale)."""
    stage = zero_stage(stage)
    if world_size == 1:
        return {}
    own = chunk_sizes(sizes, rank, world_size)
    right = chunk_sizes(sizes, (rank + 1) % world_size, world_size)
    scatter = sum(s - o for s, o in zip(sizes, own))  # elements: every chunk but its own
    gather = [s - n for s, n in zip(sizes, right)]  # every chunk but its right neighbour's
    m, c, w = micro_batches, compute_bytes, wire_bytes
    # each ring collective over a unit (or bucket) sends N - 1 messages, each with its scale
    scales, gather_scales = (world_size - 1) * scale_bytes, (world_size - 1) * gather_scale_bytes
    if not stage.shards_optimizer_state:
        return {"all_reduce": (scatter + sum(gather)) * w + 2 * scales * len(sizes)}
    scatter_bytes = scatter * w + scales * len(sizes)
    if stage.shards_parameters:
        readers = readers or [1] * len(sizes)
        gathers = sum((g + 1) * (n * c + gather_scales) for g, n in zip(readers, gather))
        return {"reduce_scatter": m * scatter_bytes, "all_gather": m * gathers}
    times = m if stage.shards_gradients else 1
    return {"reduce_scatter": times * scatter_bytes, "all_gather": sum(gather) * c}


def per_parameter(stage: ZeroStage | int, world_size: int, compute_bytes: int = 2,
                  slots: int = 2) -> float:
    """minimp's bytes per parameter held by each rank (model states, even shards, no buffers)."""
    c, k, n = compute_bytes, 4 * slots, world_size
    masters = 0 if c == 4 else 4
    return {
        0: c + 4 + masters + k,
        1: c + 4 + (4 + k) / n,
        2: c + (4 + 4 + k) / n,
        3: (c + 4 + masters + k) / n,
    }[zero_stage(stage).number]


def paper_per_parameter(stage: ZeroStage | int, world_size: int,
                        optimizer_bytes: int = 12) -> float:
    """ZeRO's bytes per parameter (section 5.1: fp16 parameters and gradients, K = 12 bytes of
    Adam state and fp32 masters): 2 + 2 + K, 2 + 2 + K/N, 2 + (2 + K)/N, (2 + 2 + K)/N."""
    k, n = optimizer_bytes, world_size
    return {0: 4 + k, 1: 4 + k / n, 2: 2 + (2 + k) / n, 3: (4 + k) / n}[zero_stage(stage).number]
