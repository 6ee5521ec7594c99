"""Seconds one optimizer step takes for a layout: compute from FLOPs, then each communication.

FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM", section 5.1, Eq. 3, matrix products only): a block's forward on b rows is
24 b s h^2 (1 + s/(6h)), the logits' 2 b s h V; backward costs two forwards; full recomputation
runs every block's forward once more (not the logits'). With recomputation a step of B samples is
their 96 B s l h^2 (1 + s/(6h) + V/(16 l h)); without, 72 B s l h^2 (1 + s/(6h)) + 6 B s h V,
about the "6 N tokens" rule (N ~ 12 l h^2). A device computes its share, FLOPs / t, at
`Cluster.flops` (peak x achievable fraction), the same for every matrix shape; the logits' FLOPs
are not cut where the head is whole on every rank (minimp's: Job.vocabulary_parallel off).

Per micro-batch on pipeline stage i (l/P blocks; stage 0 the embeddings, the last the logits):
  forward    its FLOPs / (t x flops) + 2 tensor-parallel all-reduces of b s h d bytes per block
  backward   2x those FLOPs (+1x the blocks' with recomputation) + 2 all-reduces per block
             (+2 with recomputation: the rebuilt forward all-reduces again); ZeRO 2-3's
             reduce-scatter of the stage's gradients over dp, ZeRO 3's two all-gathers
Tensor-parallel collectives run over the intra-node network (tp stays inside a node); with
sequence parallelism each all-reduce is a reduce-scatter plus an all-gather of the same bytes
(Korthikanti et al. 2022, section 4.2.2). Nothing overlaps compute but the ring attention's hops
(below): minimp runs one thing at a time, and Megatron-LM in 2021 did not overlap these either.

The pipeline (1F1B or GPipe, same span): (M + P - 1) x (the slowest stage's forward + backward + 2
messages of b s h d bytes): the bubble of Huang et al. 2019, (P - 1)/(M + P - 1) of the step, and in
every micro-batch's slot one message each way, because 1F1B's exchanges block (minimp's Sendrecv
pairs, Megatron-LM's send_forward_recv_backward). With `simulate`, the span of
parallel/pipeline/simulator.py's `simulate_schedule` on the same per-stage costs instead, whose
sends do not block: shorter when messages are long (tests/test_plan.py). Messages cross nodes when
the job does (pipeline stages are the outermost dimension: Megatron-Core's order, tp, cp, dp,
pp).

Context parallelism over c ranks (the grid's cp, placed as inputs.py says): a rank computes 1/c of
every block's and the head's FLOPs (its s/c positions; attention's 4 b s^2 h split evenly: the
zig-zag shards give every ring rank the same causal work, Ulysses every rank a/c heads), and its
tensor-parallel all-reduces and pipeline messages carry b (s/c) h d bytes. Per block and
micro-batch, with n = b s h/(t c) values in a rank's q (B, a/t, s/c, h/a), on the network that
the group's c x tp consecutive devices span (intra-node when they fit in a node):
  ring     forward: c - 1 hops of k and v, 2n d bytes each (the hop's bytes are ring.py's
           `ring_bytes`), each sent before one ring step's attention (1/c of the rank's attention
           FLOPs) is computed, so a hop costs max(step, send): only costmodel's
           exposed_behind_compute, (c - 1) max(0, send - step), is added to the compute.
           Backward: c - 1 hops of k and v and of the previous step's float32 dK, dV (2n x 4 bytes)
           behind a step of backward attention (2x forward's), then the gradients' last hop home,
           behind nothing; with recomputation the rebuilt forward's hops again
  Ulysses  4 all-to-alls of n d bytes forward (q, k, v out, O back) and 4 backward (dO out, dq,
           dk, dv back), (c - 1)/c of each sent (ulysses.py's `ulysses_bytes`), none overlapped;
           4 more with recomputation
The attention FLOPs are Eq. 3's (the whole s x s, as one process computes it); the ring skips
blocks above the diagonal, Ulysses computes them masked: a hop's compute is taken as 1/c of the
former either way.

After the pipeline, each stage's gradients over its dp x cp group (the trainer's dp_cp_group),
on the intra-node network when the group fits in a node (dp x cp x tp <= GPUs per node), else
inter-node: ZeRO 0 a ring all-reduce of w-byte gradients, as one bucket; ZeRO 1 a reduce-scatter
and an all-gather of the d-byte compute copies; ZeRO 2 the all-gather; ZeRO 3 nothing
(parallel/zero/formulas.py has the bytes). On the fp8 wire (--grad-comm-dtype fp8) w is 1 and
every message carries its chunk's float32 scale too, ranks - 1 of them a ring collective: ZeRO
0's are the trainer's bytes to the byte where its gradients fit one bucket (--bucket-mb), and 8
(ranks - 1) bytes short for each bucket more; ZeRO 1-3's collectives are per unit, as the
trainer's. The tied token embedding
is all-reduced between the first and last stage (float32), and four scalar all-reduces span the
job (the overflow flag before and after the reduce, the gradient norm, the loss: what minimp's
metrics count per step on 4 ranks). Not counted: the optimizer's update, the vocabulary-
parallel embedding's and loss's small all-reduces, kernel launches, and data loading.
"""

