"""Matrix products with float32 accumulation, rounded once: what tensor cores do.

On the CPU, half-precision inputs are widened and multiplied by float32 BLAS, then rounded
(NumPy's own float16 matmul has no BLAS behind it and is ~100x slower). On a GPU, float16 operands
go to cuBLAS as they are: CuPy (with CUDA >= 11) calls cublasGemmEx with CUBLAS_COMPUTE_32F for
float16 matrices, so the tensor cores multiply float16 and accumulate in float32, and cuBLAS
rounds the result once. Nothing needs to be set for it; tests/test_gpu.py checks that the
accumulation really is float32.

Fp8Linear is the Linear in fp8: x and W in E4M3 forward, dL/dy in E5M2 backward, float32 sums,
one rounding. What an fp8 tensor core does (Transformer Engine's te.Linear on an H100): each
GEMM reads two fp8 matrices, multiplies and sums in float32, multiplies the sum by both inverse
scales and rounds the result once into the activation dtype. The emulation here does the same on
the CPU: the fp8 values are widened to float32 (exactly), multiplied by float32 BLAS, the
float32 result multiplied by (1/s_a)(1/s_b), the bias added, and the sum rounded once.
Mathematically that is the product of the dequantized values q_a/s_a and q_b/s_b; the rounding
happens where the hardware's does.

Every quantization goes through the Linear's `Fp8Meta` (precision/fp8_scaling.py), which holds the
scale of each of the three tensors and records their amaxes for the next step's scales. Forward
keeps the fp8 x and W for backward (1 byte a value, as TE does), and the bias gradient is summed
from the 16-bit output gradient, before its quantization (as TE's fused cast does).

BlockScaledLinear is the Linear under a block-scaled recipe (rowwise, blockwise, mxfp8;
precision/recipes.py): each GEMM reads its two operands quantized along its own K, a scale per
group chosen afresh. Forward also quantizes what backward will read along other axes, W along out
features (grad_input's K) and x along tokens (grad_weight's K), and keeps those (1 byte a value
and the scales) rather than x itself, as TE keeps its columnwise copies.

Under NVFP4 (--precision nvfp4, recipes.NVFP4) it also rounds dy stochastically in both backward
GEMMs with its meta's random bits, multiplies dy and x by the meta's random Hadamard matrix along
the tokens before the weight-gradient GEMM quantizes them, and quantizes W once (its 16 x 16
blocks serve W^T transposed: recipes.transposed).
"""

from typing import TYPE_CHECKING

import numpy as np

from minimp import backend
from minimp.backend import Array, array_module
from minimp.function import Context, Function, unbroadcast
from minimp.precision import casting, fp8, recipes
from minimp.precision.hadamard import hadamard_transform
from minimp.precision.casting import round_to, widen

if TYPE_CHECKING:  # for the annotation only: precision.fp8_scaling is a layer above the ops
    from minimp.precision.fp8_scaling import Fp8Meta
    from minimp.precision.recipes import BlockScaledMeta


def gemm_operand(array: Array) -> Array:
    """What a matrix product should read: float16 as it is on a GPU (tensor cores, float32
    accumulation inside cuBLAS), float32 everywhere else."""
    if array.dtype == casting.FLOAT16 and array_module(array) is not np and array.ndim == 2:
        return array
    return widen(array)


def pooled_matmul(a: Array, b: Array) -> Array:
    """a @ b (2-D, or stacks of matrices broadcast as matmul does), written into an array from the
    memory pool: the same BLAS calls as `a @ b`, without fresh memory (and its page faults) in
    every step."""
    shape = (*np.broadcast_shapes(a.shape[:-2], b.shape[:-2]), a.shape[-2], b.shape[-1])
    out = backend.empty(shape, np.result_type(a.dtype, b.dtype), like=a)
    return array_module(a).matmul(a, b, out=out)


