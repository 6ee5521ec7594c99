"""GELU in GPT-2's tanh form, computed in float32 from 16-bit inputs and rounded once."""

import math

from minimp.backend import array_module
from minimp.function import Function
from minimp.precision.casting import round_to, widen

_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715  # the cubic term's coefficient (Hendrycks & Gimpel 2016, eq. for the tanh form)


def _inner_tanh(wide):
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)), in the dtype of `wide` (float32 or float64)."""
    return array_module(wide).tanh(_SQRT_2_OVER_PI * (wide + _CUBIC * wide * wide * wide))


class GELU(Function):
    """y = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)   (PyTorch's approximate='tanh');
    dL/dx = dL/dy (1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)).

    Backward keeps only the input x (as Megatron does: the 4h-wide GELU input is 8sbh bytes of a
    block's activations in fp16) and recomputes tanh(u) from it. Why float32: in float16, x^3
    overflows 65504 for |x| > 40.3, and 1 + tanh(u) cancels: at x = -3 it is 0.002425, but a
    float16 tanh(u) lies on a grid of 2^-11 near -1, which puts it 0.7% off (0.002441).
    """

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        wide = widen(x)
        return round_to(0.5 * wide * (1.0 + _inner_tanh(wide)), x.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        (x,) = ctx.saved_arrays
        wide = widen(x)
        t = _inner_tanh(wide)
        slope = _SQRT_2_OVER_PI * (1.0 + 3.0 * _CUBIC * wide * wide)
        local = 0.5 * (1.0 + t) + 0.5 * wide * (1.0 - t * t) * slope
        return round_to(widen(grad_output) * local, x.dtype)
