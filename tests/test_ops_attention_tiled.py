"""Tiled attention (online softmax): today's attention in fp32, fp16 and bf16, float64 gradient
checks, the visiting order as a contract, what it keeps for backward, and its bad inputs."""

import math

import ml_dtypes
import numpy as np
import pytest
from gradcheck import check_gradients

from minimp import Tensor
from minimp import functional as F
from minimp.tensor import saved_bytes

SHAPE = (2, 3, 12, 8)  # (B, H, T, D)


def todays_attention(q, k, v):
    """minimp/models/gpt.py's attention: scores rounded once, the fused causal softmax, @ v."""
    scores = q @ k.transpose(0, 1, 3, 2)
    return F.scaled_masked_softmax(scores, 1.0 / math.sqrt(q.shape[-1])) @ v


def run(attention, arrays, grad_output):
    """attention's output and the gradients of q, k, v for one backward of grad_output."""
    tensors = [Tensor(array, requires_grad=True) for array in arrays]
    output = attention(*tensors)
    output.backward(grad_output)
    return [output.data] + [tensor.grad for tensor in tensors]


def inputs(rng, dtype, shape=SHAPE):
    """q, k, v and a gradient of the output: unit-scale normal values in dtype."""
    return [rng.standard_normal(shape).astype(dtype) for _ in range(4)]


def ulp(dtype, value):
    """The spacing of dtype's numbers at value (a normal number)."""
    return 2.0 ** math.floor(math.log2(value)) * float(ml_dtypes.finfo(dtype).eps)


@pytest.mark.parametrize("chunk_size", [1, 4, 12])
def test_fp32_equals_todays_attention(chunk_size, rng):
    *arrays, grad = inputs(rng, np.float32)
    expected = run(todays_attention, arrays, grad)
    got = run(lambda q, k, v: F.tiled_attention(q, k, v, chunk_size), arrays, grad)
    for name, a, b in zip(["output", "dq", "dk", "dv"], got, expected):
        assert a.dtype == np.float32
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=["fp16", "bf16"])
def test_16_bit_output_within_two_ulps_of_its_largest_value(dtype, rng):
    q, k, v, _ = inputs(rng, dtype)
    expected = todays_attention(Tensor(q), Tensor(k), Tensor(v)).data.astype(np.float64)
    got = F.tiled_attention(Tensor(q), Tensor(k), Tensor(v), chunk_size=3).data
    assert got.dtype == dtype
    tolerance = 2 * ulp(dtype, np.abs(expected).max())
    assert np.abs(got.astype(np.float64) - expected).max() <= tolerance


def test_scores_are_rounded_once_into_float16_as_todays_attention_rounds_them(rng):
    """|q . k| in the hundreds: float16's spacing there (0.25 to 0.5) moves the scaled logits by
    up to 0.18, which the output shows unless both round the scores alike."""
    q, k, v, _ = inputs(rng, np.float16)
    q, k = (16 * x for x in (q, k))
    expected = todays_attention(Tensor(q), Tensor(k), Tensor(v)).data.astype(np.float64)
    got = F.tiled_attention(Tensor(q), Tensor(k), Tensor(v), chunk_size=4).data
    tolerance = 2 * ulp(np.float16, np.abs(expected).max())
    assert np.abs(got.astype(np.float64) - expected).max() <= tolerance


def test_gradients_equal_float64_central_differences(rng):
    q, k, v, _ = inputs(rng, np.float64, shape=(1, 2, 6, 3))
    order = [[0], [1, 0], [2, 0, 1]]  # not ascending: each query chunk's own order

    def attention(q, k, v):
        return F.tiled_attention(q, k, v, chunk_size=2, order=order)

    check_gradients(attention, [q, k, v], rng, differentiable=[0, 1, 2], name="tiled attention")


def test_the_order_changes_only_rounding_so_it_is_part_of_the_contract(rng):
    """The merge is not associative in floating point: two orders agree within rounding, not to
    the bit, which is why ring attention's bit-for-bit check needs the ring's order."""
    q, k, v, _ = (Tensor(a) for a in inputs(rng, np.float32, shape=(2, 4, 32, 8)))
    ascending = F.tiled_attention(q, k, v, chunk_size=4).data
    descending = F.tiled_attention(
        q, k, v, chunk_size=4, order=[list(range(i, -1, -1)) for i in range(8)]).data
    np.testing.assert_allclose(descending, ascending, rtol=1e-6, atol=1e-7)
    assert not np.array_equal(descending, ascending)
    again = F.tiled_attention(q, k, v, chunk_size=4).data
    assert np.array_equal(again, ascending)  # one order, one result


@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=["fp32", "fp16"])
def test_backward_keeps_q_k_v_output_and_log_sum_exp_not_probabilities(dtype, rng):
    """B H T (4 D itemsize + 4) bytes: q, k, v and O in dtype, the lse in float32."""
    arrays = [Tensor(a, requires_grad=True) for a in inputs(rng, dtype)[:3]]
    output = F.tiled_attention(*arrays, chunk_size=4)
    batch, heads, tokens, width = SHAPE
    itemsize = np.dtype(dtype).itemsize
    assert saved_bytes(output) == batch * heads * tokens * (4 * width * itemsize + 4)


def test_bad_inputs_fail_in_one_line_naming_the_fix(rng):
    q, k, v = (Tensor(a) for a in inputs(rng, np.float32)[:3])
    with pytest.raises(ValueError, match="chunk_size 5 must divide the sequence's 12 positions"):
        F.tiled_attention(q, k, v, chunk_size=5)
    with pytest.raises(ValueError, match=r"order\[1\] = \(1, 1\) must visit each key chunk 0..1"):
        F.tiled_attention(q, k, v, chunk_size=6, order=[[0], [1, 1]])
    with pytest.raises(ValueError, match="order has 1 entries, one per query chunk"):
        F.tiled_attention(q, k, v, chunk_size=6, order=[[0]])
    with pytest.raises(ValueError, match="must all be"):
        F.tiled_attention(q, Tensor(k.data[:, :, :6]), v, chunk_size=6)
