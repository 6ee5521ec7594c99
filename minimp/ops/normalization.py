"""Layer normalization over the last axis, with statistics in float32.

The variance of float16 values computed in float16 loses most of its bits to cancellation.
"""

from minimp.backend import Array, array_module
from minimp.function import Context, Function
from minimp.precision.casting import round_to, widen


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
        inverse_std = 1.0 / xp.sqrt(((wide - mean) ** 2).mean(axis=-1, keepdims=True) + eps)
        ctx.save_for_backward(x, weight, mean, inverse_std)
        ctx.bias_dtype = bias.dtype
        return round_to((wide - mean) * inverse_std * widen(weight) + widen(bias), x.dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        x, weight, mean, inverse_std = ctx.saved_arrays
        grad = widen(grad_output)
        normalized = (widen(x) - mean) * inverse_std
        batch_axes = tuple(range(x.ndim - 1))
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[1]:
            grad_weight = round_to((grad * normalized).sum(axis=batch_axes), weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(grad.sum(axis=batch_axes), ctx.bias_dtype)
        if ctx.needs_input_grad[0]:
            g = grad * widen(weight)
            mean_g = g.mean(axis=-1, keepdims=True)
            mean_g_xhat = (g * normalized).mean(axis=-1, keepdims=True)
            grad_x = round_to(inverse_std * (g - mean_g - normalized * mean_g_xhat), x.dtype)
        return grad_x, grad_weight, grad_bias
