"""Elementwise ops: each computes in float32 when its inputs are 16-bit floats, and rounds once.

The arithmetic (+, -, *, /, negation, a cast), exp, log, and the activations: tanh, ReLU and GELU
in GPT-2's tanh form.
"""

import math
import operator
from typing import Callable

import numpy as np

from minimp import backend
from minimp.backend import Array, array_module
from minimp.function import Context, Function, unbroadcast
from minimp.precision import casting
from minimp.precision.casting import round_to, widen


def _binary_forward(ctx: Context, a: Array, b: Array, compute: Callable[..., Array],
                    dtype: np.dtype | None) -> Array:
    """Run compute(a, b) in the accumulation dtype and round once into `dtype` (by default NumPy's
    promotion of the two; a Python number passes the tensor's dtype, see minimp/tensor.py).
    Remembers the shapes and dtypes backward needs to undo broadcasting."""
    ctx.shapes, ctx.dtypes = (a.shape, b.shape), (a.dtype, b.dtype)
    return round_to(compute(widen(a), widen(b)), dtype or casting.result_dtype(a.dtype, b.dtype))


def _to_input(ctx: Context, index: int, grad: Array) -> Array:
    """A gradient summed over the axes broadcasting stretched for input `index`, in its dtype."""
    return unbroadcast(grad, ctx.shapes[index], ctx.dtypes[index])


class Add(Function):
    """y = a + b;  dL/da = dL/dy,  dL/db = dL/dy (summed over broadcast axes)."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array, dtype: np.dtype | None = None) -> Array:
        return _binary_forward(ctx, a, b, operator.add, dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, Array | None]:
        grad_a = _to_input(ctx, 0, grad_output) if ctx.needs_input_grad[0] else None
        grad_b = _to_input(ctx, 1, grad_output) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Sub(Function):
    """y = a - b;  dL/da = dL/dy,  dL/db = -dL/dy."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array, dtype: np.dtype | None = None) -> Array:
        return _binary_forward(ctx, a, b, operator.sub, dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, Array | None]:
        grad_a = _to_input(ctx, 0, grad_output) if ctx.needs_input_grad[0] else None
        grad_b = _to_input(ctx, 1, -widen(grad_output)) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Mul(Function):
    """y = a * b;  dL/da = dL/dy * b,  dL/db = dL/dy * a."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array, dtype: np.dtype | None = None) -> Array:
        ctx.save_for_backward(a, b)
        return _binary_forward(ctx, a, b, operator.mul, dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, Array | None]:
        a, b = ctx.saved_arrays
        grad = widen(grad_output)
        grad_a = _to_input(ctx, 0, grad * widen(b)) if ctx.needs_input_grad[0] else None
        grad_b = _to_input(ctx, 1, grad * widen(a)) if ctx.needs_input_grad[1] else None
        return grad_a, grad_b


class Div(Function):
    """y = a / b;  dL/da = dL/dy / b,  dL/db = -dL/dy * a / b^2."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array, dtype: np.dtype | None = None) -> Array:
        ctx.save_for_backward(a, b)
        dtype = dtype or casting.result_dtype(a.dtype, b.dtype)
        if not casting.is_floating(dtype):  # true division, as Python's and PyTorch's `/`
            dtype = casting.FLOAT32
        return _binary_forward(ctx, a, b, operator.truediv, dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, Array | None]:
        a, b = ctx.saved_arrays
        grad, wide_b = widen(grad_output), widen(b)
        grad_a = _to_input(ctx, 0, grad / wide_b) if ctx.needs_input_grad[0] else None
        grad_b = None
        if ctx.needs_input_grad[1]:
            grad_b = _to_input(ctx, 1, -grad * widen(a) / (wide_b * wide_b))
        return grad_a, grad_b


class Neg(Function):
    """y = -x;  dL/dx = -dL/dy.  Flipping the sign is exact in every format: no widening needed."""

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        return _negate(x)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return _negate(grad_output)


