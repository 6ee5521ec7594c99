"""Ring attention on the simulated world: each rank's forward equals tiled attention in the ring's
order bit for bit, the gathered outputs and gradients equal one process's attention, and the bytes
sent, the memory kept and the causal work equal their formulas."""

import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np
import pytest

from minimp import Tensor
from minimp import functional as F
from minimp.distributed import simulate
from minimp.distributed.protocol import Tag
from minimp.parallel.context import ContextLayout, ring_attention, ring_bytes, ring_memory
from minimp.parallel.context import ring_order
from minimp.parallel.context.ring import AttentionStats
from minimp.tensor import saved_bytes

CASES = [(2, "zigzag"), (2, "contiguous"), (4, "zigzag"), (4, "contiguous")]


@dataclass
class RankResult:
    """What one rank saw: its output and gradients, bytes sent in forward and in backward, the
    saved bytes, the ring's buffers in each pass, and the causal blocks it computed."""

    output: np.ndarray
    grads: list
    sent: tuple
    saved: int
    buffers: tuple
    work: float


def run_ring(layout, arrays):
    """Ring attention of q, k, v, then backward of grad_output, on layout.size simulated ranks;
    eager_limit=0 makes every message wait for its receive (MPI's rendezvous), so any send
    posted in the wrong order deadlocks here."""
    *qkv, grad_output = arrays

    def rank_main(comm):
        tensors = [Tensor(layout.shard(a, comm.rank, axis=2), requires_grad=True) for a in qkv]
        stats = AttentionStats()
        output = ring_attention(*tensors, comm, layout, stats)
        forward, saved = comm.bytes_sent, saved_bytes(output)
        output.backward(layout.shard(grad_output, comm.rank, axis=2))
        return RankResult(output.data, [t.grad for t in tensors],
                          (forward, comm.bytes_sent - forward), saved,
                          (stats.buffer_bytes, stats.backward_buffer_bytes), stats.blocks)

    return simulate(layout.size, rank_main, eager_limit=0)


def gathered(layout, results):
    """The whole sequence's output and q, k, v gradients from every rank's shards."""
    shards = [[r.output] + r.grads for r in results]
    return [layout.unshard([s[n] for s in shards], axis=2) for n in range(4)]


def whole_order(layout):
    """Every grid chunk's visiting order, each from the ring of the rank that holds it."""
    order = [None] * layout.chunks
    for rank in range(layout.size):
        for i, keys in ring_order(layout, rank).items():
            order[i] = list(keys)
    return order


def attention_run(attention, arrays):
    """One process: attention's output and the gradients of q, k, v."""
    *qkv, grad_output = arrays
    tensors = [Tensor(a, requires_grad=True) for a in qkv]
    output = attention(*tensors)
    output.backward(grad_output)
    return [output.data] + [t.grad for t in tensors]


def todays_attention(q, k, v):
    """minimp/models/gpt.py's attention: scores rounded once, the fused causal softmax, @ v."""
    return F.scaled_masked_softmax(q @ k.transpose(0, 1, 3, 2), 1 / math.sqrt(q.shape[-1])) @ v


def inputs(rng, size, dtype=np.float32):
    """q, k, v and an output gradient, (B, H, T, D) = (2, 2, 4N, 4), unit scale."""
    return [rng.standard_normal((2, 2, 4 * size, 4)).astype(dtype) for _ in range(4)]


@pytest.mark.parametrize("size, kind", CASES)
def test_ring_equals_tiled_in_its_order_bit_for_bit_and_one_process(size, kind, rng):
    layout, arrays = ContextLayout(size, kind), inputs(rng, size)
    got = gathered(layout, run_ring(layout, arrays))
    tiled = attention_run(
        lambda q, k, v: F.tiled_attention(q, k, v, 2, order=whole_order(layout)), arrays)
    np.testing.assert_array_equal(got[0], tiled[0])  # forward: the same merges, the same bits
    for name, a, b in zip(["dq", "dk", "dv"], got[1:], tiled[1:]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7, err_msg=name)
    one_process = attention_run(todays_attention, arrays)
    for name, a, b in zip(["output", "dq", "dk", "dv"], got, one_process):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("size, kind", [(2, "zigzag"), (4, "contiguous")])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_ring_within_two_ulps_of_the_largest_output(dtype, size, kind, rng):
    layout, arrays = ContextLayout(size, kind), inputs(rng, size, dtype)
    output = gathered(layout, run_ring(layout, arrays))[0]
    expected = todays_attention(*(Tensor(a) for a in arrays[:3])).data.astype(np.float64)
    largest = np.abs(expected).max()
    ulp = 2.0 ** math.floor(math.log2(largest)) * float(ml_dtypes.finfo(dtype).eps)
    assert output.dtype == dtype
    assert np.abs(output.astype(np.float64) - expected).max() <= 2 * ulp


@pytest.mark.parametrize("size, kind", CASES)
def test_bytes_memory_and_work_equal_their_formulas(size, kind, rng):
    layout, arrays = ContextLayout(size, kind), inputs(rng, size, np.float16)
    results = run_ring(layout, arrays)
    shape = (2, 2, 4, 4)  # each rank's (B, H, T/N, D)
    nbytes, memory = ring_bytes(shape, np.float16, size), ring_memory(shape, np.float16, size)
    one_process = (2 * 2 * 4 * size) * (4 * 4 * 2 + 4)  # B H T (4 D itemsize + 4): tiled's
    for rank, result in enumerate(results):
        assert result.sent == (nbytes.forward, nbytes.backward)
        assert result.saved == memory.saved == one_process // size
        assert result.buffers == (memory.forward_buffers, memory.backward_buffers)
        assert result.work == layout.causal_work(rank)
    block = 2 * math.prod(shape)  # k and v: fp16 values; their gradients float32
    by_tag = {tag: [m.nbytes for m in results.trace if m.tag == tag and m.source == 0]
              for tag in (Tag.CONTEXT_KEYS_VALUES, Tag.CONTEXT_GRADIENTS)}
    assert by_tag[Tag.CONTEXT_KEYS_VALUES] == [block * 2] * (2 * (size - 1))  # forward, backward
    assert by_tag[Tag.CONTEXT_GRADIENTS] == [block * 4] * size  # N hops: the last one home
    work = [r.work for r in results]
    assert max(work) / min(work) == (1.0 if kind == "zigzag" else 2 * size - 1)


def test_one_rank_is_plain_tiled_attention(rng):
    layout, arrays = ContextLayout(1), inputs(rng, 1)
    results = run_ring(layout, arrays)
    tiled = attention_run(lambda q, k, v: F.tiled_attention(q, k, v, chunk_size=2), arrays)
    for a, b in zip([results[0].output] + results[0].grads, tiled):
        np.testing.assert_array_equal(a, b)
    assert results.trace == [] and results[0].sent == (0, 0)
    memory = ring_memory((2, 2, 4, 4), np.float32, 1)  # one (k, v) buffer, one (dK, dV)
    assert results[0].buffers == (memory.forward_buffers, memory.backward_buffers) == (512, 1024)


def test_bad_input_fails_on_every_rank_in_one_line_before_any_message(rng):
    layout = ContextLayout(2)

    def odd_shard(comm):  # T = 6 gives each of 2 ranks 3 positions: no 2 equal chunks
        q = Tensor(rng.standard_normal((1, 1, 3, 4)).astype(np.float32))
        with pytest.raises(ValueError, match="T/N = 3 positions.*context divisible by 2N = 4"):
            ring_attention(q, q, q, comm, layout)

    assert simulate(2, odd_shard).trace == []

    def wrong_group(comm):
        q = Tensor(np.zeros((1, 1, 4, 4), np.float32))
        with pytest.raises(ValueError, match=r"communicator has 2 \(build ContextLayout\(2\)\)"):
            ring_attention(q, q, q, comm, ContextLayout(4))

    assert simulate(2, wrong_group).trace == []
