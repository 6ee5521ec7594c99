"""Causal attention tiled over key/value chunks with an online softmax (FlashAttention), never
holding the T x T probabilities.

q, k and v are (B, H, T, D); the sequence is cut into chunks of c positions. Each query chunk keeps
a running row maximum m, a running sum l and an accumulator (all float32) and merges one key/value
chunk at a time (Milakov and Gimelshein 2018; Dao et al. 2022, FlashAttention, Algorithm 1):

    s = scale * (q k^T)                          the block's scaled scores
    m' = max(m, rowmax(s))
    l' = l e^(m - m') + rowsum(e^(s - m'))
    acc' = acc e^(m - m') + e^(s - m') v

and the output is acc / l, rounded once into the activation dtype. Forward keeps q, k, v, the
output and the log-sum-exp lse = m + log l (float32, one per query) for backward: B H T (4 D + 4)
bytes in float32 instead of the B H T^2 probabilities. Backward (FlashAttention-2, Dao 2023,
Algorithm 2) recomputes each block's probabilities from lse: with delta = rowsum(dO * O),

    P = e^(s - lse),  dV += P^T dO,  dP = dO V^T,  dS = P (dP - delta),
    dQ += scale dS K,  dK += scale dS^T Q

all in float32, rounded once at the end. Causality by global chunk index: a key chunk after the
query chunk is never visited, the query's own chunk is masked within (a position sees itself, so
no row is ever fully masked), an earlier one is not masked at all.

Numerics follow today's attention (minimp/models/gpt.py): the scores q k^T are a product with
float32 sums rounded once into the activation dtype (what `q @ k^T` gives, minimp/ops/linalg.py),
and the scale, exp, sums and merges run in float32 (minimp/ops/softmax.py says why). The
probabilities stay float32 in the products with v and dO, whose results go straight into the
float32 accumulators: no 16-bit rounding in between (FlashAttention rounds P to 16 bits for the
tensor core; a float32 P is the more accurate choice the CPU affords).

The merge is not associative in floating point: the ORDER in which a query chunk visits its key
chunks is part of the result, so it is an argument. `forward_block` and `backward_block` are the
per-block steps; ring attention (minimp/parallel/context/ring.py) calls the very same functions on
the same chunk shapes, so in the ring's order the tiled output equals the ring's bit for bit.
"""

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from minimp import backend
from minimp.backend import Array, array_module
from minimp.function import Context, Function
from minimp.ops.linalg import gemm_operand, pooled_matmul
from minimp.precision.casting import ACCUMULATE_DTYPE, result_dtype, round_to, widen


def accumulate_dtype(dtype: np.dtype) -> np.dtype:
    """Where the online softmax runs: float32 for 16- and 32-bit inputs, float64 for float64 (the
    gradient checks)."""
    return result_dtype(dtype, ACCUMULATE_DTYPE)


def chunk(x: Array, index: int, size: int) -> Array:
    """Positions index*size .. (index+1)*size of x (..., T, D), as a C-contiguous array: every
    block product then reads the same memory layout, in the tiled op and in the ring alike."""
    return array_module(x).ascontiguousarray(x[..., index * size:(index + 1) * size, :])


def block_scores(q: Array, k: Array, scale: float, diagonal: bool) -> Array:
    """scale * (q k^T) for one (query chunk, key chunk) block, (B, H, c, c) in the accumulate
    dtype: the product rounded once into q's dtype first, as `q @ k^T` is; on a diagonal block
    the keys after each query are -inf."""
    xp = array_module(q)
    product = pooled_matmul(gemm_operand(q), gemm_operand(k).swapaxes(-1, -2))  # float32 sums
    scores = widen(round_to(product, q.dtype)) * scale  # the scale in float32, as the softmax does
    if diagonal:
        keep = xp.tri(q.shape[-2], k.shape[-2], dtype=bool)
        xp.copyto(scores, scores.dtype.type(-np.inf), where=~keep)
    return scores