class Exp(Function):
    """y = exp(x);  dL/dx = dL/dy * y (the output is what backward keeps)."""

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        y = round_to(array_module(x).exp(widen(x)), x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        return round_to(widen(grad_output) * widen(y), y.dtype)


class Log(Function):
    """y = log(x);  dL/dx = dL/dy / x."""

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        ctx.save_for_backward(x)
        return round_to(array_module(x).log(widen(x)), x.dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (x,) = ctx.saved_arrays
        return round_to(widen(grad_output) / widen(x), x.dtype)


class Tanh(Function):
    """y = tanh(x);  dL/dx = dL/dy * (1 - y^2)."""

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        y = round_to(array_module(x).tanh(widen(x)), x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        wide_y = widen(y)
        return round_to(widen(grad_output) * (1.0 - wide_y * wide_y), y.dtype)


class ReLU(Function):
    """y = max(x, 0);  dL/dx = dL/dy where y is not <= 0 (y > 0, or y NaN), else 0.

    Backward keeps the output y, not a separate mask: the next layer keeps y anyway, so the mask is
    free. Neither direction needs arithmetic, so nothing is widened: in every IEEE format a number
    is negative exactly when its sign bit is set, and both directions select values with a bitwise
    AND (see `_keep_where`; float32 and float64 forward take NumPy's SIMD max instead). NaN stays
    NaN, as with max(x, 0), and passes its gradient on, as PyTorch's threshold_backward does
    (NaN <= 0 is false).
    """

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        if casting.is_low_precision(x.dtype):
            # Sign bit set and not a NaN: the values ReLU sends to zero. As signed integers,
            # -0.0 .. -inf run from the most negative value up to -inf's pattern; negative NaNs
            # (all exponent bits set, mantissa non-zero) lie above it, between -inf and 0.
            y = _keep_where(x, _signed_bits(x) <= _negative_infinity_bits(x), keep=False)
        else:
            # float32/float64 have a fast SIMD max; the output comes from the memory pool
            y = array_module(x).maximum(x, x.dtype.type(0), out=backend.empty(x.shape, x.dtype, x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        if not casting.is_low_precision(y.dtype):  # float32/float64 compare in SIMD: one pass
            return _keep_where(grad_output, y <= 0, keep=False)
        # y is +0, -0, positive or NaN. Read as signed integers, zeros' bits are 0 and the most
        # negative value; positives and +NaNs are > 0; -NaNs lie between -inf's bits and 0.
        bits = _signed_bits(y)
        return _keep_where(grad_output, (bits > _negative_infinity_bits(y)) & (bits != 0))


_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_CUBIC = 0.044715  # the cubic term's coefficient (Hendrycks & Gimpel 2016, eq. for the tanh form)


def _inner_tanh(wide: Array) -> Array:
    """tanh(sqrt(2/pi) (x + 0.044715 x^3)), in the dtype of `wide` (float32 or float64), in a new
    array from the memory pool.

    In place, operation by operation in the order the formula reads (((0.044715 x) x) x, then + x,
    then times sqrt(2/pi)): the same roundings, so the same bits, as the expression written out,
    without a fresh temporary (and its page faults) per operation.
    """
    xp = array_module(wide)
    u = xp.multiply(wide, _CUBIC, out=backend.empty(wide.shape, wide.dtype, wide))
    u *= wide
    u *= wide
    u += wide
    u *= _SQRT_2_OVER_PI
    return xp.tanh(u, out=u)


class GELU(Function):
    """y = x/2 (1 + tanh(u)),  u = sqrt(2/pi) (x + 0.044715 x^3)   (PyTorch's approximate='tanh');
    dL/dx = dL/dy (1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) sqrt(2/pi) (1 + 3 * 0.044715 x^2)).

    Backward keeps only the input x (as Megatron does: the 4h-wide GELU input is 8sbh bytes of a
    block's activations in fp16) and recomputes tanh(u) from it. Why float32: in float16, x^3
    overflows 65504 for |x| > 40.3, and 1 + tanh(u) cancels: at x = -3 it is 0.002425, but a
    float16 tanh(u) lies on a grid of 2^-11 near -1, which puts it 0.7% off (0.002441).
    Both directions work in place in arrays from the memory pool, in the formula's order of
    operations (tests/test_ops_gpt.py holds them to the formula written out, bit for bit).
    """

    @staticmethod
    def forward(ctx: Context, x: Array) -> Array:
        ctx.save_for_backward(x)
        wide = widen(x)
        xp = array_module(wide)
        t = _inner_tanh(wide)
        t += 1.0
        y = xp.multiply(wide, 0.5, out=backend.empty(wide.shape, wide.dtype, wide))
        y *= t  # 0.5 x (1 + tanh u)
        return round_to(y, x.dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (x,) = ctx.saved_arrays
        wide = widen(x)
        xp = array_module(wide)
        t = _inner_tanh(wide)
        slope = xp.multiply(wide, 3.0 * _CUBIC, out=backend.empty(wide.shape, wide.dtype, wide))
        slope *= wide
        slope += 1.0
        slope *= _SQRT_2_OVER_PI  # sqrt(2/pi) (1 + 3 * 0.044715 x^2)
        squared = xp.multiply(t, t, out=backend.empty(wide.shape, wide.dtype, wide))
        xp.subtract(1.0, squared, out=squared)  # 1 - tanh^2 u
        local = xp.multiply(wide, 0.5, out=backend.empty(wide.shape, wide.dtype, wide))
        local *= squared
        local *= slope  # x/2 (1 - tanh^2 u) slope
        t += 1.0
        t *= 0.5
        t += local  # 1/2 (1 + tanh u) + x/2 (1 - tanh^2 u) slope
        t *= widen(grad_output)
        return round_to(t, x.dtype)


class Cast(Function):
    """y = x rounded into dtype;  dL/dx = dL/dy rounded back into x's dtype."""

    @staticmethod
    def forward(ctx: Context, x: Array, dtype: np.dtype) -> Array:
        ctx.input_dtype = x.dtype
        return round_to(x, dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return round_to(grad_output, ctx.input_dtype)


def _signed_bits(x: Array) -> Array:
    """The float's bits as a signed integer of the same width (a view: no copy, no rounding)."""
    return x.view(np.dtype(f"int{8 * x.dtype.itemsize}"))


def _keep_where(x: Array, where: Array, keep: bool = True) -> Array:
    """x where `where` is True and +0.0 elsewhere (keep=False: the other way round), by a bitwise
    AND with an all-ones or all-zeros mask.

    Why not np.where: with a data-dependent mask it mispredicts branches (~6 ns per element measured
    here, 15x the AND). Why not x * keep: inf * 0 is NaN, and a gradient must be exactly 0 there.
    """
    integer = np.dtype(f"int{8 * x.dtype.itemsize}")
    xp = array_module(x)
    mask = backend.empty(x.shape, integer, x)
    if keep:
        xp.negative(where, out=mask, dtype=integer)  # True -> -1 (every bit set), False -> 0
    else:
        xp.subtract(where, 1, out=mask, dtype=integer)  # True -> 0, False -> -1
    return xp.bitwise_and(x.view(integer), mask, out=mask).view(x.dtype)


def _negative_infinity_bits(x: Array) -> int:
    """-inf of x's dtype, its bits read as a signed integer (a host int)."""
    return int(_signed_bits(np.array([-np.inf], dtype=x.dtype))[0])


def _negate(x: Array) -> Array:
    """-x for every float dtype; 16-bit floats flip their sign bit, avoiding slow arithmetic."""
    if casting.is_low_precision(x.dtype):
        return (_signed_bits(x) ^ np.int16(-0x8000)).view(x.dtype)
    return -x
