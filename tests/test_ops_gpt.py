"""The GPT's ops as one table: float64 gradient checks, and the round-once rule in fp16 and bf16."""

import math

import ml_dtypes
import numpy as np
import pytest
from gradcheck import check_gradients

from minimp import Tensor
from minimp import functional as F

IDS = np.array([[3, 1, 3], [0, 3, 4]])  # token 3 three times: its gradient rows must add up


def half_upper_mask():
    mask = np.ones((4, 5), bool)
    mask[1] = False  # query 1 sees nothing: a fully masked row
    mask[:, 4] = False  # key 4 is padding
    return mask


# (name, function of tensors, input shapes or arrays, indices of the inputs to differentiate)
OPS = [
    ("gelu", lambda x: F.gelu(x), [(3, 5)], [0]),
    ("index slice", lambda x: x[1:, ::2], [(3, 5)], [0]),
    ("index int, None, Ellipsis", lambda x: x[1, None, ..., 2:4], [(3, 4, 5)], [0]),
    ("split", lambda x: (lambda a, b, c: a * c - b)(*F.split(x, 2, axis=1)), [(3, 6)], [0]),
    ("embedding", lambda ids, w: F.embedding(ids, w), [IDS, (5, 4)], [1]),
    ("softmax causal", lambda s: F.scaled_masked_softmax(s, 0.7), [(2, 3, 4, 4)], [0]),
    ("softmax keys > queries", lambda s: F.scaled_masked_softmax(s, 0.5), [(2, 3, 6)], [0]),
    (
        "softmax masked rows",
        lambda s: F.scaled_masked_softmax(s, 1.3, causal=False, mask=half_upper_mask()),
        [(2, 4, 5)],
        [0],
    ),
    ("dropout", lambda x: F.dropout(x, 0.3, 7, 2, 1, [5, 9]), [(2, 3, 4)], [0]),
    ("matmul 4-d", lambda a, b: a @ b, [(2, 3, 4, 5), (2, 3, 5, 2)], [0, 1]),
    ("matmul 4-d broadcast", lambda a, b: a @ b, [(2, 1, 4, 5), (3, 5, 2)], [0, 1]),
    ("matmul 4-d transposed", lambda a, b: a @ b.transpose(0, 1, 3, 2), [(2, 3, 4, 5)] * 2, [0, 1]),
]


def make(spec, rng):
    return spec.copy() if isinstance(spec, np.ndarray) else rng.standard_normal(spec)


@pytest.mark.parametrize("name, op, specs, differentiable", OPS, ids=[row[0] for row in OPS])
def test_backward_matches_central_differences(name, op, specs, differentiable, rng):
    arrays = [make(spec, rng) for spec in specs]
    check_gradients(op, arrays, rng, differentiable, name=name)


def test_embedding_of_a_repeated_token_sums_its_gradients():
    weight = Tensor(np.zeros((5, 2)), requires_grad=True)
    F.embedding(IDS, weight).sum().backward()
    np.testing.assert_array_equal(weight.grad[:, 0], [1, 1, 0, 3, 1])


# ----- the round-once rule: 16-bit in, float32 inside, one rounding out ------------------------
def gelu32(x):
    inner = np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))
    return 0.5 * x * (1.0 + inner)


def gelu_grad32(x, g):
    t = np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x * x * x))
    slope = math.sqrt(2 / math.pi) * (1.0 + 3.0 * 0.044715 * x * x)
    return g * (0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * slope)


def softmax32(s, scale):
    wide = np.where(np.tri(s.shape[-2], s.shape[-1], dtype=bool), s * scale, -np.inf)
    exps = np.exp(wide - wide.max(axis=-1, keepdims=True))
    return exps / exps.sum(axis=-1, keepdims=True)


def softmax_grad32(y, g, scale):
    return scale * (y * (g - (g * y).sum(axis=-1, keepdims=True)))


DTYPES = [np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)]


