"""Lesson 16 (splitting the sequence): the configuration of its attention runs, which the notebook
and its claims test (tests/lessons/test_lesson16.py) both import, the runs on simulated ranks,
and the checkers of its exercises: merging two online-softmax states, a rank's zig-zag positions,
the ring's bytes by hand. Reference solutions: lessons/solutions/lesson16.py."""

import math
from typing import Any, Callable

import numpy as np

from minimp import Tensor
from minimp import functional as F
from minimp.distributed import simulate
from minimp.lessons.checking import Report, call, expect
from minimp.parallel.context import (ContextLayout, ring_attention, ring_bytes, ring_order,
                                     ulysses_attention)

# ----- the notebook's configuration ---------------------------------------------------------------
# Attention's memory: one sample, 4 heads of 16, growing sequences, tiled in chunks of 16.
MEMORY_SHAPE = dict(B=1, H=4, D=16)
MEMORY_TOKENS = (128, 256, 512, 1024, 2048)
MEMORY_CHUNK = 16
# The ring and Ulysses: 2 samples, 4 heads of 16, 64 positions over 4 simulated ranks (float32).
B, H, T, D = 2, 4, 64, 16
RANKS = 4
SEED = 0
# The peak rates a send must hide behind (NVIDIA's H100 SXM datasheet: dense bf16 tensor-core
# flops; NVLink 4 carries 900 GB/s in both directions together, 450 GB/s each way; an NDR
# InfiniBand port 400 Gb/s, 50 GB/s).
H100_BF16_FLOPS = 989e12
LINKS = {"NVLink (450 GB/s)": 450e9, "InfiniBand NDR (50 GB/s)": 50e9}


def inputs(shape: tuple[int, ...] = (B, H, T, D), seed: int = SEED) -> list[np.ndarray]:
    """q, k, v and the output's gradient dO, float32 standard normal, (B, H, T, D) each."""
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(4)]


def attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Today's attention, as minimp/models/gpt.py computes it: the (B, H, T, T) scores, their
    causal softmax, times v."""
    scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, T, T)
    return F.scaled_masked_softmax(scores, 1.0 / math.sqrt(q.shape[-1])) @ v


def on_ranks(kind: str, arrays: list[np.ndarray], size: int = RANKS) -> dict[str, Any]:
    """Ring ("ring", zig-zag shards) or Ulysses ("ulysses", contiguous shards) attention of q, k,
    v over `size` simulated ranks, forward and backward (dO the fourth array): the output and the
    gradients reassembled in sequence order, and each rank's bytes sent in each pass."""
    layout = ContextLayout(size, "zigzag" if kind == "ring" else "contiguous")

    def rank_body(comm):
        q, k, v = (Tensor(layout.shard(a, comm.rank, axis=2), requires_grad=True)
                   for a in arrays[:3])
        if kind == "ring":
            y = ring_attention(q, k, v, comm, layout)
        else:
            y = ulysses_attention(q, k, v, comm, layout)
        forward = comm.bytes_sent
        y.backward(layout.shard(arrays[3], comm.rank, axis=2))
        return y.data, q.grad, k.grad, v.grad, forward, comm.bytes_sent - forward

    results = simulate(size, rank_body)
    whole = [layout.unshard([result[i] for result in results], axis=2) for i in range(4)]
    return dict(output=whole[0], grads=whole[1:], layout=layout,
                forward_bytes=[result[4] for result in results],
                backward_bytes=[result[5] for result in results])


def one_process(arrays: list[np.ndarray], chunk_size: int | None = None,
                order: Any = None) -> tuple[np.ndarray, list[np.ndarray]]:
    """One process's attention of the whole sequence (today's with chunk_size None, tiled
    otherwise, in `order`), forward and backward: (output, [dq, dk, dv])."""
    q, k, v = (Tensor(a, requires_grad=True) for a in arrays[:3])
    if chunk_size is None:
        y = attention(q, k, v)
    else:
        y = F.tiled_attention(q, k, v, chunk_size, order=order)
    y.backward(arrays[3])
    return y.data, [q.grad, k.grad, v.grad]


def whole_ring_order(layout: ContextLayout) -> list[tuple[int, ...]]:
    """For every query chunk of the 2N-chunk grid, the key chunks its rank's ring merges, in
    order: every rank's `ring_order`, put together (what `F.tiled_attention(order=...)` takes)."""
    order: list[tuple[int, ...]] = [()] * layout.chunks
    for rank in range(layout.size):
        for chunk, keys in ring_order(layout, rank).items():
            order[chunk] = keys
    return order


