"""Float64 central-difference gradient checks, shared by the op and the model tests."""

import numpy as np

from minimp import Tensor


def numerical_gradient(scalar, arrays, index, positions, epsilon=1e-6):
    """d scalar(arrays) / d arrays[index] at `positions` by central differences (0 elsewhere)."""
    grad = np.zeros_like(arrays[index])
    for position in positions:
        values = []
        for sign in (1, -1):
            shifted = [a.copy() for a in arrays]
            shifted[index][position] += sign * epsilon
            values.append(scalar(shifted))
        grad[position] = (values[0] - values[1]) / (2 * epsilon)
    return grad


def check_gradients(function, arrays, rng, differentiable, samples=None, name=""):
    """Backward of sum(function(*tensors) * weights) against central differences, for the inputs
    numbered in `differentiable` (the others, like token ids, are passed as they are). `samples`
    checks that many random entries per input instead of all of them (big inputs)."""
    weights = rng.standard_normal(function(*[Tensor(a) for a in arrays]).shape)

    def scalar(values):
        return float((function(*[Tensor(v) for v in values]).data * weights).sum())

    tensors = [Tensor(a, requires_grad=i in differentiable) for i, a in enumerate(arrays)]
    output = function(*tensors)
    assert output.dtype == np.float64, f"{name}: float64 in must give float64 out"
    output.backward(weights)
    for index in differentiable:
        everywhere = list(np.ndindex(arrays[index].shape))
        if samples is not None and samples < len(everywhere):
            chosen = rng.choice(len(everywhere), size=samples, replace=False)
            everywhere = [everywhere[i] for i in chosen]
        expected = numerical_gradient(scalar, arrays, index, everywhere)
        got = tensors[index].grad
        assert got is not None, f"{name}: no gradient reached input {index}"
        assert got.shape == arrays[index].shape and got.dtype == np.float64
        picked = tuple(np.array(everywhere).T)
        np.testing.assert_allclose(
            got[picked], expected[picked], rtol=1e-5, atol=1e-7,
            err_msg=f"{name}: input {index} gradient differs from central differences",
        )
