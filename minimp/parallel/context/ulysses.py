"""Ulysses attention: causal attention over a sequence sharded across a context-parallel group, an
all-to-all turning the sequence shards into head shards before attention and back after
(Jacobs et al. 2023, DeepSpeed-Ulysses).

Each of the N ranks holds q, k and v of its T/N contiguous positions for all H heads:
(B, H, T/N, D). One all-to-all per tensor sends head group j (heads jH/N .. (j+1)H/N - 1) to rank
j, so rank r ends with its H/N heads over the whole sequence, (B, H/N, T, D), the positions in rank
order; it runs one process's causal attention on them, and a fourth all-to-all sends each rank's
positions of the output back, (B, H, T/N, D). Backward is the same composition run backwards:
every op here is a Function (AllToAll, Transpose, Reshape, MatMul, the softmax), so autograd sends
dL/dO to the heads' ranks and dL/dq, dL/dk, dL/dv home through AllToAll's backward; no backward
is written here.

Why Ulysses is simple: a head's attention needs nothing of another head, so once a rank holds its
heads' whole sequence, each head is computed exactly as one process computes it (NumPy gives the
same bits: the test checks). The causal work is balanced by construction (every rank computes all
T positions of H/N heads), so the layout is contiguous only: zig-zag would fix an imbalance that
is not there. The price: H/N must be a whole number (with tensor parallelism, H/tp heads per rank),
so N is at most the heads a rank holds, and every rank holds the whole sequence of its heads.

Three all-to-alls for q, k, v, not one of the three stacked (DeepSpeed's DistributedAttention does
the same): the same bytes, 3(N-1) messages instead of N-1, and composed of existing Functions (a
stacked exchange needs a stack op, whose backward would be written by hand). Each call agrees on
its layout first (one scalar all-reduce, counted apart in comm.scalar_allreduces: 4 per forward).

The local attention (chunk_size): None, today's attention of minimp/models/gpt.py (scores rounded
once, F.scaled_masked_softmax, @ v), so a Ulysses GPT computes each head as one process does; it
keeps the T x T probabilities of its H/N heads for backward. An int: F.tiled_attention in chunks
of chunk_size positions (online softmax), which keeps the log-sum-exp instead: long contexts.

Bytes one rank sends per attention call, n = B H (T/N) D values per tensor (its q's size), N > 1:
    forward:  4 * n (N-1)/N * itemsize     q, k, v to the heads' ranks, O back
    backward: 4 * n (N-1)/N * itemsize     dO to the heads' ranks, dq, dk, dv back
each chunk of 1/N kept home. Gradients travel in the activation dtype (float16, bfloat16 or float32
as q): each is finished on one rank (a head's whole sequence is there), so nothing is summed
across ranks and nothing needs a float32 accumulator in flight (the ring's dK, dV do). No counts
travel (every chunk has one shape). None for N = 1.
Memory per rank, kept for backward (the all-to-all buffers live only within a call):
    today's attention:  3n * itemsize + B (H/N) T^2 * itemsize   its heads' q, k, v; probabilities
    tiled attention:    4n * itemsize + B (H/N) T * 4            q, k, v, O; float32 log-sum-exp
(the log-sum-exp in float64 for float64 inputs), each exactly 1/N of one process's: H/N heads of
T positions are as many values as H heads of T/N. The input shards (B, H, T/N, D) are not kept.
"""

import math

import numpy as np

from minimp import Tensor
from minimp import functional as F
from minimp.distributed.alltoall import AllToAll
from minimp.distributed.protocol import Communicator
from minimp.ops.attention import accumulate_dtype, check_attention_inputs
from minimp.parallel.context.layout import AttentionBytes, ContextLayout


def ulysses_bytes(shape: tuple[int, ...], dtype: np.dtype, size: int) -> AttentionBytes:
    """The module docstring's byte formula, for a rank's q of shape (B, H, T/N, D) in dtype and a
    group of N = size ranks: forward q, k, v out and O back, backward dO out and dq, dk, dv back."""
    sent = 4 * math.prod(shape) // size * (size - 1) * np.dtype(dtype).itemsize
    return AttentionBytes(sent, sent)