def blocks_per_step(layout: ContextLayout, rank: int) -> list[float]:
    """The blocks of the chunk grid rank computes at each ring step (ring.py's rule): at step t it
    holds rank (rank - t) mod N's key chunks, and its query chunk i computes key chunk j when
    j <= i, half a block when j == i (the causal mask hides the other half)."""
    work = []
    for step in range(layout.size):
        held = layout.chunk_ids((rank - step) % layout.size)
        work.append(sum((0.5 if j == i else 1.0 for i in layout.chunk_ids(rank)
                         for j in held if j <= i), 0.0))
    return work


# ----- exercise 1: merging two online-softmax states ----------------------------------------------
def _state(scores: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(m, l, acc) of one block of keys, float32: m (rows, 1) the row maximum, l (rows, 1) the sum
    of e^(s - m), acc (rows, D) = e^(s - m) v; a block of -inf scores gives (-inf, 0, 0)."""
    scores = scores.astype(np.float32)
    m = scores.max(axis=-1, keepdims=True)
    with np.errstate(invalid="ignore"):
        p = np.where(np.isfinite(m), np.exp(scores - m), np.float32(0))
    return m, p.sum(axis=-1, keepdims=True, dtype=np.float32), (p @ v).astype(np.float32)


def _float64_softmax(scores: np.ndarray, v: np.ndarray) -> np.ndarray:
    """softmax(scores) v in float64: the reference the merged state must finish to."""
    s = scores.astype(np.float64)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    return (p / p.sum(axis=-1, keepdims=True)) @ v.astype(np.float64)


def check_merge(merge: Callable, quiet: bool = False) -> Report:
    """merge(a, b) -> (m, l, acc): the online-softmax state of two blocks of keys together, from
    each block's state (m, l, acc) over the same query rows (float32; m and l of shape (rows, 1),
    acc (rows, D)): m = max(m_a, m_b), l and acc each block's rescaled by e^(m_block - m) and
    summed. Compared with the state of the two blocks' scores computed at once (m exactly, l and
    acc to a relative 1e-4: a merge through float32 log-sum-exps near 200 rounds that much), and
    acc / l with the float64 softmax (to 1e-5)."""
    report = Report("merge", quiet)
    rng = np.random.default_rng(16)

    def compare(scores, v, split):
        a, b = _state(scores[:, :split], v[:split]), _state(scores[:, split:], v[split:])
        got = call(merge, tuple(x.copy() for x in a), tuple(x.copy() for x in b))
        expect(len(got) == 3, f"returned {len(got)} things, expected (m, l, acc)")
        m, row_sum, acc = (np.asarray(x) for x in got)
        want = _state(scores, v)
        expect(m.shape == want[0].shape and row_sum.shape == want[1].shape
               and acc.shape == want[2].shape,
               f"shapes m {m.shape}, l {row_sum.shape}, acc {acc.shape}; expected "
               f"{want[0].shape}, {want[1].shape}, {want[2].shape}")
        with np.errstate(all="ignore"):
            expect(np.all(np.isfinite(row_sum)) and np.all(np.isfinite(acc)),
                   "l or acc is not finite (inf or NaN): e^(a large score) overflowed")
            rows = np.flatnonzero(m.ravel() != want[0].ravel())[:3]  # the first rows that differ
            expect(rows.size == 0, f"m is {m.ravel()[rows]} in rows {rows.tolist()}, the row "
                   f"maximum of both blocks is {want[0].ravel()[rows]} there")
            rows = np.flatnonzero(~np.isclose(row_sum, want[1], rtol=1e-4, atol=0).ravel())[:3]
            expect(rows.size == 0, f"l is {row_sum.ravel()[rows]} in rows {rows.tolist()}, the "
                   f"two blocks' sum of e^(s - m) is {want[1].ravel()[rows]} there")
            close = dict(rtol=1e-4, atol=1e-6 * np.abs(want[2]).max())
            expect(not (np.allclose(acc, want[2] / want[1], **close)
                        and not np.allclose(acc, want[2], **close)),
                   "acc is already divided by l: the state keeps the sum e^(s - m) v and l "
                   "apart; divide by l only at the end, once every block is merged")
            expect(np.allclose(acc, want[2], **close),
                   "acc differs from the two blocks' e^(s - m) v")
            output, exact = acc / row_sum, _float64_softmax(scores, v)
        worst = float(np.abs(output - exact).max())
        expect(worst <= 1e-5 * max(1.0, float(np.abs(exact).max())),
               f"acc / l is off the softmax's output by up to {worst:.3g}")

    @report.case(
        "scores of size about 1, two blocks of 16 keys: acc / l is softmax(s) v",
        hint="rescale each block by e^(m_block - m) with m = max(m_a, m_b), row by row "
        "(np.maximum; np.max's second argument is an axis): its exponentials were taken against "
        "its own maximum; weights are each block's share of the row sum l, not one half each",
    )
    def _():
        compare(rng.standard_normal((8, 32)), rng.standard_normal((32, 4)), 16)

    @report.case(
        "blocks of 5 and 27 keys, one block's maximum far above the other's",
        hint="a plain average of the two outputs weighs a block of 5 keys like one of 27: the "
        "weights are l_a e^(m_a - m) / l and l_b e^(m_b - m) / l",
    )
    def _():
        scores = rng.standard_normal((8, 32))
        scores[:, :5] += 6.0
        compare(scores, rng.standard_normal((32, 4)), 5)

    @report.case(
        "scores near 200 (exp(200) overflows float32, whose largest number is 3.4e38)",
        hint="subtract the max before exponentiating: e^(m_a - m) <= 1; summing l_a e^(m_a) "
        "without the max subtraction overflows to inf",
    )
    def _():
        compare(200.0 + rng.standard_normal((8, 32)), rng.standard_normal((32, 4)), 16)

    @report.case(
        "rows fully masked in one block (m = -inf, l = 0, acc = 0 there), other rows not: "
        "those rows are the other block's",
        hint="e^(-inf - m) = 0 for a finite m: the masked rows add nothing; decide row by row, "
        "not for the whole block at once",
    )
    def _():
        scores = rng.standard_normal((8, 32))
        scores[:3, :16] = -np.inf
        compare(scores, rng.standard_normal((32, 4)), 16)

    return report.finish()


# ----- exercise 2: a rank's zig-zag positions -----------------------------------------------------
def _work(positions: np.ndarray, tokens: int) -> float:
    """Causal (query, key) pairs the positions' queries compute, as a share of the sequence's."""
    return float(np.sum(np.asarray(positions) + 1)) / (tokens * (tokens + 1) / 2)


def check_zigzag_positions(zigzag_positions: Callable, quiet: bool = False) -> Report:
    """zigzag_positions(rank, N, T) -> the global positions (ints) rank holds of a sequence of T
    (a multiple of 2N) cut into 2N chunks of T/(2N): chunks rank and 2N-1-rank, the early one
    first, in ascending order within each. Compared with ContextLayout(N).token_indices."""
    report = Report("zigzag_positions", quiet)
    cases = [(1, 8), (2, 8), (2, 16), (4, 32), (4, 64), (8, 48)]

    def positions(rank, size, tokens):
        got = np.asarray(call(zigzag_positions, rank, size, tokens))
        expect(got.ndim == 1, f"rank {rank} of N = {size}, T = {tokens}: an array of shape "
               f"{got.shape}, expected one flat array of positions: concatenate the two chunks")
        expect(np.issubdtype(got.dtype, np.integer), f"rank {rank} of N = {size}, T = {tokens}: "
               f"positions of dtype {got.dtype}, expected ints (an index must be one): "
               f"T / (2N) is a float in Python 3, T // (2N) an int")
        expect(got.size == tokens // size,
               f"rank {rank} of N = {size}, T = {tokens}: {got.size} positions, each rank "
               f"holds T/N = {tokens // size}")
        return got

    @report.case(
        "every position 0..T-1 held by exactly one rank",
        hint="chunk c is positions c T/(2N) .. (c + 1) T/(2N) - 1; the late chunk is "
        "2N - 1 - rank (2N - rank is one past the last chunk, off by one)",
    )
    def _():
        for size, tokens in cases:
            held = np.concatenate([positions(r, size, tokens) for r in range(size)])
            expect(np.array_equal(np.sort(held), np.arange(tokens)),
                   f"N = {size}, T = {tokens}: the ranks hold {np.sort(held)[:12].tolist()}..., "
                   f"not each of 0..{tokens - 1} once")

    @report.case(
        "every rank the same causal work (each query attends to itself and the positions "
        "before it)",
        hint="zig-zag balances the work: an early chunk r and a late chunk 2N-1-r; contiguous "
        "shards give the last rank 2N-1 times the first's",
    )
    def _():
        for size, tokens in cases:
            held = [positions(r, size, tokens) for r in range(size)]
            work = [_work(each, tokens) for each in held]
            steps = {int(d) for each in held for d in np.diff(each)}
            guess = (" (contiguous shards)" if steps == {1} else
                     " (striped: every N-th position balances only roughly)" if steps == {size}
                     else "")
            expect(np.allclose(work, 1 / size),
                   f"N = {size}, T = {tokens}: shares of the causal work "
                   f"{[round(w, 3) for w in work]}, not 1/N = {1 / size:.3g} each{guess}")

    @report.case(
        "the order ContextLayout stores: chunk rank first, then chunk 2N-1-rank",
        hint="the early chunk first, each chunk's positions ascending",
    )
    def _():
        for size, tokens in cases:
            layout = ContextLayout(size)
            for rank in range(size):
                got, want = positions(rank, size, tokens), layout.token_indices(rank, tokens)
                expect(np.array_equal(got, want), f"rank {rank} of N = {size}, T = {tokens}: "
                       f"{got.tolist()}, expected {want.tolist()}")

    return report.finish()


# ----- exercise 3: the ring's bytes by hand -------------------------------------------------------
def check_ring_bytes_by_hand(ring_bytes_by_hand: Callable, quiet: bool = False) -> Report:
    """ring_bytes_by_hand(shape, dtype, N) -> (forward, backward): the bytes one rank sends in one
    ring attention, its q of shape (B, H, T/N, D) in dtype: forward the k and v blocks, backward
    them again plus their gradients dK and dV in float32 (float64 for float64 inputs); 0 and 0
    for N = 1. Compared with minimp's ring_bytes and with the bytes ranks send on a simulated
    ring."""
    report = Report("ring_bytes_by_hand", quiet)

    def compare(shape, dtype, size):
        got = call(ring_bytes_by_hand, shape, np.dtype(dtype), size)
        want = ring_bytes(shape, dtype, size)
        expect(len(got) == 2, f"returned {len(got)} things, expected (forward, backward)")
        forward, backward = got
        expect(forward == want.forward, f"{shape}, {np.dtype(dtype).name}, N = {size}: forward "
               f"{forward:,}, the ring sends {want.forward:,}")
        expect(backward == want.backward, f"{shape}, {np.dtype(dtype).name}, N = {size}: "
               f"backward {backward:,}, the ring sends {want.backward:,}")

    @report.case(
        "forward, float32: N = 2, 4, 8",
        hint="each rank holds a block of k and v (2n values, n = B H (T/N) D, each "
        "dtype.itemsize bytes) and sends N - 1 hops: at the last step the block it holds is the "
        "last it needs, no send",
    )
    def _():
        for size in (2, 4, 8):
            compare((2, 4, 8, 16), np.float32, size)

    @report.case(
        "backward, float16 and bfloat16 activations",
        hint="k and v travel again (N - 1 hops, in the activation dtype); dK and dV travel "
        "in float32, 4 bytes a value whatever the activations, N hops: home after N",
    )
    def _():
        from minimp.precision import BFLOAT16

        for dtype in (np.float16, BFLOAT16):
            for size in (2, 4):
                compare((1, 2, 16, 8), dtype, size)

    @report.case(
        "float64 inputs (gradient checks): dK, dV in float64; N = 1: nothing sent",
        hint="the accumulators are float64 for float64 inputs (8 bytes); one rank has no ring",
    )
    def _():
        compare((1, 2, 16, 8), np.float64, 4)
        compare((1, 2, 16, 8), np.float32, 1)

    @report.case(
        "against 4 simulated ranks' bytes sent (this lesson's shapes, float32)",
        hint="the shape is one rank's q, T/N positions: n = B H (T/N) D, not the whole T",
    )
    def _():
        measured = on_ranks("ring", inputs())
        got = call(ring_bytes_by_hand, (B, H, T // RANKS, D), np.dtype(np.float32), RANKS)
        expect(tuple(got) == (measured["forward_bytes"][0], measured["backward_bytes"][0]),
               f"{tuple(got)}, the ranks sent {measured['forward_bytes'][0]:,} forward and "
               f"{measured['backward_bytes'][0]:,} backward")

    return report.finish()


EXERCISES = [
    ("merge", check_merge),
    ("zigzag_positions", check_zigzag_positions),
    ("ring_bytes_by_hand", check_ring_bytes_by_hand),
]
