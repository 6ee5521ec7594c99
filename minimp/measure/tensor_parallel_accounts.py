"""What tensor parallelism costs a rank, by formula: bytes sent per step in the tensor-parallel and
pipeline groups, and bytes a GPT block keeps for backward, beside Korthikanti et al.'s.

Bytes sent. A ring all-reduce of n elements of d bytes over t ranks sends 2 (t - 1)/t n d from each
rank; its halves, a reduce-scatter and an all-gather, (t - 1)/t n d each (exact when t divides n).
Per block and micro-batch of b rows of s positions, width h: two all-reduces of b s h in forward
(g, after attention and after the MLP) and two in backward (f, in front of the column layers):

    8 (t - 1)/t b s h d                                   with or without sequence parallelism

(sequence parallelism: two all-gathers and two reduce-scatters each way, the same bytes). With
--recompute each block's forward, and its collectives, runs again in backward: 4 (t - 1)/t b s h d
more. Sequence parallelism also gathers the sequence once before the head (forward) and once after
the embeddings' split (backward), (t - 1)/t b s h d each, and sums the partial gradients of each
block's 6 whole h-vectors (2 LayerNorms, 2 row biases) once a step in float32: 48 (t - 1)/t h.

Bytes kept for backward by one block, d bytes an activation, a heads, with dropout (see
models/gpt.block_activation_bytes for the ops; masks are 1 byte, LayerNorm statistics float32):

    tp:       (4 d + 2) s b h + 12 d s b h/t + (2 d + 1) a s^2 b/t + 16 s b
    tp + sp:  2 d s b h + (14 d + 2) s b h/t + (2 d + 1) a s^2 b/t + 16 s b/t

With d = 2 the first is Korthikanti et al.'s sbh (10 + 24/t + 5as/(ht)) plus the statistics. The
second exceeds their sbh/t (34 + 5as/h) by 4 s b h (1 - 1/t) (plus the statistics, 16 sb/t): minimp
keeps the whole gathered input of the two column-parallel Linears (2 d s b h), where Megatron-LM
keeps this rank's slice and all-gathers it again in backward (one more all-gather per Linear).
"""

import numpy as np
from numpy.typing import DTypeLike


def ring_fraction(ranks: int) -> float:
    """(t - 1)/t: the share of an array each rank sends in a reduce-scatter or an all-gather."""
    return (ranks - 1) / ranks


def gpt_tensor_parallel_bytes(*, blocks: int, rows: int, context: int, width: int, tp: int,
                              micro_batches: int, compute_bytes: int,
                              sequence_parallel: bool = False, first_stage: bool = True,
                              last_stage: bool = True, recompute: bool = False) -> int:
    """Bytes one rank sends in its tensor-parallel group in one GPT step: `blocks` on its stage,
    `rows` per micro-batch (see the module docstring)."""
    if tp == 1:
        return 0
    activation = rows * context * width * compute_bytes  # b s h d
    halves = 8 + (4 if recompute else 0)  # reduce-scatters + all-gathers per block, micro-batch
    if sequence_parallel:
        halves_outside = int(first_stage) + int(last_stage)  # embeddings' backward, head's forward
        total = micro_batches * (blocks * halves + halves_outside) * activation
        partial_gradients = blocks * 6 * width * 4 * 2  # both halves of an all-reduce, float32
        return round((total + partial_gradients) * ring_fraction(tp))
    return round(micro_batches * blocks * halves * activation * ring_fraction(tp))


def mlp_tensor_parallel_bytes(*, pairs: list[tuple[int, int]], rows: int, tp: int,
                              micro_batches: int, compute_bytes: int,
                              first_input_is_data: bool) -> int:
    """Bytes one rank sends in its tensor-parallel group in one MLP step. pairs: (inputs,
    outputs) of each column -> row pair on its stage; a pair's output is all-reduced forward and
    its input's gradient backward, except the data's (nothing asks for that gradient)."""
    if tp == 1:
        return 0
    elements = 0
    for index, (inputs, outputs) in enumerate(pairs):
        backward = 0 if index == 0 and first_input_is_data else inputs
        elements += outputs + backward
    all_reduces = micro_batches * rows * elements * compute_bytes
    return round(2 * all_reduces * ring_fraction(tp))


def pipeline_bytes(*, activation: int, micro_batches: int, first_stage: bool,
                   last_stage: bool) -> int:
    """Bytes one rank sends to its pipeline neighbours in one step: each micro-batch's activation
    forward (unless last) and its gradient backward (unless first); `activation` in bytes (with
    sequence parallelism a rank's slice, 1/tp of the whole)."""
    return micro_batches * activation * ((not last_stage) + (not first_stage))


def block_activation_bytes_tp(s: int, b: int, h: int, a: int, dtype: DTypeLike, tp: int,
                              sequence_parallel: bool = False, dropout: bool = True) -> int:
    """Bytes one tensor-parallel rank's share of a GPT block keeps for backward (the docstring's
    formulas; without dropout no masks are kept, and the product with v keeps the softmax)."""
    d = np.dtype(dtype).itemsize
    masks = 2 if dropout else 0  # the two residual dropouts' masks, 1 byte an element
    attention = ((2 * d + 1) if dropout else d) * a * s * s * b // tp
    statistics = 2 * 2 * max(d, 4) * s * b  # 2 LayerNorms x (mean, 1/std), float32 at least
    split = 12 * d * s * b * h // tp  # q, k, v, the attention's output, the MLP's 4h twice
    if sequence_parallel:  # LayerNorm inputs, masks and statistics on 1/tp of the positions
        whole = 2 * d * s * b * h  # the two column layers' gathered inputs
        return whole + split + (2 * d + masks) * s * b * h // tp + attention + statistics // tp
    return (4 * d + masks) * s * b * h + split + attention + statistics


def korthikanti_bytes(s: int, b: int, h: int, a: int, tp: int, sequence_parallel: bool) -> float:
    """Korthikanti et al. 2022, section 4.2 (16-bit activations, dropout): sbh (10 + 24/t +
    5as/(ht)) with tensor parallelism, sbh/t (34 + 5as/h) with sequence parallelism too."""
    if sequence_parallel:
        return s * b * h / tp * (34 + 5 * a * s / h)
    return s * b * h * (10 + 24 / tp + 5 * a * s / (h * tp))