import math
from dataclasses import dataclass

from minimp.distributed.alltoall import COUNT_BYTES
from minimp.measure.costmodel import exposed_behind_compute
from minimp.parallel.context.ring import ring_bytes
from minimp.parallel.context.ulysses import ulysses_bytes
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.pipeline.simulator import Costs, simulate_schedule
from minimp.plan.inputs import Cluster, Job, Layout, ModelShape
from minimp.plan.links import Links
from minimp.plan.memory import attention_shape, expert_units, stage_units, vocabulary_share
from minimp.precision.casting import ACTIVATION_DTYPES

# per step over the job: the overflow flag before and after the reduce, the norm, the loss
SCALAR_ALLREDUCES = 4
SCALAR_BYTES = 8
TIED_GRADIENT_BYTES = 4  # the tied embedding's gradient is all-reduced from float32 accumulators


def layer_forward_flops(model: ModelShape, rows: int) -> float:
    """One block's forward on `rows` samples: 24 b s h^2 + 4 b s^2 h = 24 b s h^2 (1 + s/(6h));
    with experts 8 b s h^2 + 4 b s^2 h + 2 b s h E + 4 K b s h f (module docstring)."""
    s, h = model.context, model.hidden
    if model.experts:
        mixture = 2 * rows * s * h * (model.experts + 2 * model.top_k * model.expert_width)
        return 8 * rows * s * h * h + attention_flops(model, rows) + mixture
    return 24 * rows * s * h * h + attention_flops(model, rows)


def attention_flops(model: ModelShape, rows: int) -> float:
    """Attention's part of a block's forward, q k^T and its product with v: 4 b s^2 h."""
    return 4 * rows * model.context * model.context * model.hidden


def logits_forward_flops(model: ModelShape, rows: int) -> float:
    """The head's forward on `rows` samples: 2 b s h V."""
    return 2 * rows * model.context * model.hidden * model.vocab


def step_flops(model: ModelShape, batch: int, recompute: bool) -> float:
    """A step's matrix-product FLOPs: 3 forwards (forward, backward = 2), +1 blocks' forward with
    recomputation (module docstring)."""
    blocks = model.layers * layer_forward_flops(model, batch)
    return 3 * (blocks + logits_forward_flops(model, batch)) + (blocks if recompute else 0.0)


