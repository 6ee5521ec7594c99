"""Matrix products with float32 accumulation, rounded once: what tensor cores do.

On the CPU, half-precision inputs are widened and multiplied by float32 BLAS, then rounded
(NumPy's own float16 matmul has no BLAS behind it and is ~100x slower). On a GPU, float16 operands
go to cuBLAS as they are: CuPy (with CUDA >= 11) calls cublasGemmEx with CUBLAS_COMPUTE_32F for
float16 matrices, so the tensor cores multiply float16 and accumulate in float32, and cuBLAS
rounds the result once. Nothing needs to be set for it; tests/test_gpu.py checks that the
accumulation really is float32.
"""

import numpy as np

from minimp import backend
from minimp.backend import Array, array_module
from minimp.function import Context, Function, unbroadcast
from minimp.precision import casting
from minimp.precision.casting import round_to, widen


def _swap_last_two(array: Array) -> Array:
    return array_module(array).swapaxes(array, -1, -2)


def gemm_operand(array: Array) -> Array:
    """What a matrix product should read: float16 as it is on a GPU (tensor cores, float32
    accumulation inside cuBLAS), float32 everywhere else."""
    if array.dtype == casting.FLOAT16 and array_module(array) is not np and array.ndim == 2:
        return array
    return widen(array)


def pooled_matmul(a: Array, b: Array) -> Array:
    """a @ b for 2-D operands, written into an array from the memory pool: the same BLAS call as
    `a @ b`, without fresh memory (and its page faults) in every step."""
    out = backend.empty((a.shape[0], b.shape[1]), np.result_type(a.dtype, b.dtype), like=a)
    return array_module(a).matmul(a, b, out=out)


class MatMul(Function):
    """y = a @ b;  dL/da = dL/dy @ b^T,  dL/db = a^T @ dL/dy (batch axes summed where broadcast)."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array) -> Array:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(
                f"matmul needs operands with 2 or more axes, got shapes {a.shape} and {b.shape}"
                " (reshape a vector to (1, n) or (n, 1))"
            )
        ctx.save_for_backward(a, b)
        return round_to(gemm_operand(a) @ gemm_operand(b), casting.result_dtype(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        a, b = ctx.saved_arrays
        grad = gemm_operand(grad_output)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = unbroadcast(grad @ _swap_last_two(gemm_operand(b)), a.shape, a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = unbroadcast(_swap_last_two(gemm_operand(a)) @ grad, b.shape, b.dtype)
        return grad_a, grad_b


def check_linear_inputs(x: Array, weight: Array) -> None:
    """The input's dtype and feature count must match the layer's weight (as torch's Linear: no
    silent float32 math in a 16-bit model)."""
    if x.dtype != weight.dtype:
        raise TypeError(
            f"linear: the input is {x.dtype} but the layer's weight is {weight.dtype}; cast "
            f"the input (x.astype({weight.dtype.name!r})) or the model (model.to(...))"
        )
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features, the layer expects {weight.shape[1]}"
        )


class Linear(Function):
    """y = x @ W^T + b (W is (out, in), as in PyTorch), fused so the bias is added before rounding.

    dL/dx = dL/dy @ W,  dL/dW = dL/dy^T @ x,  dL/db = sum of dL/dy over the batch.
    Backward widens dL/dy once and uses it three times; it skips dL/dx for the input data.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, weight: Array, bias: Array) -> Array:
        check_linear_inputs(x, weight)
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = bias.dtype
        rows = x.reshape(-1, x.shape[-1])  # (N, in) with N = all leading axes together
        # CPU: one float32 product, the bias added, one rounding. GPU float16: cuBLAS rounds the
        # product, the bias add rounds again (as an unfused bias add does in PyTorch).
        product = pooled_matmul(gemm_operand(rows), gemm_operand(weight).T)  # (N, out)
        wide_bias = widen(bias)
        if product.dtype == wide_bias.dtype:
            product += wide_bias  # in place: the product is this op's own array
            output = product
        else:
            output = widen(product) + wide_bias
        dtype = casting.result_dtype(x.dtype, weight.dtype)
        return round_to(output, dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        x, weight = ctx.saved_arrays
        grad = gemm_operand(grad_output.reshape(-1, weight.shape[0]))  # (N, out)
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = round_to(pooled_matmul(grad, gemm_operand(weight)), x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            rows = gemm_operand(x.reshape(-1, x.shape[-1]))  # (N, in)
            grad_weight = round_to(pooled_matmul(grad.T, rows), weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(widen(grad).sum(axis=0), ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias
