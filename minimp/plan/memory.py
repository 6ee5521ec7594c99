"""Bytes one device holds for a layout: model states by ZeRO stage, activations kept for backward.

Parameters. A block holds 12h^2 + 13h; with tensor parallelism over t ranks (Megatron-LM, Shoeybi et
al. 2019) its four matrices and the biases of the column-split ones are cut in t, the row-split
biases (2h) and the LayerNorms (4h) are whole on every rank: 12h^2/t + 7h/t + 6h. The token
embedding is split over the vocabulary (V h / t; whole, V h, with minimp's replicated embedding:
Job.vocabulary_parallel), the position embedding is whole (s h). Pipeline stage 0 holds the
embeddings, the last stage the final LayerNorm (2h) and, when it is not stage 0, its own copy of the
tied token embedding (minimp/parallel/pipeline/tied.py; Megatron-LM does the same). ZeRO's units are
minimp's (train/sizes.py): one per block, the two embeddings apart.

Model states: minimp/parallel/zero/formulas.py's `memory_formula` over those units (parameters,
float32 gradient accumulators, masters, optimizer slots, all-reduce buffers, by stage and dp) and
its `peak_formula` for the 16-bit gradients alive inside a step: what minimp itself holds.

Activations per block and micro-batch of b rows, d bytes an activation (Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4; minimp's per-op count
in models/gpt.py `block_activation_bytes`):

  whole on every tp rank   4 d sbh (the LayerNorms' inputs, c_attn's and c_fc's) + 2 sbh masks
  split over t             12 d sbh (q, k, v, c_proj's input, GELU's input 4, mlp.c_proj's 4)
  attention, split over t  (2d + 1) as^2 b (softmax output, its dropout mask and output)
  LayerNorm statistics     16 sb (float32 mean and 1/std of two LayerNorms: minimp's, whole)

With d = 2 and dropout that is sbh (10 + 24/t + 5as/(ht)) + 16 sb; with sequence parallelism the
whole parts are cut in t too: sbh/t (34 + 5as/h) + 16 sb/t. Without dropout the masks go and the
softmax output is kept once: sbh (8 + 24/t) + 2as^2 b/t. Full recomputation keeps each block's
input (2 sbh in 16 bits; a sequence-parallel input is a slice, 2 sbh/t) and, during one block's
backward, that block's activations again.

Stage 0 also keeps the token ids and positions (int64) and the embedding's dropout mask; the last
stage keeps the final LayerNorm's input and statistics, the head's input, the logits (d sbV/t, or
d sbV on every rank where the head is whole) and the targets (int64): minimp's GPT, measured to
the byte by tests/test_plan.py at t = 1.

In flight: 1F1B (Narayanan et al. 2021) keeps min(P - i, M) micro-batches on stage i, so stage 0
keeps P of them (M if fewer); GPipe keeps all M on every stage. The device that needs most is stage
0 or the last one (the middle stages hold stage 0's blocks with fewer micro-batches).

Context parallelism over c ranks (minimp/parallel/context/, the trainer's --cp): each rank holds
s/c of every sample's positions, so every term above but attention's is of s/c positions (the
token ids, positions and logits too), and attention keeps, per block and micro-batch on a tp rank:

  one process (c = 1)  today's attention, the (2d + 1) a s^2 b/t above
  Ulysses              today's attention on a/(t c) heads of the whole sequence: (2d + 1) a s^2
                       b/(t c), 1/c of one process's (ulysses.py's `ulysses_memory`; its heads'
                       q, k, v are as many values as the 12 d sbh/t count at s/c positions)
  ring                 tiled attention, no s x s array: its output O as RingAttention keeps it,
                       (b, a/t, s/c, h/a), beside the copy c_proj keeps in (b, s/c, h) order,
                       and a float32 log-sum-exp of its a/t heads at s/c positions: d sbh/(t c)
                       + 4 a s b/(t c) (ring.py's `ring_memory` saved, less q, k, v: views of
                       c_attn's output, which the 12 d sbh/t count); with dropout priced as
                       FlashAttention runs it, the masks drawn again in backward, not kept
                       (minimp's trainer refuses dropout with --cp)

(without dropout the factor 2d + 1 is d, as above), and the ring adds, once per device (one
attention runs at a time), its in-flight buffers at their backward peak: two (k, v) blocks in
the activation dtype and two float32 (dK, dV), 2 x 2n (d + 4) with n = b s h/(t c)
(`ring_memory`'s backward_buffers). Model states: ZeRO shards over the dp x c ranks of a stage,
the group the trainer reduces the gradients over (parallel/apply.py's dp_cp_group).

A mixture of experts (inputs.py; tp = 1: minimp refuses --experts with --tp). A block holds
4h^2 + 8h + E h + E (2hf + f + h) (ModelShape.block_parameters). With ep > 1 a rank holds E/ep of
each mixture's experts (parallel/expert/layout.py's `held_parameters`), and its model states are
two of formulas.py's: the dense parameters (routers included) over the dp x cp ranks as above,
the E/ep experts of each block over the replicas holding the same experts, (dp/ep) x cp ranks
(ZeRO shards each group apart, with buffers of its own); at ZeRO 0 that is layout.py's
`memory_by_kind`. The 16-bit gradients' peak is peak_formula's over both groups' units. At ep = 1
a block is one unit, as the trainer's.

A mixture's activations per block and micro-batch replace the dense MLP's 9 d sbh (c_fc's input
d, GELU's 4d, mlp.c_proj's 4d; its dropout mask stays), with N = sb/c tokens on a rank and, the
routing dropless and balanced, N K (token, choice) rows through the experts (with ep > 1 a rank
computes as many rows for its experts as it sends away, so the count holds on every rank):

  per token   4h (the router's float32 input) + 12E (the float32 probabilities, kept by the
              softmax and again, a (B, T, E) view, by the load-balancing loss; log_softmax's
              output for the z-loss) + 8 (the gates' sum, the z-loss's logsumexp)
  per row     2d (h + f) (an expert's c_fc input and output, its GELU and c_proj inputs) + d
              (the row's gate) + 4 (the float32 chosen probability) + 40 (five int64 indices)
  per sample  4E (the load-balancing loss's float32 weights)
  per block   16 (four float32 scalars of the loss's coefficients) + 4Eh in 16 bits (the router
              weight's float32 copy)

which is what minimp's MoE block keeps, counted as `saved_bytes` counts (tests/test_plan.py).
"""