class MatMul(Function):
    """y = a @ b;  dL/da = dL/dy @ b^T,  dL/db = a^T @ dL/dy (batch axes summed where broadcast)."""

    @staticmethod
    def forward(ctx: Context, a: Array, b: Array) -> Array:
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands with 2 or more axes, got shapes {a.shape} "
                             f"and {b.shape} (reshape a vector to (1, n) or (n, 1))")
        ctx.save_for_backward(a, b)
        product = pooled_matmul(gemm_operand(a), gemm_operand(b))
        return round_to(product, casting.result_dtype(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        a, b = ctx.saved_arrays
        grad = gemm_operand(grad_output)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = unbroadcast(pooled_matmul(grad, gemm_operand(b).swapaxes(-1, -2)), a.shape,
                                 a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = unbroadcast(pooled_matmul(gemm_operand(a).swapaxes(-1, -2), grad), b.shape,
                                 b.dtype)
        return grad_a, grad_b


def check_linear_inputs(x: Array, weight: Array) -> None:
    """The input's dtype and feature count must match the layer's weight (as torch's Linear: no
    silent float32 math in a 16-bit model)."""
    if x.dtype != weight.dtype:
        raise TypeError(
            f"linear: the input is {x.dtype} but the layer's weight is {weight.dtype}; cast "
            f"the input (x.astype({weight.dtype.name!r})) or the model (model.to(...))")
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"linear: input has {x.shape[-1]} features, the layer expects {weight.shape[1]}")


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
    def forward(ctx: Context, x: Array, weight: Array, bias: Array, meta: "Fp8Meta") -> Array:
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


class BlockScaledLinear(Function):
    """y = x @ W^T + b, each of the three GEMMs reading its operands quantized along its own K.

    dL/dx = dL/dy @ W,  dL/dW = dL/dy^T @ x,  dL/db = sum of dL/dy over the batch; the operands'
    groups, scales, formats and accumulation are the recipe's (precision/recipes.py).
    """

    @staticmethod
    def forward(ctx: Context, x: Array, weight: Array, bias: Array,
                meta: "BlockScaledMeta") -> Array:
        check_linear_inputs(x, weight)
        gemms = meta.recipe.gemms
        rows = x.reshape(-1, x.shape[-1])  # (N, in) with N = all leading axes together
        weight_q = recipes.quantize(weight, gemms.forward.b)
        product = recipes.scaled_gemm(recipes.quantize(rows, gemms.forward.a), weight_q,
                                      gemms.forward.accumulate)  # (N, out)
        # What backward reads, quantized now along its GEMM's K (an evaluation needs neither):
        # W^T (in, out) for grad_input, x^T (in, N) for grad_weight; saved as their arrays.
        weight_t = rows_t = None
        if ctx.needs_input_grad[0]:
            weight_t = (recipes.transposed(weight_q) if recipes.weight_shared(gemms)
                        else recipes.quantize(weight.T, gemms.grad_input.b))
        if ctx.needs_input_grad[1]:
            if gemms.grad_weight.hadamard:  # float32 sums of 16 tokens, then quantized
                rows = hadamard_transform(widen(rows), meta.hadamard)
            rows_t = recipes.quantize(rows.T, gemms.grad_weight.b)
        ctx.save_for_backward(*recipes.arrays_of(weight_t), *recipes.arrays_of(rows_t))
        ctx.layouts = recipes.layout_of(weight_t), recipes.layout_of(rows_t)
        ctx.gemms, ctx.x_shape, ctx.dtypes = gemms, x.shape, (x.dtype, weight.dtype, bias.dtype)
        ctx.meta = meta
        return round_to(product + widen(bias), x.dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        gemms, saved = ctx.gemms, list(ctx.saved_arrays)
        weight_t, rows_t = (recipes.rebuilt(layout, saved) for layout in ctx.layouts)
        x_dtype, weight_dtype, bias_dtype = ctx.dtypes
        grad = grad_output.reshape(-1, grad_output.shape[-1])  # (N, out)
        grad_x = grad_weight = grad_bias = None
        stochastic = gemms.grad_input.a.stochastic or gemms.grad_weight.a.stochastic
        call = ctx.meta.next_backward() if stochastic else 0

        def bits(gemm: str, shape: tuple[int, ...]) -> np.ndarray | None:
            """dy's random bits in this GEMM, for an operand that rounds stochastically."""
            return ctx.meta.random_bits(shape, call, gemm) if getattr(
                gemms, gemm).a.stochastic else None

        if ctx.needs_input_grad[0]:
            grad_fp8 = recipes.quantize(grad, gemms.grad_input.a, bits("grad_input", grad.shape))
            grad_x = recipes.scaled_gemm(grad_fp8, weight_t, gemms.grad_input.accumulate)
            grad_x = round_to(grad_x, x_dtype).reshape(ctx.x_shape)  # (N, in)
        if ctx.needs_input_grad[1]:
            grad_k = grad  # (N, out): the tokens are the GEMM's K
            if gemms.grad_weight.hadamard:  # the matrix forward applied to x's tokens
                grad_k = hadamard_transform(widen(grad), ctx.meta.hadamard)
            grad_t = recipes.quantize(grad_k.T, gemms.grad_weight.a,
                                      bits("grad_weight", grad_k.T.shape))  # along tokens
            grad_weight = recipes.scaled_gemm(grad_t, rows_t, gemms.grad_weight.accumulate)
            grad_weight = round_to(grad_weight, weight_dtype)  # (out, in)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(widen(grad).sum(axis=0), bias_dtype)  # float32 sum
        return grad_x, grad_weight, grad_bias
