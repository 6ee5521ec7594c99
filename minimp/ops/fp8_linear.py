"""Linear in fp8: x and W in E4M3 forward, dL/dy in E5M2 backward, float32 sums, one rounding.

What an fp8 tensor core does (Transformer Engine's te.Linear on an H100): each GEMM reads two fp8
matrices, multiplies and sums in float32, multiplies the sum by both inverse scales and rounds the
result once into the activation dtype. The emulation here does the same on the CPU: the fp8 values
are widened to float32 (exactly), multiplied by float32 BLAS, the float32 result multiplied by
(1/s_a)(1/s_b), the bias added, and the sum rounded once. Mathematically that is the product of the
dequantized values q_a/s_a and q_b/s_b; the rounding happens where the hardware's does.

Every quantization goes through the Linear's `Fp8Meta` (precision/fp8_scaling.py), which holds the
scale of each of the three tensors and records their amaxes for the next step's scales. Forward
keeps the fp8 x and W for backward (1 byte a value, as TE does), and the bias gradient is summed
from the 16-bit output gradient, before its quantization (as TE's fused cast does).
"""

from typing import Any

import numpy as np

from minimp.backend import Array
from minimp.function import Context, Function
from minimp.ops.linalg import check_linear_inputs
from minimp.precision import fp8
from minimp.precision.casting import round_to, widen


def fp8_gemm(a: Array, b: Array, a_inverse: np.float32, b_inverse: np.float32) -> Array:
    """(a @ b) * (1/s_a)(1/s_b) for fp8 matrices a and b: float32 products and sums, then once
    the product of both inverse scales (computed in float32), as cuBLASLt applies its A and B
    scale factors to the float32 sum."""
    return (fp8.to_float32(a) @ fp8.to_float32(b)) * (np.float32(a_inverse) * b_inverse)


class Fp8Linear(Function):
    """y = x @ W^T + b with x and W quantized to E4M3 by their scales.

    dL/dx = dL/dy @ W,  dL/dW = dL/dy^T @ x,  dL/db = sum of dL/dy over the batch; dL/dy is
    quantized to E5M2 for the two products; x and W are the fp8 copies forward made.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, weight: Array, bias: Array, meta: Any) -> Array:
        check_linear_inputs(x, weight)
        # Training records amaxes and counts for the next scales; an evaluation (no gradient
        # wanted anywhere) only reads the scales, so it never changes the training that follows.
        record = any(ctx.needs_input_grad)
        rows = x.reshape(-1, x.shape[-1])  # (N, in) with N = all leading axes together
        x_fp8, x_inverse = meta.input.quantize(rows, record)
        w_fp8, w_inverse = meta.weight.quantize(weight, record)
        ctx.save_for_backward(x_fp8, w_fp8)
        ctx.inverses, ctx.meta = (x_inverse, w_inverse), meta
        ctx.x_shape, ctx.dtypes = x.shape, (x.dtype, weight.dtype, bias.dtype)
        output = fp8_gemm(x_fp8, w_fp8.T, x_inverse, w_inverse) + widen(bias)  # (N, out)
        return round_to(output, x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        x_fp8, w_fp8 = ctx.saved_arrays
        x_inverse, w_inverse = ctx.inverses
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = grad_output.reshape(-1, w_fp8.shape[0])  # (N, out)
        grad_fp8, grad_inverse = ctx.meta.grad_output.quantize(grad)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = fp8_gemm(grad_fp8, w_fp8, grad_inverse, w_inverse)  # (N, in)
            grad_x = round_to(grad_x, x_dtype).reshape(ctx.x_shape)
        if ctx.needs_input_grad[1]:
            grad_weight = fp8_gemm(grad_fp8.T, x_fp8, grad_inverse, x_inverse)  # (out, in)
            grad_weight = round_to(grad_weight, weight_dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(widen(grad).sum(axis=0), bias_dtype)  # float32 sum
        return grad_x, grad_weight, grad_bias
