"""Basic slicing as an op: y = x[key] is a view; backward writes dL/dy into zeros shaped like x.

Only basic indexing (ints, slices, None, Ellipsis) is allowed: it never picks an element twice, so
writing the gradient back is a plain assignment. Gathering rows by an integer array, where one row
may be picked many times and its gradients must be summed, is `ops.Embedding`'s job.
"""

from minimp.backend import array_module
from minimp.function import Function


def _check_basic(key):
    parts = key if isinstance(key, tuple) else (key,)
    for part in parts:
        if not (part is None or part is Ellipsis or isinstance(part, (int, slice))):
            raise TypeError(
                f"Tensor indexing takes ints, slices, None and Ellipsis, got {type(part).__name__}"
                " (to gather rows by an index array use functional.embedding)"
            )


class Index(Function):
    """y = x[key];  dL/dx = zeros like x with dL/dy written at [key].

    Moves no numbers, so nothing is widened or rounded; saves nothing but x's shape.
    """

    @staticmethod
    def forward(ctx, x, key):
        _check_basic(key)
        ctx.key, ctx.shape = key, x.shape
        return x[key]

    @staticmethod
    def backward(ctx, grad_output):
        grad = array_module(grad_output).zeros(ctx.shape, grad_output.dtype)
        grad[ctx.key] = grad_output
        return grad