@dataclass
class OnlineSoftmax:
    """One query chunk's running state: row_max m and row_sum l, (B, H, c, 1) each, and the
    accumulator acc, (B, H, c, D), all in the accumulate dtype (float32 for 16-bit inputs)."""

    row_max: Array
    row_sum: Array
    accumulator: Array

    @classmethod
    def start(cls, q: Array) -> "OnlineSoftmax":
        """The state before the first block: m = -inf, l = 0, acc = 0."""
        xp, dtype = array_module(q), accumulate_dtype(q.dtype)
        rows = (*q.shape[:-1], 1)
        return cls(xp.full(rows, -np.inf, dtype), xp.zeros(rows, dtype), xp.zeros(q.shape, dtype))

    def finish(self, dtype: np.dtype) -> tuple[Array, Array]:
        """(acc / l rounded once into dtype, lse = m + log l of shape (B, H, c))."""
        xp = array_module(self.accumulator)
        output = round_to(self.accumulator / self.row_sum, dtype)
        return output, (self.row_max + xp.log(self.row_sum))[..., 0]


def forward_block(state: OnlineSoftmax, q: Array, k: Array, v: Array, scale: float,
                  diagonal: bool) -> None:
    """Merge one key/value chunk into a query chunk's state, in place: m' = max(m, rowmax(s)),
    l' = l e^(m - m') + sum e^(s - m'), acc' = acc e^(m - m') + e^(s - m') v. q (B, H, c, D);
    k and v (B, H, c_k, D), C-contiguous (`chunk`)."""
    xp = array_module(q)
    scores = block_scores(q, k, scale, diagonal)
    row_max = xp.maximum(state.row_max, scores.max(axis=-1, keepdims=True))  # finite: m' > -inf
    correction = xp.exp(state.row_max - row_max)  # e^(m - m'): 0 before the first block
    probabilities = xp.exp(scores - row_max)  # masked keys: e^(-inf) = 0
    state.row_sum = state.row_sum * correction + probabilities.sum(axis=-1, keepdims=True)
    # float32 P times the float32-widened v, summed in float32: straight into the accumulator
    state.accumulator = state.accumulator * correction + pooled_matmul(probabilities, widen(v))
    state.row_max = row_max


@dataclass
class BlockGradients:
    """Where one block's gradients are added (views of float32 accumulators, += in place): query
    (B, H, c, D) for dQ of the query chunk, key and value (B, H, c_k, D) for dK and dV of the key
    chunk."""

    query: Array
    key: Array
    value: Array


def backward_block(grads: BlockGradients, q: Array, k: Array, v: Array, grad_output: Array,
                   lse: Array, delta: Array, scale: float, diagonal: bool) -> None:
    """Add one block's share to dQ, dK, dV: P = e^(s - lse), dV += P^T dO, dP = dO V^T,
    dS = P (dP - delta), dQ += scale dS K, dK += scale dS^T Q (float32 throughout). lse and
    delta are the query chunk's (B, H, c); grad_output is dO of the query chunk."""
    xp = array_module(q)
    probabilities = xp.exp(block_scores(q, k, scale, diagonal) - lse[..., None])
    grad = widen(grad_output)
    grads.value += pooled_matmul(probabilities.swapaxes(-1, -2), grad)
    grad_probabilities = pooled_matmul(grad, widen(v).swapaxes(-1, -2))
    grad_scores = probabilities * (grad_probabilities - delta[..., None]) * scale
    grads.query += pooled_matmul(grad_scores, widen(k))
    grads.key += pooled_matmul(grad_scores.swapaxes(-1, -2), widen(q))


def output_delta(grad_output: Array, output: Array) -> Array:
    """delta = rowsum(dO * O) in float32, (B, H, T): the softmax backward's row term, from the
    output instead of the probabilities (FlashAttention-2)."""
    return (widen(grad_output) * widen(output)).sum(axis=-1)


