"""Ulysses attention on the simulated world: the gathered outputs and gradients equal one process's
attention bit for bit (each head is computed as one process computes it), in fp32, fp16 and bf16,
with today's attention or tiled attention on each rank's heads; the bytes sent and the memory kept
equal their formulas; bad input is refused in one line before any message."""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from minimp import Tensor
from minimp import functional as F
from minimp.distributed import simulate
from minimp.distributed.buffers import CollectiveMismatchError
from minimp.distributed.protocol import Tag
from minimp.parallel.context import (AttentionBytes, ContextLayout, check_ulysses,
                                     ulysses_attention, ulysses_bytes, ulysses_memory)
from minimp.tensor import saved_bytes


@dataclass
class RankResult:
    """What one rank saw: its output and q, k, v gradients, the bytes it sent in forward and in
    backward, the saved bytes and the scalar all-reduces of the forward (the agreements)."""

    output: np.ndarray
    grads: list
    sent: tuple
    saved: int
    agreements: int


def run_ulysses(size, arrays, chunk_size=None):
    """Ulysses attention of q, k, v, then backward of grad_output, on `size` simulated ranks
    holding contiguous shards; eager_limit=0 makes every message wait for its receive (MPI's
    rendezvous), so a send posted before its receive deadlocks here."""
    layout, (*qkv, grad_output) = ContextLayout(size, "contiguous"), arrays

    def rank_main(comm):
        tensors = [Tensor(layout.shard(a, comm.rank, axis=2), requires_grad=True) for a in qkv]
        output = ulysses_attention(*tensors, comm, layout, chunk_size=chunk_size)
        forward, saved, agreements = comm.bytes_sent, saved_bytes(output), comm.scalar_allreduces
        output.backward(layout.shard(grad_output, comm.rank, axis=2))
        return RankResult(output.data, [t.grad for t in tensors],
                          (forward, comm.bytes_sent - forward), saved, agreements)

    results = simulate(size, rank_main, eager_limit=0)
    shards = [[r.output] + r.grads for r in results]
    return [layout.unshard([s[n] for s in shards], axis=2) for n in range(4)], results


def todays_attention(q, k, v):
    """minimp/models/gpt.py's attention: scores rounded once, the fused causal softmax, @ v."""
    return F.scaled_masked_softmax(q @ k.transpose(0, 1, 3, 2), 1 / math.sqrt(q.shape[-1])) @ v


def attention_run(attention, arrays):
    """One process: attention's output, the gradients of q, k, v, and the bytes it saved."""
    *qkv, grad_output = arrays
    tensors = [Tensor(a, requires_grad=True) for a in qkv]
    output = attention(*tensors)
    saved = saved_bytes(output)
    output.backward(grad_output)
    return [output.data] + [t.grad for t in tensors], saved


def inputs(rng, size, dtype=np.float32):
    """q, k, v and an output gradient, (B, H, T, D) = (2, 4, 4N, 4), unit scale."""
    return [rng.standard_normal((2, 4, 4 * size, 4)).astype(dtype) for _ in range(4)]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_ulysses_equals_one_process_bit_for_bit(size, dtype, rng):
    arrays = inputs(rng, size, dtype)
    got, _ = run_ulysses(size, arrays)
    expected, _ = attention_run(todays_attention, arrays)
    for name, a, b in zip(["output", "dq", "dk", "dv"], got, expected):
        assert a.dtype == dtype, name
        np.testing.assert_array_equal(a, b, err_msg=name)  # the same per-head computation


def test_ulysses_with_tiled_attention_equals_one_process_tiled_bit_for_bit(rng):
    arrays = inputs(rng, 2)
    got, _ = run_ulysses(2, arrays, chunk_size=2)
    expected, _ = attention_run(lambda q, k, v: F.tiled_attention(q, k, v, 2), arrays)
    for name, a, b in zip(["output", "dq", "dk", "dv"], got, expected):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("chunk_size", [None, 4], ids=["todays", "tiled"])
