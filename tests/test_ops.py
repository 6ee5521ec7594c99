"""Every op's backward against float64 central differences, as one table (broadcasting included)."""

import numpy as np
import pytest

from minimp import Tensor, ops
from minimp import functional as F
from minimp.function import Context
from minimp.precision import BFLOAT16

# (name, function of tensors, input shapes, positive inputs only)
OPS = [
    ("add", lambda a, b: a + b, [(3, 4), (3, 4)], False),
    ("add broadcast row", lambda a, b: a + b, [(3, 4), (4,)], False),
    ("add broadcast column", lambda a, b: a + b, [(3, 1), (1, 4)], False),
    ("sub broadcast", lambda a, b: a - b, [(2, 3, 4), (3, 1)], False),
    ("sub scalar", lambda a: a - 2.0, [(3, 4)], False),
    ("mul broadcast", lambda a, b: a * b, [(3, 4), (1, 4)], False),
    ("div", lambda a, b: a / b, [(3, 4), (3, 4)], True),
    ("div broadcast", lambda a, b: a / b, [(3, 4), (4,)], True),
    ("scalar ops", lambda a: (2.0 - a) * 3.0 / 4.0 + 1.0, [(3, 4)], False),
    ("neg", lambda a: -a, [(3, 4)], False),
    ("exp", lambda a: a.exp(), [(3, 4)], False),
    ("log", lambda a: a.log(), [(3, 4)], True),
    ("tanh", lambda a: a.tanh(), [(3, 4)], False),
    ("relu", lambda a: a.relu(), [(3, 4)], False),
    ("sum all", lambda a: a.sum(), [(3, 4)], False),
    ("sum axis", lambda a: a.sum(axis=0), [(3, 4)], False),
    ("sum keepdims", lambda a: a.sum(axis=1, keepdims=True), [(3, 4)], False),
    ("mean all", lambda a: a.mean(), [(3, 4)], False),
    ("mean axes", lambda a: a.mean(axis=(0, 2)), [(2, 3, 4)], False),
    ("mean keepdims", lambda a: a.mean(axis=1, keepdims=True), [(3, 4)], False),
    ("reshape", lambda a: a.reshape(4, 3), [(3, 4)], False),
    ("transpose", lambda a: a.T, [(3, 4)], False),
    ("transpose axes", lambda a: a.transpose(1, 2, 0), [(2, 3, 4)], False),
    ("matmul", lambda a, b: a @ b, [(3, 4), (4, 5)], False),
    ("matmul batched broadcast", lambda a, b: a @ b, [(2, 3, 4), (4, 5)], False),
    ("linear", lambda x, w, b: F.linear(x, w, b), [(5, 4), (3, 4), (3,)], False),
    ("linear 3d input", lambda x, w, b: F.linear(x, w, b), [(2, 5, 4), (3, 4), (3,)], False),
    ("softmax", lambda a: F.softmax(a), [(3, 5)], False),
    ("log_softmax", lambda a: F.log_softmax(a, axis=0), [(3, 5)], False),
    ("log_softmax last axis", lambda a: F.log_softmax(a), [(3, 5)], False),
    ("cross_entropy", lambda a: F.cross_entropy(a, np.array([0, 4, 2])), [(3, 5)], False),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, w, b), [(3, 6), (6,), (6,)], False),
    ("shared input", lambda a: a * a + a, [(3, 4)], False),
    ("index_add", lambda a: F.index_add(a, np.array([2, 0, 2, 3]), 5), [(4, 3)], False),
    ("index_add no rows", lambda a: F.index_add(a, np.zeros(0, np.int64), 2), [(0, 3)], False),
]


def numerical_gradient(function, arrays, index, epsilon=1e-6):
    """d(sum(function * weights))/d(arrays[index]) by central differences, in float64."""
    grad = np.zeros_like(arrays[index])
    for position in np.ndindex(arrays[index].shape):
        values = []
        for sign in (1, -1):
            shifted = [a.copy() for a in arrays]
            shifted[index][position] += sign * epsilon
            values.append(function(shifted))
        grad[position] = (values[0] - values[1]) / (2 * epsilon)
    return grad