def same_bits(ours, reference_float32, dtype, what):
    assert ours.dtype == dtype, f"{what}: stored in {ours.dtype}, expected {dtype}"
    expected = reference_float32.astype(np.float32).astype(dtype)  # the one rounding
    np.testing.assert_array_equal(ours.view(np.uint16), expected.view(np.uint16), err_msg=what)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_rounds_once(dtype, rng):
    x = (rng.standard_normal((64, 33)) * 4).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    tensor = Tensor(x, requires_grad=True)
    y = F.gelu(tensor)
    y.backward(g)
    wide = x.astype(np.float32)
    same_bits(y.data, gelu32(wide), dtype, "gelu forward")
    same_bits(tensor.grad, gelu_grad32(wide, g.astype(np.float32)), dtype, "gelu backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_scaled_masked_softmax_rounds_once(dtype, rng):
    s = (rng.standard_normal((2, 3, 16, 16)) * 30).astype(dtype)
    g = rng.standard_normal(s.shape).astype(dtype)
    tensor = Tensor(s, requires_grad=True)
    y = F.scaled_masked_softmax(tensor, 0.125)
    y.backward(g)
    same_bits(y.data, softmax32(s.astype(np.float32), 0.125), dtype, "softmax forward")
    # backward reads the stored (rounded) y, as the op keeps nothing else
    grad = softmax_grad32(y.data.astype(np.float32), g.astype(np.float32), 0.125)
    same_bits(tensor.grad, grad, dtype, "softmax backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_dropout_rounds_once(dtype, rng):
    x = rng.standard_normal((4, 8, 16)).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    tensor = Tensor(x, requires_grad=True)
    y = F.dropout(tensor, 0.1, 0, 1, 2, np.arange(4))
    y.backward(g)
    keep = y.data != 0  # (no x here is 0)
    scale = 1.0 / (1.0 - 0.1)
    same_bits(y.data, np.where(keep, x.astype(np.float32) * scale, 0), dtype, "dropout forward")
    same_bits(tensor.grad, np.where(keep, g.astype(np.float32) * scale, 0), dtype, "backward")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_embedding_copies_rows_and_sums_gradients_in_float32(dtype, rng):
    """Gradients that are multiples of 1/64 below 16: every float32 sum of them is exact, so the
    one rounding of the exact sum is the only correct answer (a 16-bit running sum rounds often)."""
    ids = rng.integers(0, 4, size=(8, 32))  # 256 positions into 4 rows: ~64 terms per row
    weight = Tensor(rng.standard_normal((4, 16)).astype(dtype), requires_grad=True)
    g = (rng.integers(-1000, 1000, size=(8, 32, 16)) / 64).astype(dtype)
    y = F.embedding(ids, weight)
    np.testing.assert_array_equal(y.data.view(np.uint16), weight.data[ids].view(np.uint16))
    y.backward(g)
    exact = np.zeros((4, 16))
    np.add.at(exact, ids.reshape(-1), g.reshape(-1, 16).astype(np.float64))
    same_bits(weight.grad, exact, dtype, "embedding backward")
    running = np.zeros((4, 16), dtype)
    for row, grad in zip(ids.reshape(-1), g.reshape(-1, 16)):
        running[row] = (running[row].astype(np.float32) + grad.astype(np.float32)).astype(dtype)
    assert (running != weight.grad).any(), "a 16-bit running sum should have differed"


def test_index_takes_basic_indexing_only():
    with pytest.raises(TypeError, match="ints, slices, None and Ellipsis"):
        Tensor(np.ones((3, 2)))[np.array([0, 0])]


# ----- in place and written out: the same operations in the same order, so the same bits --------
def layer_norm_reference(x, weight, bias, g, eps=1e-5):
    """LayerNorm forward and backward as the formulas read, each step a new array."""
    mean = x.mean(axis=-1, keepdims=True)
    inverse_std = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
    normalized = (x - mean) * inverse_std
    y = normalized * weight + bias
    grad_weight, grad_bias = (g * normalized).sum(axis=(0, 1)), g.sum(axis=(0, 1))
    gw = g * weight
    grad_x = inverse_std * (gw - gw.mean(axis=-1, keepdims=True)
                            - normalized * (gw * normalized).mean(axis=-1, keepdims=True))
    return y, grad_x, grad_weight, grad_bias


def assert_same_bits(ours, theirs, what):
    assert ours.dtype == theirs.dtype, what
    np.testing.assert_array_equal(ours.view(np.uint8), theirs.view(np.uint8), err_msg=what)


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
def test_ops_computed_in_place_equal_their_formulas_written_out_bit_for_bit(dtype, rng):
    # GELU, LayerNorm and the attention softmax work in place in memory-pool arrays (fewer passes
    # and no page faults); reordering a single product or sum would change a last bit here
    x = (rng.standard_normal((4, 16, 40)) * 4).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    tensor = Tensor(x, requires_grad=True)
    F.gelu(tensor).backward(g)
    assert_same_bits(F.gelu(Tensor(x)).data, gelu32(x), "gelu forward")
    assert_same_bits(tensor.grad, gelu_grad32(x, g), "gelu backward")

    weight, bias = (rng.standard_normal(40).astype(dtype) for _ in range(2))
    tensors = [Tensor(array, requires_grad=True) for array in (x, weight, bias)]
    y = F.layer_norm(*tensors)
    y.backward(g)
    expected = layer_norm_reference(x, weight, bias, g)
    for ours, theirs, what in zip((y.data, *(t.grad for t in tensors)), expected,
                                  ("forward", "dL/dx", "dL/dweight", "dL/dbias")):
        assert_same_bits(ours, theirs, f"layer_norm {what}")

    s = (rng.standard_normal((2, 3, 16, 16)) * 3).astype(dtype)
    gs = rng.standard_normal(s.shape).astype(dtype)
    scores = Tensor(s, requires_grad=True)
    y = F.scaled_masked_softmax(scores, 0.3)
    y.backward(gs)
    assert_same_bits(y.data, softmax32(s, 0.3), "softmax forward")
    assert_same_bits(scores.grad, softmax_grad32(y.data, gs, 0.3), "softmax backward")