def check_attention_inputs(name: str, q: Array, k: Array, v: Array) -> None:
    """q, k and v must be (B, H, T, D) of one shape and one dtype."""
    if q.ndim != 4 or q.shape != k.shape or q.shape != v.shape:
        raise ValueError(f"{name}: q, k and v must all be (B, H, T, D) of one shape, got "
                         f"{q.shape}, {k.shape} and {v.shape}")
    if q.dtype != k.dtype or q.dtype != v.dtype:
        raise TypeError(f"{name}: q, k and v must share one dtype, got {q.dtype}, {k.dtype} and "
                        f"{v.dtype} (cast them alike)")


def causal_order(order: Sequence[Sequence[int]] | None, tokens: int, size: int) -> list[list[int]]:
    """The key chunks each query chunk visits, checked: the chunk size divides the T = tokens
    positions and order[i] holds each of 0..i once (the chunks a causal query chunk sees). None
    gives 0, 1, ..., i (FlashAttention's order)."""
    if size < 1 or tokens % size:
        raise ValueError(f"tiled_attention: chunk_size {size} must divide the sequence's "
                         f"{tokens} positions (choose a divisor of {tokens})")
    chunks = tokens // size
    if order is None:
        return [list(range(i + 1)) for i in range(chunks)]
    if len(order) != chunks:
        raise ValueError(f"tiled_attention: order has {len(order)} entries, one per query chunk "
                         f"is needed ({chunks})")
    for i, keys in enumerate(order):
        if sorted(keys) != list(range(i + 1)):
            raise ValueError(f"tiled_attention: order[{i}] = {tuple(keys)} must visit each key "
                             f"chunk 0..{i} once (the chunks query chunk {i} sees)")
    return [list(keys) for keys in order]


class TiledAttention(Function):
    """y = softmax(q k^T / sqrt(D), causal) v, one key/value chunk at a time (online softmax);
    dL/dq, dL/dk, dL/dv by FlashAttention-2's backward from the saved log-sum-exp.

    chunk_size: positions per chunk, a divisor of T; order: for each query chunk i, the key chunks
    0..i in the order they are merged (None: ascending).
    """

    @staticmethod
    def forward(ctx: Context, q: Array, k: Array, v: Array, chunk_size: int,
                order: Sequence[Sequence[int]] | None = None) -> Array:
        check_attention_inputs("tiled_attention", q, k, v)
        ctx.order = causal_order(order, q.shape[2], chunk_size)
        ctx.chunk_size = c = chunk_size
        ctx.scale = 1.0 / math.sqrt(q.shape[-1])
        output = backend.empty(q.shape, q.dtype, q)
        lse = array_module(q).empty(q.shape[:-1], accumulate_dtype(q.dtype))  # (B, H, T)
        for i, keys in enumerate(ctx.order):
            rows, query = slice(i * c, (i + 1) * c), chunk(q, i, c)
            state = OnlineSoftmax.start(query)
            for j in keys:
                forward_block(state, query, chunk(k, j, c), chunk(v, j, c), ctx.scale, i == j)
            output[..., rows, :], lse[..., rows] = state.finish(q.dtype)
        ctx.save_for_backward(q, k, v, output, lse)
        return output

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array, Array, Array]:
        q, k, v, output, lse = ctx.saved_arrays
        c, delta = ctx.chunk_size, output_delta(grad_output, output)
        # float32 accumulators for every chunk's gradients, rounded once at the end
        grad_q, grad_k, grad_v = (array_module(q).zeros(q.shape, lse.dtype) for _ in range(3))
        for i, keys in enumerate(ctx.order):
            rows = slice(i * c, (i + 1) * c)
            query, grad = chunk(q, i, c), chunk(grad_output, i, c)
            for j in keys:
                columns = slice(j * c, (j + 1) * c)
                grads = BlockGradients(grad_q[..., rows, :], grad_k[..., columns, :],
                                       grad_v[..., columns, :])
                backward_block(grads, query, chunk(k, j, c), chunk(v, j, c), grad, lse[..., rows],
                               delta[..., rows], ctx.scale, diagonal=i == j)
        return round_to(grad_q, q.dtype), round_to(grad_k, k.dtype), round_to(grad_v, v.dtype)
