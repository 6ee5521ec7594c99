"""Lesson 16 (splitting the sequence): every number its prose states, as a test, and its
exercises' checkers against the reference solutions and wrong ones. A failure here means a
sentence in lessons/16_context_parallel.ipynb became false, or a checker passes a wrong answer."""

import functools
import math

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor
from minimp import functional as F
from minimp.lessons.lesson16 import (
    B,
    D,
    H,
    H100_BF16_FLOPS,
    LINKS,
    MEMORY_CHUNK,
    MEMORY_SHAPE,
    MEMORY_TOKENS,
    RANKS,
    T,
    attention,
    blocks_per_step,
    inputs,
    on_ranks,
    one_process,
    whole_ring_order,
)
from minimp.parallel.context import (
    ContextLayout,
    check_ulysses,
    ring_bytes,
    ring_memory,
    ring_order,
    ulysses_bytes,
    ulysses_memory,
)
from minimp.precision import BFLOAT16
from minimp.tensor import saved_bytes

SHAPE = (B, H, T // RANKS, D)  # each rank's q
BIG = (1, 32, 131072 // 8, 128)  # the prose's long context: T = 131,072 over N = 8


def test_the_lessons_configuration():
    assert (B, H, T, D, RANKS) == (2, 4, 64, 16, 4)
    assert MEMORY_SHAPE == dict(B=1, H=4, D=16) and MEMORY_CHUNK == 16
    assert MEMORY_TOKENS == (128, 256, 512, 1024, 2048)
    assert math.prod(SHAPE) == 2048  # n, the prose's


@pytest.mark.parametrize("tokens", MEMORY_TOKENS)
def test_what_each_attention_keeps_is_its_formula(tokens):
    """Today's attention keeps (3n + B H T^2) 4 bytes, the tiled one (4n + B H T) 4."""
    batch, heads, width = MEMORY_SHAPE["B"], MEMORY_SHAPE["H"], MEMORY_SHAPE["D"]
    q, k, v = (Tensor(a, requires_grad=True) for a in inputs((batch, heads, tokens, width))[:3])
    n = batch * heads * tokens * width
    assert saved_bytes(attention(q, k, v)) == (3 * n + batch * heads * tokens**2) * 4
    tiled = saved_bytes(F.tiled_attention(q, k, v, MEMORY_CHUNK))
    assert tiled == (4 * n + batch * heads * tokens) * 4


def test_the_memory_figures_the_prose_states():
    assert 4 * 2048**2 * 4 == 67_108_864 and (3 * 4 * 2048 * 16 + 4 * 2048**2) * 4 == 68_681_728
    assert f"{32 * 131072**2 * 2 / 1e12:.2f}" == "1.10"


def test_e_to_the_89_overflows_float32_and_88_does_not():
    with np.errstate(over="ignore"):
        assert np.isfinite(np.exp(np.float32(88))) and np.isinf(np.exp(np.float32(89)))


def test_the_merge_of_two_blocks_is_the_softmax():
    """The notebook's float64 row: 12 keys in blocks of 5 and 7."""
    rng = np.random.default_rng(0)
    s, values = rng.standard_normal(12) * 3, rng.standard_normal((12, 4))
    merged = solutions(16).merge(*[(np.array([[x.max()]]), *_sums(x, v))
                                   for x, v in ((s[:5], values[:5]), (s[5:], values[5:]))])
    softmax = np.exp(s - s.max()) / np.exp(s - s.max()).sum()
    assert np.abs(merged[2] / merged[1] - softmax @ values).max() < 1e-12


def _sums(scores, v):
    p = np.exp(scores - scores.max())
    return np.array([[p.sum()]]), (p @ v)[None]


@functools.cache
def runs():
    arrays = inputs()
    return arrays, on_ranks("ring", arrays), on_ranks("ulysses", arrays), one_process(arrays)


def test_the_merge_order_changes_bits_not_values():
    arrays = inputs()
    ascending, _ = one_process(arrays, chunk_size=8)
    descending, _ = one_process(arrays, chunk_size=8, order=[range(i, -1, -1) for i in range(8)])
    assert not np.array_equal(ascending, descending)
    assert np.abs(ascending - descending).max() < 1e-6


def test_the_ring_equals_one_process():
    arrays, ring, _, (today, today_grads) = runs()
    assert np.abs(ring["output"] - today).max() < 1e-6
    assert all(np.abs(a - b).max() < 1e-5 for a, b in zip(ring["grads"], today_grads))
    in_order, grads = one_process(arrays, chunk_size=8, order=whole_ring_order(ring["layout"]))
    assert np.array_equal(ring["output"], in_order) and np.array_equal(ring["grads"][0], grads[0])


def test_the_ring_sends_what_ring_bytes_says():
    _, ring, _, _ = runs()
    assert ring["forward_bytes"] == [49_152] * RANKS
    assert ring_bytes(SHAPE, np.float32, 4).forward == 49_152
    assert ring["backward_bytes"] == [114_688] * RANKS
    assert ring_bytes(SHAPE, np.float32, 4).backward == 114_688 == 49_152 + 4 * 2 * 2048 * 4
    assert (4 - 1) * 2 * 2048 * 4 == 49_152


def test_rank_0s_order():
    assert ring_order(ContextLayout(4), 0) == {0: (0,), 7: (0, 7, 3, 4, 2, 5, 1, 6)}


def test_where_compute_covers_the_send():
    """(T/N) / itemsize flops per byte, against peak flops over bandwidth, bf16."""
    thresholds = [f"{2 * H100_BF16_FLOPS / bandwidth:,.0f}" for bandwidth in LINKS.values()]
    assert thresholds == ["4,396", "39,560"]


@pytest.mark.parametrize("size", [2, 4, 8])
def test_zigzag_computes_2_blocks_every_step_and_2n_in_all(size):
    layout = ContextLayout(size)
    for rank in range(size):
        assert blocks_per_step(layout, rank) == [2.0] * size
        assert layout.causal_work(rank) == 2 * size
        counted = sum(len(keys) - 0.5 for keys in ring_order(layout, rank).values())
        assert counted == 2 * size


@pytest.mark.parametrize("size", [2, 4, 8])
def test_contiguous_work_and_the_rings_time(size):
    layout = ContextLayout(size, "contiguous")
    steps = [blocks_per_step(layout, rank) for rank in range(size)]
    assert [sum(s) for s in steps] == [4 * r + 2 for r in range(size)]
    assert layout.work_imbalance() == 2 * size - 1
    assert sum(map(sum, steps)) == 2 * size**2 == sum(map(sum, (
        blocks_per_step(ContextLayout(size), r) for r in range(size))))
    busiest = max(layout.causal_work(rank) for rank in range(size))
    assert busiest == 4 * size - 2 == sum(max(column) for column in zip(*steps))
    if size == 4:
        assert (busiest, ContextLayout(size).causal_work(0), 2 * size**2) == (14, 8, 32)


def test_ulysses_equals_one_process_bit_for_bit_and_sends_its_formula():
    _, _, ulysses, (today, today_grads) = runs()
    assert np.array_equal(ulysses["output"], today)
    assert all(np.array_equal(a, b) for a, b in zip(ulysses["grads"], today_grads))
    assert ulysses["forward_bytes"] == ulysses["backward_bytes"] == [24_576] * RANKS
    assert ulysses_bytes(SHAPE, np.float32, RANKS).forward == 24_576
    assert ring_bytes(SHAPE, np.float32, RANKS).forward == RANKS // 2 * 24_576  # N/2 times


def test_the_long_context_figures():
    mib = 2**20
    ring, ulysses = ring_bytes(BIG, BFLOAT16, 8), ulysses_bytes(BIG, BFLOAT16, 8)
    assert (ring.forward / mib, ring.backward / mib) == (1792, 5888)
    assert (ulysses.forward / mib, ulysses.backward / mib) == (448, 448)
    assert ring_memory(BIG, BFLOAT16, 8).saved / mib == 514
    assert ulysses_memory(BIG, BFLOAT16, 8, chunk_size=1024) / mib == 514
    assert ulysses_memory(BIG, BFLOAT16, 8) / 2**30 == 128.375  # today's attention per head
    with pytest.raises(ValueError, match="do not split"):
        check_ulysses(heads=32, tokens=131072, size=64)


# ----- wrong solutions a learner would write --------------------------------------------------
def merge_without_rescaling(a, b):
    """The sums added as they are: each block's exponentials were taken against its own max."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    return np.maximum(m_a, m_b), l_a + l_b, acc_a + acc_b


def merge_averaging_outputs(a, b):
    """The two blocks' outputs averaged, as if both held equally much of the softmax."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.maximum(m_a, m_b)
    row_sum = l_a * np.exp(m_a - m) + l_b * np.exp(m_b - m)
    return m, row_sum, row_sum * (acc_a / l_a + acc_b / l_b) / 2


def merge_without_the_max(a, b):
    """Back to e^s itself (l e^m), summed, then over e^m: fine until e^m overflows."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.maximum(m_a, m_b)
    with np.errstate(over="ignore", invalid="ignore"):
        total_l = l_a * np.exp(m_a) + l_b * np.exp(m_b)
        total_acc = acc_a * np.exp(m_a) + acc_b * np.exp(m_b)
        return m, total_l / np.exp(m), total_acc / np.exp(m)


def merge_keeping_the_first_max(a, b):
    """The running maximum left at a's, b rescaled onto it."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    with np.errstate(over="ignore", invalid="ignore"):
        return m_a, l_a + l_b * np.exp(m_b - m_a), acc_a + acc_b * np.exp(m_b - m_a)


def merge_rescaling_the_wrong_way(a, b):
    """e^(m - m_block) where e^(m_block - m) belongs."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.maximum(m_a, m_b)
    with np.errstate(over="ignore", invalid="ignore"):
        scale_a, scale_b = np.exp(m - m_a), np.exp(m - m_b)
        return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a + acc_b * scale_b


def merge_with_logaddexp(a, b):
    """Right: the same merge through log-sum-exps (np.logaddexp subtracts the max itself)."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.maximum(m_a, m_b)
    with np.errstate(divide="ignore"):
        lse_a, lse_b = m_a + np.log(l_a), m_b + np.log(l_b)
    lse = np.logaddexp(lse_a, lse_b)
    weight_a, weight_b = np.exp(lse_a - lse), np.exp(lse_b - lse)  # each block's share
    row_sum = np.exp(lse - m)
    with np.errstate(invalid="ignore", divide="ignore"):
        output = np.nan_to_num(acc_a / l_a) * weight_a + np.nan_to_num(acc_b / l_b) * weight_b
    return m, row_sum.astype(np.float32), (output * row_sum).astype(np.float32)


def _rescaled(a, b):
    """m = max(m_a, m_b) and each block's factor e^(m_block - m)."""
    m_a, m_b = a[0], b[0]
    m = np.maximum(m_a, m_b)
    return m, np.exp(m_a - m), np.exp(m_b - m)


def merge_dividing_acc_by_l(a, b):
    """The output acc / l returned where the state's unnormalized acc belongs."""
    m, scale_a, scale_b = _rescaled(a, b)
    row_sum = a[1] * scale_a + b[1] * scale_b
    return m, row_sum, (a[2] * scale_a + b[2] * scale_b) / row_sum


def merge_rescaling_only_l(a, b):
    """l rescaled, acc added as it is."""
    m, scale_a, scale_b = _rescaled(a, b)
    return m, a[1] * scale_a + b[1] * scale_b, a[2] + b[2]


def merge_with_the_scales_swapped(a, b):
    """Block a's factor on block b and b's on a."""
    m, scale_a, scale_b = _rescaled(a, b)
    return m, a[1] * scale_b + b[1] * scale_a, a[2] * scale_b + b[2] * scale_a


def merge_with_one_max_for_all_rows(a, b):
    """The largest score of every row taken as every row's m."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.full_like(m_a, max(m_a.max(), m_b.max()))
    scale_a, scale_b = np.exp(m_a - m), np.exp(m_b - m)
    return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a + acc_b * scale_b


def merge_skipping_a_block_with_a_masked_row(a, b):
    """A block with any masked row skipped whole, as if masking were per block."""
    if np.isneginf(a[0]).any():
        return b
    if np.isneginf(b[0]).any():
        return a
    return solutions(16).merge(a, b)


def merge_with_np_max(a, b):
    """np.max(m_a, m_b): np.max's second argument is an axis, not a second array."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    m = np.max(m_a, m_b)
    scale_a, scale_b = np.exp(m_a - m), np.exp(m_b - m)
    return m, l_a * scale_a + l_b * scale_b, acc_a * scale_a + acc_b * scale_b


def merge_row_by_row_with_where(a, b):
    """Right: the larger maximum chosen row by row with np.where, the other block rescaled."""
    (m_a, l_a, acc_a), (m_b, l_b, acc_b) = a, b
    first = m_a >= m_b
    with np.errstate(over="ignore", invalid="ignore"):
        row_sum = np.where(first, l_a + l_b * np.exp(m_b - m_a), l_a * np.exp(m_a - m_b) + l_b)
        acc = np.where(first, acc_a + acc_b * np.exp(m_b - m_a),
                       acc_a * np.exp(m_a - m_b) + acc_b)
    return np.where(first, m_a, m_b), row_sum, acc


def zigzag_contiguous(rank, N, T):
    """The r-th of N equal pieces: chunks 2r and 2r + 1."""
    share = T // N
    return np.arange(rank * share, (rank + 1) * share)


def zigzag_off_by_one(rank, N, T):
    """The late chunk 2N - rank: one past the end for rank 0."""
    size = T // (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (rank, 2 * N - rank)])


def zigzag_late_chunk_first(rank, N, T):
    size = T // (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (2 * N - 1 - rank, rank)])


def zigzag_mirrored_in_n(rank, N, T):
    """Chunks r and N - 1 - r of 2N: mirrored in N chunks, not 2N."""
    size = T // (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (rank, N - 1 - rank)])


def zigzag_as_a_list(rank, N, T):
    """Right: a list of ints, built by hand."""
    size = T // (2 * N)
    return [c * size + i for c in (rank, 2 * N - 1 - rank) for i in range(size)]


def zigzag_true_division(rank, N, T):
    """T / (2N): a float in Python 3, so float positions."""
    size = T / (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (rank, 2 * N - 1 - rank)])


def zigzag_chunks_apart(rank, N, T):
    """The two chunks returned side by side, not one after the other."""
    size = T // (2 * N)
    return [np.arange(c * size, (c + 1) * size) for c in (rank, 2 * N - 1 - rank)]


def zigzag_chunk_numbers(rank, N, T):
    """The chunks' numbers, not their positions."""
    return [rank, 2 * N - 1 - rank]


def zigzag_late_chunk_descending(rank, N, T):
    """The late chunk counted down from the end, mirroring the early one position by position."""
    size = T // (2 * N)
    early = np.arange(rank * size, (rank + 1) * size)
    return np.concatenate([early, T - 1 - early])


def zigzag_striped(rank, N, T):
    """Every N-th position from rank: round-robin, roughly balanced."""
    return np.arange(rank, T, N)


def zigzag_late_chunk_n_plus_rank(rank, N, T):
    """Chunks r and N + r: one from each half, but not mirrored."""
    size = T // (2 * N)
    return np.concatenate([np.arange(c * size, (c + 1) * size) for c in (rank, N + rank)])


def zigzag_with_np_r(rank, N, T):
    """Right: int32 positions from slices."""
    size = T // (2 * N)
    late = 2 * N - 1 - rank
    return np.r_[rank * size:(rank + 1) * size, late * size:(late + 1) * size].astype(np.int32)


def bytes_n_hops_forward(shape, dtype, N):
    """N hops forward, as many as the gradients take."""
    if N == 1:
        return 0, 0
    block = 2 * math.prod(shape)
    forward = N * block * np.dtype(dtype).itemsize
    return forward, (N - 1) * block * np.dtype(dtype).itemsize + N * block * 4


def bytes_gradients_in_the_activation_dtype(shape, dtype, N):
    if N == 1:
        return 0, 0
    block = 2 * math.prod(shape)
    forward = (N - 1) * block * np.dtype(dtype).itemsize
    return forward, forward + N * block * np.dtype(dtype).itemsize


def bytes_of_the_whole_sequence(shape, dtype, N):
    """n from the whole T: shape[2] taken as T, not T/N."""
    batch, heads, tokens, width = shape
    return solutions(16).ring_bytes_by_hand((batch, heads, tokens * N, width), dtype, N)


def bytes_always_float32_gradients(shape, dtype, N):
    """4 bytes a gradient even for float64 inputs."""
    if N == 1:
        return 0, 0
    block = 2 * math.prod(shape)
    forward = (N - 1) * block * np.dtype(dtype).itemsize
    return forward, forward + N * block * 4


def bytes_without_the_single_rank(shape, dtype, N):
    """No special case: one rank 'sends' its gradients home, to itself."""
    block = 2 * math.prod(shape)
    wide = 8 if np.dtype(dtype) == np.float64 else 4
    forward = (N - 1) * block * np.dtype(dtype).itemsize
    return forward, forward + N * block * wide


def _bytes(shape, dtype, N, kv_hops, grad_hops, values=2, kv_again=True, grad_size=None):
    if N == 1:
        return 0, 0
    n, itemsize = math.prod(shape), np.dtype(dtype).itemsize
    wide = grad_size or (8 if itemsize == 8 else 4)
    forward = kv_hops * values * n * itemsize
    return forward, (forward if kv_again else 0) + grad_hops * values * n * wide


def bytes_counting_values(shape, dtype, N):
    """Values, not bytes: no itemsize."""
    if N == 1:
        return 0, 0
    block = 2 * math.prod(shape)
    return (N - 1) * block, (N - 1) * block + N * block


def bytes_of_k_alone(shape, dtype, N):
    """n values a block: v forgotten."""
    return _bytes(shape, dtype, N, N - 1, N, values=1)


def bytes_backward_without_k_and_v(shape, dtype, N):
    """Backward counted as the gradients alone."""
    return _bytes(shape, dtype, N, N - 1, N, kv_again=False)


def bytes_gradients_n_minus_1_hops(shape, dtype, N):
    """dK and dV N - 1 hops, like k and v: one short of home."""
    return _bytes(shape, dtype, N, N - 1, N - 1)


def bytes_k_and_v_resent_in_float32(shape, dtype, N):
    """Backward's k and v counted in float32, like the gradients beside them."""
    forward, backward = _bytes(shape, dtype, N, N - 1, N)
    if N == 1:
        return 0, 0
    wide = 8 if np.dtype(dtype).itemsize == 8 else 4
    return forward, backward - forward + (N - 1) * 2 * math.prod(shape) * wide


def bytes_with_max_itemsize(shape, dtype, N):
    """Right: the accumulator's size as max(4, itemsize)."""
    if N == 1:
        return 0, 0
    block, itemsize = 2 * math.prod(shape), np.dtype(dtype).itemsize
    return (N - 1) * block * itemsize, (N - 1) * block * itemsize + N * block * max(4, itemsize)


@pytest.mark.parametrize("checker, solution", [
    ("check_merge", merge_with_logaddexp),
    ("check_merge", merge_row_by_row_with_where),
    ("check_zigzag_positions", zigzag_as_a_list),
    ("check_zigzag_positions", zigzag_with_np_r),
    ("check_ring_bytes_by_hand", bytes_with_max_itemsize),
])
def test_lesson16_checkers_accept_answers_the_spec_allows(checker, solution):
    import minimp.lessons.lesson16 as lesson

    assert getattr(lesson, checker)(solution, quiet=True).passed


WRONG = {
    "check_merge": [
        Wrong(merge_without_rescaling, "rescale"),
        Wrong(merge_averaging_outputs, "plain average"),
        Wrong(merge_without_the_max, "overflow"),
        Wrong(merge_keeping_the_first_max, "m = max(m_a, m_b)"),
        Wrong(merge_rescaling_the_wrong_way, "e^(m_block - m)"),
        Wrong(merge_dividing_acc_by_l, "divide by l only at the end"),
        Wrong(merge_rescaling_only_l, "rescale"),
        Wrong(merge_with_the_scales_swapped, "e^(m_block - m)"),
        Wrong(merge_with_one_max_for_all_rows, "row maximum"),
        Wrong(merge_skipping_a_block_with_a_masked_row, "row by row"),
        Wrong(merge_with_np_max, "np.maximum"),
    ],
    "check_zigzag_positions": [
        Wrong(zigzag_contiguous, "contiguous"),
        Wrong(zigzag_off_by_one, "off by one"),
        Wrong(zigzag_late_chunk_first, "early chunk first"),
        Wrong(zigzag_mirrored_in_n, "2N - 1 - rank"),
        Wrong(zigzag_true_division, "T // (2N)"),
        Wrong(zigzag_chunks_apart, "concatenate"),
        Wrong(zigzag_chunk_numbers, "positions c T/(2N)"),
        Wrong(zigzag_late_chunk_descending, "ascending"),
        Wrong(zigzag_striped, "striped"),
        Wrong(zigzag_late_chunk_n_plus_rank, "2N-1-r"),
    ],
    "check_ring_bytes_by_hand": [
        Wrong(bytes_n_hops_forward, "N - 1 hops"),
        Wrong(bytes_gradients_in_the_activation_dtype, "float32"),
        Wrong(bytes_of_the_whole_sequence, "not the whole T"),
        Wrong(bytes_always_float32_gradients, "float64"),
        Wrong(bytes_without_the_single_rank, "one rank has no ring"),
        Wrong(bytes_counting_values, "itemsize"),
        Wrong(bytes_of_k_alone, "2n values"),
        Wrong(bytes_backward_without_k_and_v, "k and v travel again"),
        Wrong(bytes_gradients_n_minus_1_hops, "home after N"),
        Wrong(bytes_k_and_v_resent_in_float32, "in the activation dtype"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(16, WRONG)