def ulysses_memory(shape: tuple[int, ...], dtype: np.dtype, size: int,
                   chunk_size: int | None = None) -> int:
    """The module docstring's saved bytes, for a rank's q of shape (B, H, T/N, D) in dtype, a group
    of N = size ranks and the local attention chunk_size chooses."""
    values, itemsize = math.prod(shape), np.dtype(dtype).itemsize
    rows = math.prod(shape[:-1])  # B H (T/N) = B (H/N) T: the query rows of its heads
    if chunk_size is None:  # and T keys each
        return 3 * values * itemsize + rows * shape[2] * size * itemsize
    return 4 * values * itemsize + rows * accumulate_dtype(dtype).itemsize


def check_ulysses(heads: int, tokens: int, size: int) -> None:
    """One clear error before any work: the heads a rank holds (H, or H/tp with tensor
    parallelism) and the sequence's T positions must both split over the N = size ranks."""
    if heads % size:
        raise ValueError(f"ulysses: the {heads} attention heads a rank holds (with tensor "
                         f"parallelism, heads / tp) do not split over --cp {size} ranks: choose "
                         f"a --cp that divides {heads}, or --cp-mode ring")
    if tokens % size:
        raise ValueError(f"ulysses: the sequence's {tokens} positions do not split over --cp "
                         f"{size} ranks: choose a context divisible by {size}")


def sequence_to_heads(x: Tensor, comm: Communicator) -> Tensor:
    """(B, H, T/N, D), this rank's positions of every head -> (B, H/N, T, D), its heads' whole
    sequence: head group j goes to rank j, rank i's positions come back as the i-th T/N."""
    batch, heads, tokens, width = x.shape
    groups = x.reshape(batch, comm.size, heads // comm.size, tokens, width)  # (B, N, H/N, T/N, D)
    received = AllToAll.apply(groups.transpose(1, 2, 0, 3, 4), comm=comm)  # (N, H/N, B, T/N, D)
    # rows: from rank i, its positions; in rank order they are the sequence (contiguous layout)
    heads_first = received.transpose(2, 1, 0, 3, 4)  # (B, H/N, N, T/N, D)
    return heads_first.reshape(batch, heads // comm.size, comm.size * tokens, width)


def heads_to_sequence(y: Tensor, comm: Communicator) -> Tensor:
    """(B, H/N, T, D), this rank's heads' whole sequence -> (B, H, T/N, D), every head at this
    rank's positions: positions i go back to rank i, head group j comes from rank j."""
    batch, heads, tokens, width = y.shape
    pieces = y.reshape(batch, heads, comm.size, tokens // comm.size, width)  # (B, H/N, N, T/N, D)
    received = AllToAll.apply(pieces.transpose(2, 1, 0, 3, 4), comm=comm)  # (N, H/N, B, T/N, D)
    every_head = received.transpose(2, 0, 1, 3, 4)  # (B, N, H/N, T/N, D): head group j, rank j's
    return every_head.reshape(batch, comm.size * heads, tokens // comm.size, width)


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, comm: Communicator,
                      layout: ContextLayout | None = None, chunk_size: int | None = None) -> Tensor:
    """Causal attention of this rank's positions over the whole sharded sequence: q, k, v (B, H,
    T/N, D) hold comm.rank's T/N contiguous positions of every head; returns (B, H, T/N, D).

    layout: None or ContextLayout(N, "contiguous") (Ulysses takes no other); chunk_size: None for
    today's attention on each rank's heads, an int for tiled attention in chunks of that many
    positions (the module docstring tells what each keeps)."""
    check_attention_inputs("ulysses_attention", q.data, k.data, v.data)
    if layout not in (None, ContextLayout(comm.size, "contiguous")):
        raise ValueError(f"ulysses_attention: takes the contiguous layout of the group's "
                         f"{comm.size} ranks, got {layout} (pass ContextLayout({comm.size}, "
                         f"'contiguous'), or use ring_attention for zig-zag)")
    batch, heads, tokens, width = q.shape
    check_ulysses(heads, comm.size * tokens, comm.size)  # (the trainer checks its T alike)
    q, k, v = (sequence_to_heads(x, comm) for x in (q, k, v))  # (B, H/N, T, D) each
    if chunk_size is None:  # minimp/models/gpt.py's attention, on this rank's heads
        scores = q @ k.transpose(0, 1, 3, 2)  # (B, H/N, T, T): float32 sums, rounded once
        y = F.scaled_masked_softmax(scores, 1.0 / math.sqrt(width)) @ v  # (B, H/N, T, D)
    else:
        y = F.tiled_attention(q, k, v, chunk_size)
    return heads_to_sequence(y, comm)
