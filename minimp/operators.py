"""Tensor's Python operators and methods (+, *, @, .sum(), .reshape(), ...), each one op Function.

A Python number meets a tensor without being rounded to the tensor's dtype first: it becomes a
float32 scalar (float64 beside a float64 tensor), the op computes in float32 and rounds the result
once into the tensor's dtype, as PyTorch does (its CPU kernels compute half-precision math in
float). So `Tensor(float16 [60000]) / 70000.0` is 0.857 in float16, not 0 (70000 rounded into
float16 first would be inf), and `* 1e-8` does not flush to zero. Beside an integer tensor a Python
float gives a float32 result (PyTorch's default dtype) instead of truncating; `/` always divides
into floats.
"""

from typing import Any, Sequence

import numpy as np

from minimp import backend
from minimp.precision import casting

NUMBER_TYPES = (bool, int, float, np.number, np.bool_)


def _lift_number(tensor: Any, number: Any) -> tuple[Any, Any]:
    """(a 0-d array holding number at the precision the op computes in, the result's dtype)."""
    dtype = np.dtype(tensor.dtype)
    if casting.is_floating(dtype):
        compute = casting.FLOAT64 if dtype == casting.FLOAT64 else casting.FLOAT32
        result = dtype
    elif isinstance(number, (float, np.floating)):  # an integer tensor meets a float
        compute = result = casting.FLOAT32
    else:  # integers with integers stay integers
        compute = result = dtype
    return backend.array_module(tensor.data).asarray(number, dtype=compute), result


def _binary(function: Any, a: Any, b: Any) -> Any:
    """function(a, b) where one side may be a Python number or an array (see the file docstring)."""
    if isinstance(a, NUMBER_TYPES) or isinstance(b, NUMBER_TYPES):
        tensor_first = not isinstance(a, NUMBER_TYPES)
        tensor, number = (a, b) if tensor_first else (b, a)
        scalar, dtype = _lift_number(tensor, number)
        lifted = graph.Tensor(scalar)
        pair = (tensor, lifted) if tensor_first else (lifted, tensor)
        return function.apply(*pair, dtype=dtype)
    a = a if isinstance(a, graph.Tensor) else graph.Tensor(a)
    b = b if isinstance(b, graph.Tensor) else graph.Tensor(b)
    return function.apply(a, b)


class TensorOperators:
    """The operator half of Tensor (mixed into it): every method applies one Function."""

    def __add__(self, other: Any) -> Any:
        return _binary(ops.Add, self, other)

    def __radd__(self, other: Any) -> Any:
        return _binary(ops.Add, other, self)

    def __sub__(self, other: Any) -> Any:
        return _binary(ops.Sub, self, other)

    def __rsub__(self, other: Any) -> Any:
        return _binary(ops.Sub, other, self)

    def __mul__(self, other: Any) -> Any:
        return _binary(ops.Mul, self, other)

    def __rmul__(self, other: Any) -> Any:
        return _binary(ops.Mul, other, self)

    def __truediv__(self, other: Any) -> Any:
        return _binary(ops.Div, self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return _binary(ops.Div, other, self)

    def __matmul__(self, other: Any) -> Any:
        return _binary(ops.MatMul, self, other)

    def __rmatmul__(self, other: Any) -> Any:
        return _binary(ops.MatMul, other, self)

    def __neg__(self) -> Any:
        return ops.Neg.apply(self)

    def relu(self) -> Any:
        """max(x, 0), elementwise."""
        return ops.ReLU.apply(self)

    def tanh(self) -> Any:
        """tanh(x), elementwise."""
        return ops.Tanh.apply(self)

    def exp(self) -> Any:
        """exp(x), elementwise."""
        return ops.Exp.apply(self)

    def log(self) -> Any:
        """The natural logarithm, elementwise."""
        return ops.Log.apply(self)

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Sum over axis (all axes by default), accumulated in float32."""
        return ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Any:
        """Mean over axis (all axes by default), accumulated in float32."""
        return ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def __getitem__(self, key: Any) -> Any:
        """Basic slicing (ints, slices, None, ...): a view forward, zeros + the slice backward."""
        return ops.Index.apply(self, key=key)

    def reshape(self, *shape: int | Sequence[int]) -> Any:
        """The same values with a new shape: reshape(2, 3) or reshape((2, 3))."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.Reshape.apply(self, shape=shape)

    def transpose(self, *axes: int) -> Any:
        """Axes permuted as given, or reversed when none are given."""
        return ops.Transpose.apply(self, axes=axes or None)

    @property
    def T(self) -> Any:
        """The transpose (axes reversed)."""
        return ops.Transpose.apply(self, axes=None)

    def astype(self, dtype: Any) -> Any:
        """A differentiable cast: the gradient comes back in this tensor's dtype."""
        return ops.Cast.apply(self, dtype=casting.dtype_named(dtype))


# Imported last: the ops build on Function, which makes Tensors (minimp/function.py says why).
from minimp import ops  # noqa: E402
from minimp import tensor as graph  # noqa: E402
