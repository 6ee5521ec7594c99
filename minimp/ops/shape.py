"""Shape ops: reshape, transpose and basic slicing move no numbers, so they need no widening
and no rounding.

Slicing takes only basic indexing (ints, slices, None, Ellipsis): it never picks an element twice,
so writing the gradient back is a plain assignment. Gathering rows by an integer array, where one
row may be picked many times and its gradients must be summed, is `ops.Embedding`'s job.
"""

from types import EllipsisType
from typing import Sequence

from minimp import backend
from minimp.backend import Array, array_module
from minimp.function import Context, Function

# What `x[key]` accepts: one part, or a tuple of them.
BasicIndex = int | slice | None | EllipsisType | tuple[int | slice | None | EllipsisType, ...]


class Reshape(Function):
    """y = x viewed with a new shape;  dL/dx = dL/dy viewed with x's shape."""

    @staticmethod
    def forward(ctx: Context, x: Array, shape: Sequence[int]) -> Array:
        ctx.input_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return grad_output.reshape(ctx.input_shape)


class Transpose(Function):
    """y = x with axes permuted (reversed when axes is None);
    dL/dx = dL/dy with the inverse permutation."""

    @staticmethod
    def forward(ctx: Context, x: Array, axes: Sequence[int] | None = None) -> Array:
        ctx.axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(axes)
        return array_module(x).transpose(x, ctx.axes)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        inverse = [0] * len(ctx.axes)
        for position, axis in enumerate(ctx.axes):
            inverse[axis] = position
        return array_module(grad_output).transpose(grad_output, inverse)


def _check_basic(key: BasicIndex) -> None:
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if not (part is None or part is Ellipsis or isinstance(part, (int, slice))):
            raise TypeError(
                f"Tensor indexing takes ints, slices, None and Ellipsis, got {type(part).__name__}"
                " (to gather rows by an index array use functional.embedding)")


class Index(Function):
    """y = x[key];  dL/dx = zeros like x with dL/dy written at [key].

    Moves no numbers, so nothing is widened or rounded; saves nothing but x's shape.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, key: BasicIndex) -> Array:
        _check_basic(key)
        ctx.key, ctx.shape = key, x.shape
        return x[key]

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        grad = backend.empty(ctx.shape, grad_output.dtype, grad_output)  # memory-pool zeros
        grad.fill(0)
        grad[ctx.key] = grad_output
        return grad