@pytest.mark.parametrize("name, op, shapes, positive", OPS, ids=[row[0] for row in OPS])
def test_backward_matches_central_differences(name, op, shapes, positive, rng):
    arrays = [rng.standard_normal(shape) for shape in shapes]
    if positive:
        arrays = [np.abs(a) + 0.5 for a in arrays]
    if name == "relu":
        # keep clear of the kink, where no derivative exists
        arrays[0][np.abs(arrays[0]) < 1e-3] = 0.5
    weights = rng.standard_normal(op(*[Tensor(a) for a in arrays]).shape)

    def scalar(values):
        return float((op(*[Tensor(v) for v in values]).data * weights).sum())

    tensors = [Tensor(a, requires_grad=True) for a in arrays]
    output = op(*tensors)
    assert output.dtype == np.float64, f"{name} must keep float64 in, float64 out"
    output.backward(weights)
    for index, tensor in enumerate(tensors):
        expected = numerical_gradient(scalar, arrays, index)
        assert tensor.grad is not None, f"{name}: no gradient reached input {index}"
        assert tensor.grad.shape == tensor.shape
        np.testing.assert_allclose(
            tensor.grad,
            expected,
            rtol=1e-5,
            atol=1e-7,
            err_msg=f"{name}: input {index} gradient differs from central differences",
        )


@pytest.mark.parametrize("name, op, shapes, positive", OPS, ids=[row[0] for row in OPS])
def test_float16_inputs_give_float16_outputs_and_gradients(name, op, shapes, positive, rng):
    """A float16 graph stores float16 and returns float16 gradients (losses excepted: float32)."""
    arrays = [rng.standard_normal(shape).astype(np.float16) for shape in shapes]
    if positive:
        arrays = [(np.abs(a) + 0.5).astype(np.float16) for a in arrays]
    tensors = [Tensor(a, requires_grad=True) for a in arrays]
    output = op(*tensors)
    expected_dtype = np.float32 if name == "cross_entropy" else np.float16
    assert output.dtype == expected_dtype
    output.backward(np.ones(output.shape, output.dtype))
    for tensor in tensors:
        assert tensor.grad.dtype == np.float16


def test_matmul_rejects_vectors_with_a_clear_message():
    with pytest.raises(ValueError, match="2 or more axes"):
        Tensor(np.ones(3)) @ Tensor(np.ones((3, 2)))


def test_cross_entropy_rejects_out_of_range_targets():
    with pytest.raises(ValueError, match="targets must lie in 0..4"):
        F.cross_entropy(Tensor(np.zeros((2, 5))), np.array([0, 5]))


def test_cast_gradient_returns_in_the_source_dtype():
    """x32 -> float16 copy: the float16 gradient comes back as float32, rounded values unchanged."""
    x = Tensor(np.array([1.0, 2.0, 3.0], np.float32), requires_grad=True)
    y = x.astype(np.float16)
    assert y.dtype == np.float16
    (y * 2.0).sum().backward()
    assert x.grad.dtype == np.float32
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 2.0])


@pytest.mark.parametrize("targets", [np.array([0.0, 1.0]), np.array([True, False])])
def test_cross_entropy_refuses_targets_that_are_not_class_indices(targets):
    logits = Tensor(np.zeros((2, 3), np.float32))
    with pytest.raises(TypeError, match="integer class indices"):
        F.cross_entropy(logits, targets)


def test_cross_entropy_names_the_range_of_bad_targets():
    with pytest.raises(ValueError, match=r"0..2, got values in 0..5"):
        F.cross_entropy(Tensor(np.zeros((2, 3), np.float32)), np.array([0, 5]))


