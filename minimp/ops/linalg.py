"""Matrix products with float32 accumulation: half-precision inputs are widened, multiplied in float32
and the result is rounded once. That is what tensor cores do (fp16 inputs, fp32 accumulators), and on
NumPy it is also ~100x faster than its float16 matmul, which has no BLAS behind it."""

from minimp.backend import array_module
from minimp.function import Function, unbroadcast
from minimp.precision import casting
from minimp.precision.casting import round_to, widen


def _swap_last_two(array):
    return array_module(array).swapaxes(array, -1, -2)


class MatMul(Function):
    """y = a @ b;  dL/da = dL/dy @ b^T,  dL/db = a^T @ dL/dy (batch axes summed where broadcast)."""

    @staticmethod
    def forward(ctx, a, b):
        if a.ndim < 2 or b.ndim < 2:
            raise ValueError(f"matmul needs operands with 2 or more axes, got shapes {a.shape} and {b.shape}"
                             " (reshape a vector to (1, n) or (n, 1))")
        ctx.save_for_backward(a, b)
        return round_to(widen(a) @ widen(b), casting.result_dtype(a.dtype, b.dtype))

    @staticmethod
    def backward(ctx, grad_output):
        a, b = ctx.saved_arrays
        grad = widen(grad_output)
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = unbroadcast(grad @ _swap_last_two(widen(b)), a.shape, a.dtype)
        if ctx.needs_input_grad[1]:
            grad_b = unbroadcast(_swap_last_two(widen(a)) @ grad, b.shape, b.dtype)
        return grad_a, grad_b


class Linear(Function):
    """y = x @ W^T + b (W is (out, in), as in PyTorch), fused so the bias is added before rounding.

    dL/dx = dL/dy @ W,  dL/dW = dL/dy^T @ x,  dL/db = sum of dL/dy over the batch.
    Backward widens dL/dy once and uses it three times; it skips dL/dx for the input data.
    """

    @staticmethod
    def forward(ctx, x, weight, bias):
        if x.shape[-1] != weight.shape[1]:
            raise ValueError(f"linear: input has {x.shape[-1]} features, the layer expects {weight.shape[1]}")
        ctx.save_for_backward(x, weight)
        ctx.bias_dtype = bias.dtype
        rows = x.reshape(-1, x.shape[-1])  # (N, in) with N = all leading axes together
        output = widen(rows) @ widen(weight).T + widen(bias)  # (N, out), float32
        dtype = casting.result_dtype(x.dtype, weight.dtype)
        return round_to(output, dtype).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_arrays
        grad = widen(grad_output).reshape(-1, weight.shape[0])  # (N, out), float32
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = round_to(grad @ widen(weight), x.dtype).reshape(x.shape)
        if ctx.needs_input_grad[1]:
            grad_weight = round_to(grad.T @ widen(x.reshape(-1, x.shape[-1])), weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = round_to(grad.sum(axis=0), ctx.bias_dtype)
        return grad_x, grad_weight, grad_bias
