"""Reductions: sum and mean accumulate in float32 whatever the input dtype, and round once."""

from minimp.backend import array_module
from minimp.function import Function
from minimp.precision.casting import round_to, widen


def _spread(grad_output, ctx):
    """Broadcast a reduced gradient back to the input's shape (a read-only view: no copy)."""
    if not ctx.keepdims and ctx.axis is not None:
        axes = (ctx.axis,) if isinstance(ctx.axis, int) else ctx.axis
        grad_output = array_module(grad_output).expand_dims(
            grad_output, tuple(a % len(ctx.shape) for a in axes)
        )
    return array_module(grad_output).broadcast_to(grad_output, ctx.shape)


def _reduced_count(shape, axis):
    if axis is None:
        axis = tuple(range(len(shape)))
    axes = (axis,) if isinstance(axis, int) else axis
    count = 1
    for a in axes:
        count *= shape[a]
    return count


class Sum(Function):
    """y = sum(x, axis);  dL/dx = dL/dy broadcast back over the summed axes.

    Why float32: a float16 running sum stops growing once the total's ulp exceeds the terms
    (a running sum of ones stalls at 2048); tests/test_casting.py shows it.
    """

    @staticmethod
    def forward(ctx, x, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = x.shape, axis, keepdims
        return round_to(widen(x).sum(axis=axis, keepdims=keepdims), x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        return _spread(grad_output, ctx)


class Mean(Function):
    """y = mean(x, axis);  dL/dx = dL/dy / N broadcast back (N = number of averaged elements)."""

    @staticmethod
    def forward(ctx, x, axis=None, keepdims=False):
        ctx.shape, ctx.axis, ctx.keepdims = x.shape, axis, keepdims
        ctx.dtype = x.dtype
        return round_to(widen(x).mean(axis=axis, keepdims=keepdims), x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        count = _reduced_count(ctx.shape, ctx.axis)
        return round_to(_spread(widen(grad_output) / count, ctx), ctx.dtype)