import math
from dataclasses import dataclass, field

from minimp.parallel.context.ring import ring_memory
from minimp.parallel.zero.formulas import memory_formula, peak_formula
from minimp.plan.inputs import Job, Layout, ModelShape
from minimp.precision.casting import ACTIVATION_DTYPES

INT64 = 8  # token ids, positions and targets are int64 arrays
LSE_BYTES = 4  # the ring's log-sum-exp per query row and head: float32 (ops/attention.py)


def layer_parameters(model: ModelShape, tp: int, ep: int = 1) -> int:
    """Parameters of one block on one tensor-parallel rank: 12h^2/t + 7h/t + 6h; with experts
    (t = 1) the whole block, less its experts when ep > 1 (they are `expert_units`)."""
    h = model.hidden
    if model.experts:
        experts = model.experts * model.expert_parameters() if ep > 1 else 0
        return model.block_parameters() - experts
    return math.ceil((12 * h * h + 7 * h) / tp) + 6 * h


def expert_units(model: ModelShape, layout: Layout) -> list[int]:
    """The units reduced over the replicas holding the same experts: with ep > 1, one per block
    of the stage, E/ep experts each; none otherwise."""
    if layout.ep == 1:
        return []
    held = model.experts // layout.ep * model.expert_parameters()
    return [held] * (model.layers // layout.pp)


def vocabulary_share(model: ModelShape, layout: Layout, job: Job) -> int:
    """Rows of the token table (and logits per position) one tensor-parallel rank holds."""
    return math.ceil(model.vocab / layout.tp) if job.vocabulary_parallel else model.vocab


def stage_units(model: ModelShape, layout: Layout, stage: int, job: Job = Job(1)) -> list[int]:
    """Sizes of ZeRO's units on one tensor-parallel rank of `stage` (train/sizes.py's with
    job.vocabulary_parallel off), reduced over the dp x cp ranks: with ep > 1, the experts
    apart (expert_units)."""
    first, last = stage == 0, stage == layout.pp - 1
    token = vocabulary_share(model, layout, job) * model.hidden
    units = [token, model.context * model.hidden] if first else []
    units += [layer_parameters(model, layout.tp, layout.ep)] * (model.layers // layout.pp)
    if last:
        units += [2 * model.hidden] + ([] if first else [token])
    return units


def model_state_bytes(model: ModelShape, layout: Layout, job: Job, stage: int) -> dict[str, int]:
    """{kind: bytes} of formulas.memory_formula for rank 0 of the stage's dp x cp group (the
    largest chunks), and with ep > 1 of its (dp/ep) x cp expert group, plus `gradients16`: the
    16-bit gradients at the peak inside a step (module docstring)."""
    units, experts = stage_units(model, layout, stage, job), expert_units(model, layout)
    held = memory_formula(layout.zero, unit_sizes=units, rank=0, world_size=layout.dp * layout.cp,
                          compute_bytes=job.compute_bytes, wire_bytes=job.grad_buffer_bytes,
                          slots=job.slots, expert_unit_sizes=experts,
                          expert_world_size=layout.dp // layout.ep * layout.cp)
    held["gradients16"] = peak_formula(layout.zero, unit_sizes=units + experts,
                                       compute_bytes=job.compute_bytes)
    return held


def attention_bytes(model: ModelShape, rows: int, d: int, cp: int = 1,
                    cp_mode: str = "ring") -> float:
    """What attention keeps beyond q, k, v and c_proj's input, over all heads (a tp rank keeps
    1/t): the probabilities of today's attention, or the ring's output and log-sum-exp (module
    docstring)."""
    s, a = model.context, model.heads
    if cp > 1 and cp_mode == "ring":
        return (d * model.hidden + LSE_BYTES * a) * s * rows / cp
    return ((2 * d + 1) if model.dropout else d) * a * s * s * rows / cp


def layer_activation_bytes(model: ModelShape, rows: int, d: int, tp: int, sp: bool, cp: int = 1,
                           cp_mode: str = "ring") -> float:
    """Bytes one block keeps for backward on one tp rank of a cp group (the table in the module
    docstring)."""
    s, h = model.context / cp, model.hidden  # the positions this rank holds
    sbh = s * rows * h
    whole = float(4 * d * sbh + (2 * sbh if model.dropout else 0))
    split = 12 * d * sbh
    attention = attention_bytes(model, rows, d, cp, cp_mode)
    statistics = float(2 * 2 * max(d, 4) * s * rows)
    if sp:
        whole, statistics = whole / tp, statistics / tp
    if model.experts:  # t = 1: the mixture's instead of the dense MLP's 9 d sbh
        mixture = mixture_bytes(model, rows, d, cp) - 9 * d * sbh
        return whole + split + attention + statistics + mixture
    return whole + (split + attention) / tp + statistics


def mixture_bytes(model: ModelShape, rows: int, d: int, cp: int = 1) -> float:
    """What a mixture of experts keeps for backward on one rank for one block (the table in the
    module docstring): N = b s/c tokens, N K rows, dropless and balanced."""
    h, f, experts = model.hidden, model.expert_width, model.experts
    tokens = rows * model.context / cp
    per_token = 4 * h + 12 * experts + 8
    per_row = 2 * d * (h + f) + d + 4 + 5 * INT64
    router_copy = 4 * experts * h if d < 4 else 0
    return (tokens * per_token + tokens * model.top_k * per_row + 4 * experts * rows + 16
            + router_copy)

def stored_layer_bytes(model: ModelShape, layout: Layout, d: int) -> float:
    """What one block keeps per micro-batch: everything, or its input alone with recomputation."""
    rows, tp, sp = layout.micro_batch_size, layout.tp, layout.sequence_parallel
    if layout.recompute:
        return d * model.context / layout.cp * rows * model.hidden / (tp if sp else 1)
    return layer_activation_bytes(model, rows, d, tp, sp, layout.cp, layout.cp_mode)


def attention_shape(model: ModelShape, layout: Layout) -> tuple[int, int, int, int]:
    """A rank's q in context-parallel attention, (b, a/t, s/c, h/a): what ring.py's and
    ulysses.py's formulas take (the search's rules make every division whole)."""
    return (layout.micro_batch_size, model.heads // layout.tp, model.context // layout.cp,
            model.hidden // model.heads)


def ring_buffer_bytes(model: ModelShape, layout: Layout, job: Job) -> int:
    """The ring's in-flight buffers at their backward peak, 2 x 2n (d + 4) (module docstring):
    ring.py's own formula; none without a ring."""
    if layout.cp == 1 or layout.cp_mode != "ring":
        return 0
    dtype = ACTIVATION_DTYPES[job.precision]
    return ring_memory(attention_shape(model, layout), dtype, layout.cp).backward_buffers


def embedding_bytes(model: ModelShape, layout: Layout) -> float:
    """Stage 0's own: token ids and positions (int64) and the embedding's dropout mask, of the
    s/c positions a rank holds."""
    s, rows = model.context / layout.cp, layout.micro_batch_size
    mask = s * rows * model.hidden if model.dropout else 0
    return INT64 * s * rows + INT64 * s + mask / (layout.tp if layout.sequence_parallel else 1)


def head_bytes(model: ModelShape, layout: Layout, job: Job) -> float:
    """The last stage's own: ln_f's input and statistics, the head's input, logits, targets, of
    the s/c positions a rank holds."""
    s, rows, h = model.context / layout.cp, layout.micro_batch_size, model.hidden
    d = job.compute_bytes
    slice_ = layout.tp if layout.sequence_parallel else 1
    inputs = (2 * d * h + 2 * max(d, 4)) / slice_
    vocabulary = model.vocab / layout.tp if job.vocabulary_parallel else model.vocab
    return s * rows * (inputs + d * vocabulary + INT64)


def in_flight(layout: Layout, stage: int, schedule: str) -> int:
    """Micro-batches whose activations a stage holds at once (see the module docstring): those
    whose forwards run before its first backward, P - i of them in 1F1B and all M in GPipe."""
    before_first_backward = {"1f1b": layout.pp - stage, "gpipe": layout.micro_batches}[schedule]
    return min(before_first_backward, layout.micro_batches)


def activation_bytes(model: ModelShape, layout: Layout, job: Job, stage: int) -> float:
    """Bytes kept for backward at the stage's peak: its in-flight micro-batches, with
    recomputation one block's activations rebuilt during its backward, and the ring's buffers."""
    d = job.compute_bytes
    per_micro_batch = model.layers // layout.pp * stored_layer_bytes(model, layout, d)
    if stage == 0:
        per_micro_batch += embedding_bytes(model, layout)
    if stage == layout.pp - 1:
        per_micro_batch += head_bytes(model, layout, job)
    rebuilt = 0.0
    if layout.recompute:
        rows, sp = layout.micro_batch_size, layout.sequence_parallel
        rebuilt = layer_activation_bytes(model, rows, d, layout.tp, sp, layout.cp, layout.cp_mode)
    buffers = ring_buffer_bytes(model, layout, job)
    return in_flight(layout, stage, job.schedule) * per_micro_batch + rebuilt + buffers


@dataclass
class Memory:
    """One device's bytes at its peak: by kind, and the stage whose device needs most."""

    stage: int
    by_kind: dict[str, float] = field(default_factory=dict)

    @property
    def total(self) -> float:
        return sum(self.by_kind.values())


def memory_per_device(model: ModelShape, layout: Layout, job: Job) -> Memory:
    """The most any device of the layout holds: stage 0's or the last stage's."""
    candidates = []
    for stage in sorted({0, layout.pp - 1}):
        by_kind: dict[str, float] = dict(model_state_bytes(model, layout, job, stage))
        by_kind["activations"] = activation_bytes(model, layout, job, stage)
        candidates.append(Memory(stage, by_kind))
    return max(candidates, key=lambda memory: memory.total)
