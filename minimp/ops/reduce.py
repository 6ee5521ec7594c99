"""Reductions and layer normalization: sum, mean and layer norm's statistics accumulate in float32
whatever the input dtype, and each op rounds once.

Layer norm's statistics are float32 because the variance of float16 values computed in float16
loses most of its bits to cancellation.
"""

import math

from minimp import backend
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


class LayerNorm(Function):
    """y = (x - mean) / sqrt(var + eps) * weight + bias, over the last axis.

    With xhat the normalized input and g = dL/dy * weight:
    dL/dx = (g - mean(g) - xhat * mean(g * xhat)) / sqrt(var + eps),
    dL/dweight = sum(dL/dy * xhat),  dL/dbias = sum(dL/dy)  (sums over all leading axes).
    Backward keeps x in its own dtype plus one float32 mean and inverse std per row.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, weight: Array, bias: Array, eps: float = 1e-5) -> Array:
        xp = array_module(x)
        wide = widen(x)
        mean = wide.mean(axis=-1, keepdims=True)
        centered = xp.subtract(wide, mean, out=backend.empty(wide.shape, wide.dtype, wide))
        squares = xp.multiply(centered, centered, out=backend.empty(wide.shape, wide.dtype, wide))
        inverse_std = 1.0 / xp.sqrt(squares.mean(axis=-1, keepdims=True) + eps)
        del squares  # back to the pool
        ctx.save_for_backward(x, weight, mean, inverse_std)
        ctx.bias_dtype = bias.dtype
        centered *= inverse_std
        centered *= widen(weight)
        centered += widen(bias)  # ((x - mean) inverse_std) weight + bias
        return round_to(centered, x.dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        x, weight, mean, inverse_std = ctx.saved_arrays
        grad = widen(grad_output)
        xp = array_module(grad)
        wide = widen(x)
        normalized = xp.subtract(wide, mean, out=backend.empty(wide.shape, wide.dtype, wide))
        normalized *= inverse_std
        product = backend.empty(grad.shape, grad.dtype, grad)  # grad * normalized, then g * it
        batch_axes = tuple(range(x.ndim - 1))
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            xp.multiply(grad, normalized, out=product)
            grad_weight = round_to(product.sum(axis=batch_axes), weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(grad.sum(axis=batch_axes), ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            g = xp.multiply(grad, widen(weight), out=backend.empty(grad.shape, grad.dtype, grad))
            mean_g = g.mean(axis=-1, keepdims=True)
            mean_g_xhat = xp.multiply(g, normalized, out=product).mean(axis=-1, keepdims=True)
            g -= mean_g
            normalized *= mean_g_xhat
            g -= normalized
            g *= inverse_std  # inverse_std ((g - mean(g)) - xhat mean(g xhat))
            grad_x = round_to(g, x.dtype)
        return grad_x, grad_weight, grad_bias