def test_bytes_and_memory_equal_their_formulas(size, chunk_size, rng):
    arrays = inputs(rng, size, np.float16)
    _, results = run_ulysses(size, arrays, chunk_size)
    shape = (2, 4, 4, 4)  # each rank's (B, H, T/N, D)
    nbytes = ulysses_bytes(shape, np.float16, size)
    memory = ulysses_memory(shape, np.float16, size, chunk_size)
    local = todays_attention if chunk_size is None else (
        lambda q, k, v: F.tiled_attention(q, k, v, chunk_size))
    _, one_process = attention_run(local, arrays)
    for result in results:
        assert result.sent == (nbytes.forward, nbytes.backward)
        assert result.saved == memory == one_process // size
        assert result.agreements == 4  # one scalar all-reduce per all-to-all of the forward
    # from rank 0: (N-1) messages per all-to-all, 4 in forward and 4 in backward, each 1/N of a
    # (2, 4, 4, 4) fp16 tensor: no counts, no float32 gradients
    sent = [m.nbytes for m in results.trace if m.source == 0]
    assert sent == [math.prod(shape) * 2 // size] * (8 * (size - 1))
    assert {m.tag for m in results.trace} == {Tag.ALL_TO_ALL}


def test_memory_formula_by_hand():
    # (B, H, T/N, D) = (1, 2, 3, 5) on N = 2, float32: n = 30 values; 1 head of T = 6 per rank
    assert ulysses_memory((1, 2, 3, 5), np.float32, 2) == 3 * 30 * 4 + 1 * 1 * 6 * 6 * 4
    assert ulysses_memory((1, 2, 3, 5), np.float32, 2, chunk_size=3) == 4 * 30 * 4 + 1 * 6 * 4
    assert ulysses_bytes((1, 2, 3, 5), np.float16, 2).forward == 4 * 15 * 2


def test_one_rank_is_plain_attention(rng):
    arrays = inputs(rng, 1)
    got, results = run_ulysses(1, arrays)
    expected, _ = attention_run(todays_attention, arrays)
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert results.trace == [] and results[0].sent == (0, 0)
    assert ulysses_bytes((2, 4, 4, 4), np.float32, 1) == AttentionBytes(0, 0)


def test_bad_input_fails_on_every_rank_in_one_line_before_any_message(rng):
    q = Tensor(rng.standard_normal((1, 3, 2, 4)).astype(np.float32))  # 3 heads

    def odd_heads(comm):
        with pytest.raises(ValueError, match=r"3 attention heads .* --cp 2 ranks: choose a --cp "
                                             r"that divides 3, or --cp-mode ring"):
            ulysses_attention(q, q, q, comm)
        return comm.scalar_allreduces

    results = simulate(2, odd_heads)
    assert results.trace == [] and list(results) == [0, 0]

    def wrong_layout(comm):
        q = Tensor(np.zeros((1, 2, 2, 4), np.float32))
        for layout in (ContextLayout(2), ContextLayout(4, "contiguous")):
            with pytest.raises(ValueError, match=r"pass ContextLayout\(2, 'contiguous'\)"):
                ulysses_attention(q, q, q, comm, layout)

    assert simulate(2, wrong_layout).trace == []
    with pytest.raises(ValueError, match="10 positions do not split over --cp 4 ranks: choose a "
                                         "context divisible by 4"):
        check_ulysses(heads=8, tokens=10, size=4)


def test_ranks_holding_unequal_shards_disagree_before_any_payload():
    def unequal(comm):  # rank 0 holds 2 positions, rank 1 holds 3
        q = Tensor(np.zeros((1, 2, 2 + comm.rank, 4), np.float32))
        with pytest.raises(CollectiveMismatchError, match="ranks disagree on the chunks"):
            ulysses_attention(q, q, q, comm)

    assert simulate(2, unequal).trace == []
