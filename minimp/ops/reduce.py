"""Reductions: sum and mean accumulate in float32 whatever the input dtype, and round once."""

import math

from minimp.backend import Array, array_module
from minimp.function import Context, Function
from minimp.precision.casting import round_to, widen

Axis = int | tuple[int, ...] | None  # the axes to reduce; None: all of them


def _remember_axes(ctx: Context, x: Array, axis: Axis, keepdims: bool) -> None:
    """Keep what backward needs to spread a gradient back: x's shape and dtype, keepdims, and the
    reduced axes as non-negative ints."""
    ctx.shape, ctx.dtype, ctx.keepdims = x.shape, x.dtype, keepdims
    if axis is None:
        axis = tuple(range(x.ndim))
    axes = (axis,) if isinstance(axis, int) else axis
    ctx.axes = tuple(a % x.ndim for a in axes)


def _spread(grad_output: Array, ctx: Context) -> Array:
    """Broadcast a reduced gradient back to the input's shape (a read-only view: no copy)."""
    xp = array_module(grad_output)
    if not ctx.keepdims:
        grad_output = xp.expand_dims(grad_output, ctx.axes)
    return xp.broadcast_to(grad_output, ctx.shape)


class Sum(Function):
    """y = sum(x, axis);  dL/dx = dL/dy broadcast back over the summed axes.

    Why float32: a float16 running sum stops growing once the total's ulp exceeds the terms
    (a running sum of ones stalls at 2048); tests/test_casting.py shows it.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, axis: Axis = None, keepdims: bool = False) -> Array:
        y = round_to(widen(x).sum(axis=axis, keepdims=keepdims), x.dtype)
        _remember_axes(ctx, x, axis, keepdims)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return _spread(grad_output, ctx)


class Mean(Function):
    """y = mean(x, axis);  dL/dx = dL/dy / N broadcast back (N = number of averaged elements)."""

    @staticmethod
    def forward(ctx: Context, x: Array, axis: Axis = None, keepdims: bool = False) -> Array:
        y = round_to(widen(x).mean(axis=axis, keepdims=keepdims), x.dtype)
        _remember_axes(ctx, x, axis, keepdims)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        count = math.prod(ctx.shape[axis] for axis in ctx.axes)
        return round_to(_spread(widen(grad_output) / count, ctx), ctx.dtype)
