"""The 16-bit values every op computes, pinned bit for bit against "compute in float32 from the same
16-bit inputs, round once": exhaustively over all 65,536 float16 and bfloat16 values for the unary
ops, with hypothesis and fixed edge cases for the binary ops, reductions and products.

A test that only checks that an output *is* float16 cannot tell a right float16 from a wrong one
(a loss computed in 16 bits, a Linear that rounds twice, a ReLU that lets -inf through); these can.
"""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp import Tensor, ops
from minimp.function import Context
from minimp import functional as F

F16, BF16, F32 = np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
DTYPES = [F16, BF16]


def every_value(dtype):
    """All 65,536 bit patterns of a 16-bit float (NaNs, infinities and subnormals included)."""
    return np.arange(2**16, dtype=np.uint16).view(dtype)


def same_bits(actual, expected):
    """Equal bit for bit, except that any NaN equals any NaN (payloads are not the promise)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    nan = np.isnan(expected.astype(F32))
    assert np.array_equal(np.isnan(actual.astype(F32)), nan)
    width = np.dtype(f"uint{8 * actual.dtype.itemsize}")
    mismatch = (actual.view(width) != expected.view(width)) & ~nan
    assert not mismatch.any(), (actual[mismatch][:5], expected[mismatch][:5])


def with_grad(function, x, grad_output):
    """(forward output, dL/dx) of function at x for the given dL/dy, as arrays."""
    tensor = Tensor(x.copy(), requires_grad=True)
    y = function(tensor)
    y.backward(grad_output)
    return y.data, tensor.grad


def wide(x):
    return x.astype(F32)


# (name, op on a Tensor, forward reference on float32, backward reference(x32, y32, g32))
UNARY = [
    ("exp", lambda t: t.exp(), np.exp, lambda x, y, g: g * y),
    ("log", lambda t: t.log(), np.log, lambda x, y, g: g / x),
    ("tanh", lambda t: t.tanh(), np.tanh, lambda x, y, g: g * (1.0 - y * y)),
    ("neg", lambda t: -t, np.negative, lambda x, y, g: -g),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name, op, forward, backward", UNARY, ids=[r[0] for r in UNARY])
def test_unary_ops_round_once_on_every_16_bit_value(dtype, name, op, forward, backward):
    x = every_value(dtype)
    g = np.random.default_rng(0).permutation(every_value(dtype))  # every gradient value too
    with np.errstate(all="ignore"):
        y, grad = with_grad(op, x, g)
        expected_y = forward(wide(x)).astype(dtype)  # computed once in float32, rounded once
        # backward reads what forward stored (y rounded to 16 bits), widened again
        expected_grad = backward(wide(x), wide(expected_y), wide(g)).astype(dtype)
    same_bits(y, expected_y)
    same_bits(grad, expected_grad)


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_relu_sends_every_negative_and_minus_infinity_to_plus_zero(dtype):
    x = every_value(dtype)
    g = np.random.default_rng(1).permutation(every_value(dtype))
    y, grad = with_grad(lambda t: t.relu(), x, g)
    keep = np.isnan(wide(x)) | (wide(x) > 0)  # NaN stays NaN, as max(x, 0) keeps it
    same_bits(y, np.where(keep, x, np.zeros_like(x)))  # -0.0 and -inf become +0.0
    passes = (wide(y) > 0) | np.isnan(wide(y))  # PyTorch: the gradient passes unless y <= 0
    same_bits(grad, np.where(passes, g, np.zeros_like(g)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_relu_in_16_bits_compares_no_floats_so_a_nan_raises_no_invalid_flag(dtype):
    """Both directions of a 16-bit ReLU read the bits (as its docstring says), so every value,
    NaNs included, goes through with floating-point errors raised. A float comparison would not:
    bfloat16's `NaN <= 0` sets the invalid flag."""
    x = every_value(dtype)
    with np.errstate(all="raise"):
        y, grad = with_grad(lambda t: t.relu(), x, np.ones_like(x))
    assert np.isnan(wide(y)).sum() == np.isnan(wide(x)).sum() > 0
    np.testing.assert_array_equal(wide(grad), (wide(x) > 0) | np.isnan(wide(x)))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_relu_backward_keeps_its_rule_for_every_saved_16_bit_pattern(dtype):
    """dL/dx = dL/dy where y is not <= 0, read from the saved y's bits: for every pattern, also
    those forward never outputs (negatives and -inf; -NaNs lie between -inf and 0 as integers),
    so that the rule stays the docstring's, and the wide path's, whatever backward is given."""
    y = every_value(dtype)
    g = np.random.default_rng(3).permutation(every_value(dtype))
    ctx = Context((True,))
    ctx.save_for_backward(y)
    grad = ops.elementwise.ReLU.backward(ctx, g)
    with np.errstate(invalid="ignore"):  # bfloat16's NaN <= 0
        passes = ~(wide(y) <= 0)
    same_bits(grad, np.where(passes, g, np.zeros_like(g)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_relu_in_float32_and_float64_keeps_the_same_rule(dtype):
    """The wide dtypes take another path (maximum forward, one comparison backward): every float16
    value widened, both NaN signs, every gradient value, and the same rule as in 16 bits."""
    with np.errstate(invalid="ignore"):  # NaNs widened
        x = wide(every_value(np.float16)).astype(dtype)
    g = np.random.default_rng(2).permutation(x)
    y, grad = with_grad(lambda t: t.relu(), x, g)
    with np.errstate(invalid="ignore"):
        same_bits(y, np.maximum(x, dtype(0)))
        passes = (y > 0) | np.isnan(y)
    same_bits(grad, np.where(passes, g, np.zeros_like(g)))
    assert np.signbit(grad[~passes]).sum() == 0  # dropped gradients are +0.0, even -0, inf, NaN


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_gelu_rounds_its_float32_tanh_form_once(dtype):
    x = every_value(dtype)
    with np.errstate(all="ignore"):
        y = F.gelu(Tensor(x)).data
        x32 = wide(x)
        inner = np.float32(np.sqrt(2.0 / np.pi)) * (x32 + np.float32(0.044715) * x32**3)
        expected = (np.float32(0.5) * x32 * (np.float32(1.0) + np.tanh(inner))).astype(dtype)
    finite = np.isfinite(x32) & np.isfinite(wide(expected))
    np.testing.assert_allclose(wide(y)[finite], wide(expected)[finite], rtol=2.0**-7, atol=0)
    exact = np.mean(y[finite].view(np.uint16) == expected[finite].view(np.uint16))
    assert exact > 0.99  # the same float32 formula, up to its association of products


def sixteen_bit_floats(dtype):
    """Finite and non-finite 16-bit values, subnormals and the largest included."""
    edges = [0.0, -0.0, 1.0, -1.0, 65504.0, -65504.0, 2.0**-24, 2.0**-14, np.inf, -np.inf, np.nan]
    if dtype == BF16:
        edges = [0.0, -0.0, 1.0, 3.3895e38, 2.0**-133, 2.0**-126, np.inf, -np.inf, np.nan]
    pattern = st.integers(0, 2**16 - 1).map(lambda b: np.uint16(b).view(dtype))
    return st.one_of(pattern, st.sampled_from([np.asarray(e).astype(dtype) for e in edges]))


BINARY = [
    ("add", lambda a, b: a + b, lambda a, b: a + b),
    ("sub", lambda a, b: a - b, lambda a, b: a - b),
    ("mul", lambda a, b: a * b, lambda a, b: a * b),
    ("div", lambda a, b: a / b, lambda a, b: a / b),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
@pytest.mark.parametrize("name, op, reference", BINARY, ids=[r[0] for r in BINARY])
@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_binary_ops_compute_in_float32_and_round_once(dtype, name, op, reference, data):
    values = st.lists(sixteen_bit_floats(dtype), min_size=6, max_size=6)
    a = np.array(data.draw(values), dtype=dtype).reshape(2, 3)
    b = np.array(data.draw(values), dtype=dtype).reshape(2, 3)
    with np.errstate(all="ignore"):
        got = op(Tensor(a), Tensor(b)).data
        expected = reference(wide(a), wide(b)).astype(dtype)
    same_bits(got, expected)


def test_a_broadcast_gradient_is_summed_in_float32_and_rounded_once():
    """dL/db of a + b with b broadcast over 4,096 rows: 4,096 float16 ones sum to 4096 only when
    the sum runs in float32 (a float16 running sum stops at 2048)."""
    a = Tensor(np.zeros((4096, 3), F16), requires_grad=True)
    b = Tensor(np.zeros(3, F16), requires_grad=True)
    (a + b).backward(np.ones((4096, 3), F16))
    same_bits(b.grad, np.full(3, 4096, F16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_layer_norm_backward_sums_in_float32_and_rounds_once(dtype):
    """LayerNorm's three gradients from a 16-bit dL/dy: dL/dbias and dL/dweight sum over the 64
    positions of (2, 32, 16), dL/dx averages over the 16 features. Each sum runs in float32 and
    is rounded once; one summed in 16 bits rounds at every add (a float16 total between 8 and 16
    has an ulp of 2^-7), and its last bits move."""
    rng = np.random.default_rng(12)
    x = rng.standard_normal((2, 32, 16)).astype(dtype)
    weight = rng.uniform(0.5, 1.5, 16).astype(dtype)
    bias = rng.uniform(-0.5, 0.5, 16).astype(dtype)
    g = rng.standard_normal(x.shape).astype(dtype)
    tensors = [Tensor(a, requires_grad=True) for a in (x, weight, bias)]
    F.layer_norm(*tensors).backward(g)
    # LayerNorm's docstring formulas in float32 from the same 16-bit inputs, rounded once
    x32, g32 = wide(x), wide(g)
    mean = x32.mean(axis=-1, keepdims=True)
    inverse_std = 1.0 / np.sqrt(((x32 - mean) ** 2).mean(axis=-1, keepdims=True) + 1e-5)
    normalized = (x32 - mean) * inverse_std
    scaled = g32 * wide(weight)
    grad_x = inverse_std * (scaled - scaled.mean(axis=-1, keepdims=True)
                            - normalized * (scaled * normalized).mean(axis=-1, keepdims=True))
    same_bits(tensors[0].grad, grad_x.astype(dtype))
    same_bits(tensors[1].grad, (g32 * normalized).sum(axis=(0, 1)).astype(dtype))
    same_bits(tensors[2].grad, g32.sum(axis=(0, 1)).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_sum_and_mean_accumulate_in_float32_and_round_once(dtype):
    x = np.random.default_rng(2).standard_normal((64, 300)).astype(dtype)
    same_bits(Tensor(x).sum(axis=1).data, wide(x).sum(axis=1).astype(dtype))
    same_bits(Tensor(x).mean(axis=0).data, wide(x).mean(axis=0).astype(dtype))
    same_bits(Tensor(x).sum().data, np.asarray(wide(x).sum()).astype(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_linear_adds_the_bias_before_its_one_rounding(dtype):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 16)).astype(dtype)
    w = (rng.standard_normal((5, 16)) * 0.3).astype(dtype)
    b = rng.standard_normal(5).astype(dtype)
    y = F.linear(Tensor(x), Tensor(w), Tensor(b)).data
    same_bits(y, (wide(x) @ wide(w).T + wide(b)).astype(dtype))  # not round(round(xW) + b)
    g = rng.standard_normal((8, 5)).astype(dtype)
    tensors = [Tensor(a, requires_grad=True) for a in (x, w, b)]
    F.linear(*tensors).backward(g)
    same_bits(tensors[0].grad, (wide(g) @ wide(w)).astype(dtype))
    same_bits(tensors[1].grad, (wide(g).T @ wide(x)).astype(dtype))
    same_bits(tensors[2].grad, wide(g).sum(axis=0).astype(dtype))


def test_matmul_rounds_a_float32_product_once():
    rng = np.random.default_rng(4)
    a = rng.standard_normal((3, 7, 9)).astype(F16)
    b = rng.standard_normal((9, 4)).astype(F16)
    same_bits((Tensor(a) @ Tensor(b)).data, (wide(a) @ wide(b)).astype(F16))


@pytest.mark.parametrize("dtype", DTYPES, ids=["float16", "bfloat16"])
def test_the_loss_is_float32_computed_from_the_16_bit_logits(dtype):
    logits = (np.random.default_rng(5).standard_normal((6, 10)) * 4).astype(dtype)
    targets = np.array([0, 3, 9, 1, 1, 7])
    loss = F.cross_entropy(Tensor(logits), targets).data
    x = wide(logits)
    shifted = x - x.max(axis=1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    expected = -log_p[np.arange(6), targets].mean(dtype=F32)
    assert loss.dtype == F32 and loss.tobytes() == np.float32(expected).tobytes()


def test_softmax_and_cast_round_once():
    x = (np.random.default_rng(6).standard_normal((4, 9)) * 3).astype(F16)
    x32 = wide(x)
    shifted = x32 - x32.max(axis=-1, keepdims=True)
    expected = np.exp(shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True)))
    same_bits(F.softmax(Tensor(x)).data, expected.astype(F16))
    same_bits(ops.Cast.apply(Tensor(x32 * 3), dtype=F16).data, (x32 * 3).astype(F16))