def narayanan_flops(model: ModelShape, batch: int) -> float:
    """Narayanan et al. 2021's Eq. 3: 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    s, layers, h, v = model.context, model.layers, model.hidden, model.vocab
    return 96 * batch * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


@dataclass
class StepTime:
    """Predicted seconds of one step, by part (they add up to `total`)."""

    compute: float  # the slowest stage's forwards and backwards, M of each
    tensor_parallel: float  # its tensor-parallel collectives
    context_parallel: float  # its ring hops not hidden by compute, or its all-to-alls
    zero_in_step: float  # its ZeRO 2-3 collectives inside the micro-batches
    bubble: float  # the pipeline's fill and drain, and its messages
    data_parallel: float  # the gradients' collectives after the last backward
    other: float  # the tied embedding's all-reduce and the scalars
    expert_parallel: float = 0.0  # its experts' all-to-alls

    @property
    def total(self) -> float:
        parts = (self.compute, self.tensor_parallel, self.context_parallel, self.zero_in_step)
        return sum(parts) + self.bubble + self.data_parallel + self.other + self.expert_parallel


def _links(cluster: Cluster, group_span: int) -> Links:
    """The network a group of ranks spanning `group_span` consecutive devices uses."""
    return cluster.intra if group_span <= cluster.gpus_per_node else cluster.inter


def context_bytes(model: ModelShape, layout: Layout, job: Job) -> tuple[int, int]:
    """Bytes one rank sends in one block's attention on one micro-batch, forward and backward:
    ring.py's `ring_bytes` or ulysses.py's `ulysses_bytes` for the rank's q (module docstring);
    none at cp = 1."""
    if layout.cp == 1:
        return 0, 0
    formula = ring_bytes if layout.cp_mode == "ring" else ulysses_bytes
    sent = formula(attention_shape(model, layout), ACTIVATION_DTYPES[job.precision], layout.cp)
    return sent.forward, sent.backward


def context_step_bytes(model: ModelShape, layout: Layout, job: Job) -> int:
    """Bytes one rank sends to its context-parallel group in a step: context_bytes for each of
    its stage's l/P blocks and M micro-batches, the forward's twice with recomputation (what the
    trainer's metrics count per step in bytes_by_group.context_parallel)."""
    forward, backward = context_bytes(model, layout, job)
    per_block = forward * (1 + layout.recompute) + backward
    return model.layers // layout.pp * layout.micro_batches * per_block


def context_costs(model: ModelShape, cluster: Cluster, job: Job, layout: Layout):
    """(forward, backward) seconds of one block's context-parallel messages on one micro-batch
    that compute does not hide (module docstring)."""
    cp = layout.cp
    if cp == 1:
        return 0.0, 0.0
    links = _links(cluster, cp * layout.tp)
    if layout.cp_mode == "ulysses":  # 4 all-to-alls each way of a tensor of n d bytes
        tensor = math.prod(attention_shape(model, layout)) * job.compute_bytes
        forward = 4 * links.all_to_all(tensor, cp)
        return forward, forward * (1 + layout.recompute)
    forward_bytes, backward_bytes = context_bytes(model, layout, job)
    keys_values = forward_bytes / (cp - 1)  # a hop: k and v (c - 1 hops)
    gradients = (backward_bytes - forward_bytes) / cp  # a hop: float32 dK, dV (c hops)
    step = attention_flops(model, layout.micro_batch_size) / (layout.tp * cp) / cp / cluster.flops
    forward = exposed_behind_compute(links.send(keys_values), step, cp - 1)
    moving = links.send(keys_values) + links.send(gradients)
    backward = exposed_behind_compute(moving, 2 * step, cp - 1) + links.send(gradients)
    return forward, backward + (forward if layout.recompute else 0.0)


def expert_rows(model: ModelShape, layout: Layout) -> tuple[float, float]:
    """(rows, rows sent away) of one block's dispatch on one micro-batch of a rank: its N K
    (token, choice) rows, and (ep - 1)/ep of them (dropless, balanced; as many received)."""
    rows = layout.micro_batch_size * model.context / layout.cp * model.top_k
    return rows, rows * (layout.ep - 1) / layout.ep


def expert_bytes(model: ModelShape, layout: Layout, job: Job) -> tuple[float, float]:
    """Bytes one rank sends in one block's dispatch on one micro-batch, forward and backward:
    the counts, (ep - 1) (E/ep) int64s, then S rows out and R back of h x d bytes each (module
    docstring); none at ep = 1."""
    if layout.ep == 1:
        return 0.0, 0.0
    _, sent = expert_rows(model, layout)
    counts = (layout.ep - 1) * (model.experts // layout.ep) * COUNT_BYTES
    rows = 2 * sent * model.hidden * job.compute_bytes  # S out, R = S back
    return counts + rows, rows


def expert_costs(model: ModelShape, cluster: Cluster, job: Job, layout: Layout):
    """(forward, backward) seconds of one block's all-to-alls on one micro-batch (module
    docstring)."""
    ep = layout.ep
    if ep == 1:
        return 0.0, 0.0
    links = _links(cluster, ep * layout.cp * layout.tp)
    rows, _ = expert_rows(model, layout)
    counts = links.all_to_all(model.experts * COUNT_BYTES, ep)
    moved = 2 * links.all_to_all(rows * model.hidden * job.compute_bytes, ep)
    forward = counts + moved
    return forward, moved + (forward if layout.recompute else 0.0)


def stage_costs(model: ModelShape, cluster: Cluster, job: Job, layout: Layout, stage: int):
    """(compute, tensor-parallel, context-parallel, ZeRO, expert-parallel) seconds of one
    micro-batch's forward and of its backward on `stage`, as five (forward, backward) pairs."""
    rows, tp, dp, cp = layout.micro_batch_size, layout.tp, layout.dp, layout.cp
    blocks = model.layers // layout.pp
    block_flops = blocks * layer_forward_flops(model, rows)
    head = logits_forward_flops(model, rows) if stage == layout.pp - 1 else 0.0
    if not job.vocabulary_parallel:  # minimp: every tensor-parallel rank computes all logits
        head *= tp
    forward = (block_flops + head) / (tp * cp) / cluster.flops
    backward = 2 * forward + (block_flops / (tp * cp) / cluster.flops if layout.recompute else 0.0)

    intra = cluster.intra
    activation = rows * model.context / cp * model.hidden * job.compute_bytes
    if layout.sequence_parallel:
        one = intra.reduce_scatter(activation, tp) + intra.all_gather(activation, tp)
    else:
        one = intra.all_reduce(activation, tp)
    tp_forward = 2 * blocks * one
    tp_backward = (2 + 2 * layout.recompute) * blocks * one
    cp_forward, cp_backward = (blocks * part for part in context_costs(model, cluster, job, layout))

    dp_links = _links(cluster, tp * cp * dp)
    zero_forward = zero_backward = 0.0
    for units, ranks in gradient_groups(model, layout, job, stage):
        parameters = sum(units)
        if layout.zero >= 2:  # minimp reduce-scatters every micro-batch's gradients (formulas.py)
            scatter = wire_bytes(parameters, ranks, job, collectives=len(units))
            zero_backward += dp_links.reduce_scatter(scatter, ranks)
        if layout.zero == 3:  # and gathers each layer before its forward and before its backward
            gather = dp_links.all_gather(parameters * job.compute_bytes, ranks)
            zero_forward, zero_backward = zero_forward + gather, zero_backward + gather
    ep_forward, ep_backward = (blocks * part for part in expert_costs(model, cluster, job, layout))
    return ((forward, backward), (tp_forward, tp_backward), (cp_forward, cp_backward),
            (zero_forward, zero_backward), (ep_forward, ep_backward))


def gradient_groups(model: ModelShape, layout: Layout, job: Job, stage: int):
    """(units, ranks) of each group the stage's gradients are reduced over: the dense ones over
    dp x cp, and with ep > 1 the experts over (dp/ep) x cp (module docstring)."""
    groups = [(stage_units(model, layout, stage, job), layout.dp * layout.cp)]
    experts = expert_units(model, layout)
    if experts:
        groups.append((experts, layout.dp // layout.ep * layout.cp))
    return groups


def wire_bytes(elements: int, ranks: int, job: Job, collectives: int = 1) -> int:
    """The bytes of the messages that carry `elements` gradients, `collectives` units (or
    buckets) of them each cut into `ranks` chunks: every chunk's elements at grad_comm_bytes and,
    on the fp8 wire, its scale. A ring collective sends (ranks - 1)/ranks of them (a
    reduce-scatter; an all-reduce twice), so a link priced on these bytes pays ranks - 1 scales a
    collective, as formulas.py's bytes_sent_formula counts them (module docstring)."""
    return elements * job.grad_comm_bytes + collectives * ranks * job.grad_scale_bytes


def gradient_sync_seconds(model: ModelShape, cluster: Cluster, job: Job, layout: Layout) -> float:
    """The slowest stage's data-parallel collectives after the last backward, over its dp x cp
    ranks (module docstring)."""
    dp_links = _links(cluster, layout.tp * layout.cp * layout.dp)
    slowest = 0.0
    for stage in sorted({0, layout.pp - 1}):
        seconds = 0.0
        for units, ranks in gradient_groups(model, layout, job, stage):
            copies = sum(units) * job.compute_bytes
            if layout.zero == 0:  # one bucket (module docstring)
                seconds += dp_links.all_reduce(wire_bytes(sum(units), ranks, job), ranks)
            elif layout.zero == 1:
                scatter = wire_bytes(sum(units), ranks, job, collectives=len(units))
                seconds += dp_links.reduce_scatter(scatter, ranks) + dp_links.all_gather(copies,
                                                                                         ranks)
            elif layout.zero == 2:  # reduce-scattered during backward already
                seconds += dp_links.all_gather(copies, ranks)
            # stage 3: the update is on shards, nothing to gather
        slowest = max(slowest, seconds)
    return slowest


def step_time(model: ModelShape, cluster: Cluster, job: Job, layout: Layout,
              simulate: bool = False) -> StepTime:
    """Predicted seconds of one step, by part (module docstring)."""
    pp, micro_batches = layout.pp, layout.micro_batches
    costs = [stage_costs(model, cluster, job, layout, stage) for stage in range(pp)]
    per_stage = [sum(f + b for f, b in parts) for parts in costs]
    slowest = max(range(pp), key=lambda stage: per_stage[stage])
    # its compute, tensor-, context-parallel, ZeRO and expert-parallel seconds, M micro-batches
    compute, tensor_parallel, context_parallel, zero_in_step, expert_parallel = (
        micro_batches * (f + b) for f, b in costs[slowest])

    whole_job = _links(cluster, cluster.gpus)
    tokens = model.context / layout.cp  # a rank's positions of each sample
    activation = layout.micro_batch_size * tokens * model.hidden * job.compute_bytes
    message = whole_job.send(activation) if pp > 1 else 0.0
    if simulate and pp > 1:
        schedule = build_schedule(job.schedule, pp, micro_batches)
        forwards = [sum(parts[0] for parts in stage) for stage in costs]
        backwards = [sum(parts[1] for parts in stage) for stage in costs]
        span = simulate_schedule(schedule, Costs(forwards, backwards, message)).span
    else:
        span = (micro_batches + pp - 1) * (per_stage[slowest] + 2 * message)

    tied = 0.0
    if pp > 1:
        token = vocabulary_share(model, layout, job) * model.hidden
        tied = whole_job.all_reduce(token * TIED_GRADIENT_BYTES, 2)
    scalars = SCALAR_ALLREDUCES * whole_job.all_reduce(SCALAR_BYTES, cluster.gpus)
    return StepTime(
        compute, tensor_parallel, context_parallel, zero_in_step,
        bubble=span - micro_batches * per_stage[slowest],
        data_parallel=gradient_sync_seconds(model, cluster, job, layout), other=tied + scalars,
        expert_parallel=expert_parallel)