def test_a_float32_input_to_a_float16_layer_is_an_error_naming_both_dtypes():
    layer = Tensor(np.zeros((2, 3), np.float16)), Tensor(np.zeros(2, np.float16))
    with pytest.raises(TypeError, match="input is float32 but the layer's weight is float16"):
        F.linear(Tensor(np.zeros((1, 3), np.float32)), *layer)


@pytest.mark.parametrize("dtype", [np.float64, np.float32, np.float16, BFLOAT16])
def test_neg_flips_the_sign_bit_and_nothing_else(dtype):
    # the central differences above cannot see a forward and a backward that are wrong alike
    values = np.array([0.0, -0.0, 1.5, -3.25, np.inf, -np.inf, np.nan], dtype)
    x = Tensor(values, requires_grad=True)
    integer = np.dtype(f"uint{8 * x.data.itemsize}")
    sign = integer.type(1 << (8 * x.data.itemsize - 1))
    y = -x
    assert y.dtype == np.dtype(dtype)
    assert np.array_equal(y.data.view(integer), x.data.view(integer) ^ sign)
    y.backward(np.ones(7, dtype))
    assert np.array_equal(x.grad.view(integer), np.ones(7, dtype).view(integer) ^ sign)


def test_division_of_mixed_dtypes_promotes_both_sides():
    half, single = np.array([1.0, 3.0], np.float16), np.array([3.0, 7.0], np.float32)
    # float32 / float32 rounded from the float64 quotient: exact, 53 >= 2 * 24 + 2 bits
    exact = half.astype(np.float64) / single.astype(np.float64)
    for quotient, expected in (
        (Tensor(half) / Tensor(single), exact),
        (Tensor(single) / Tensor(half), 1 / exact),
        (Tensor(np.array([1, 3])) / Tensor(np.array([3, 7])), exact),  # integers: true division
    ):
        assert quotient.dtype == np.float32
        np.testing.assert_array_equal(quotient.data, expected.astype(np.float32))


@pytest.mark.parametrize("function", [ops.Add, ops.Sub, ops.Mul, ops.Div])
@pytest.mark.parametrize("needs", [(True, False), (False, True)])
def test_a_binary_backward_skips_the_gradient_nobody_asked_for(function, needs):
    a, b = np.array([2.0, -6.0], np.float32), np.array([4.0, 0.5], np.float32)
    grad_output = np.array([1.0, -2.0], np.float32)
    derivatives = {  # (dL/da, dL/db) written out
        ops.Add: (grad_output, grad_output),
        ops.Sub: (grad_output, -grad_output),
        ops.Mul: (grad_output * b, grad_output * a),
        ops.Div: (grad_output / b, -grad_output * a / (b * b)),
    }[function]
    ctx = Context(needs)
    function.forward(ctx, a, b)
    grads = function.backward(ctx, grad_output)
    for grad, needed, expected in zip(grads, needs, derivatives):
        if needed:
            np.testing.assert_array_equal(grad, expected)
        else:
            assert grad is None


def test_sum_and_mean_reduce_every_axis_unless_told():
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    total, mean = ops.Sum.apply(x), ops.Mean.apply(x)
    assert (total.shape, float(total.data), mean.shape, float(mean.data)) == ((), 15.0, (), 2.5)


class _NoArithmeticNegative(np.ndarray):
    """An array that refuses np.negative (and so `-x`); every other ufunc runs as usual."""

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        if ufunc is np.negative:
            raise AssertionError("16-bit negation went through arithmetic")
        plain = tuple(np.asarray(i) if isinstance(i, _NoArithmeticNegative) else i for i in inputs)
        return getattr(ufunc, method)(*plain, **kwargs)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16])
def test_16_bit_negation_flips_the_bit_without_arithmetic(dtype):
    # -x would give the same bits; _negate's docstring promises them without slow arithmetic
    x = np.array([1.5, -0.0, np.nan], dtype).view(_NoArithmeticNegative)
    y = ops.elementwise._negate(x)
    assert np.array_equal(np.asarray(y).view(np.uint16), np.asarray(x).view(np.uint16) ^ 0x8000)
