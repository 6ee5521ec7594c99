"""Softmax, log-softmax and cross-entropy, always computed in float32.

Why float32: exp() overflows float16 at x > 11.09, so a float16 softmax of ordinary logits
gives inf/inf; log-probabilities of rare classes need more than 11 bits; and the loss is
multiplied by the loss scale (2^16 by default), which would overflow float16's 65504 for any
loss above 1. The loss itself is returned in float32; the gradients going back into the network
are rounded to the logits' dtype.
"""

from minimp.backend import Array, array_module
from minimp.function import Context, Function
from minimp.precision import casting
from minimp.precision.casting import round_to, widen


def _log_softmax32(logits: Array, axis: int) -> Array:
    """log(softmax(x)) in float32, shifted by the max so exp() never overflows."""
    wide = widen(logits)
    shifted = wide - wide.max(axis=axis, keepdims=True)
    xp = array_module(shifted)
    return shifted - xp.log(xp.exp(shifted).sum(axis=axis, keepdims=True))


def softmax_backward(grad_output: Array, y: Array, axis: int) -> Array:
    """dL/dx = y * (dL/dy - sum(dL/dy * y)) along axis, for y = softmax(x): in float32, the sum
    included (Softmax's backward, and attention's before its scale)."""
    grad, wide_y = widen(grad_output), widen(y)
    return wide_y * (grad - (grad * wide_y).sum(axis=axis, keepdims=True))


class Softmax(Function):
    """y = exp(x) / sum(exp(x));  dL/dx = y * (dL/dy - sum(dL/dy * y))."""

    @staticmethod
    def forward(ctx: Context, x: Array, axis: int = -1) -> Array:
        ctx.axis = axis
        y = round_to(array_module(x).exp(_log_softmax32(x, axis)), x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        return round_to(softmax_backward(grad_output, y, ctx.axis), y.dtype)


class LogSoftmax(Function):
    """y = x - log(sum(exp(x)));  dL/dx = dL/dy - softmax(x) * sum(dL/dy)."""

    @staticmethod
    def forward(ctx: Context, x: Array, axis: int = -1) -> Array:
        ctx.axis = axis
        y = round_to(_log_softmax32(x, axis), x.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        grad = widen(grad_output)
        softmax = array_module(grad).exp(widen(y))
        return round_to(grad - softmax * grad.sum(axis=ctx.axis, keepdims=True), y.dtype)


class CrossEntropy(Function):
    """L = mean over the batch of -log softmax(logits)[target];
    dL/dlogits = (softmax - onehot) / B.

    Backward keeps only the logits (already kept by the layer before) and recomputes the softmax,
    so a float16 graph holds no float32 copy of the probabilities.
    """

    @staticmethod
    def forward(ctx: Context, logits: Array, targets: Array) -> Array:
        if logits.ndim != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(
                f"cross_entropy needs logits (B, C) and targets (B,), got {logits.shape}"
                f" and {targets.shape}"
            )
        xp = array_module(logits)
        targets = xp.asarray(targets)  # integer labels may come from the host: index on the device
        if targets.dtype.kind not in "iu":  # a float or bool label would index the wrong class
            raise TypeError(
                f"cross_entropy: targets must be integer class indices, got {targets.dtype} "
                "(use labels.astype(np.int64))"
            )
        if targets.size and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[1]):
            raise ValueError(
                f"cross_entropy: targets must lie in 0..{logits.shape[1] - 1}, got values in "
                f"{int(targets.min())}..{int(targets.max())}"
            )
        ctx.save_for_backward(logits, targets)
        log_probabilities = _log_softmax32(logits, axis=1)
        picked = log_probabilities[xp.arange(len(targets)), targets]
        # float32 at least; float64 logits (gradient checks) keep float64.
        return xp.asarray(
            -picked.mean(dtype=casting.result_dtype(logits.dtype, casting.ACCUMULATE_DTYPE))
        )

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array, None]:
        logits, targets = ctx.saved_arrays
        xp = array_module(logits)
        grad = xp.exp(_log_softmax32(logits, axis=1))  # softmax, (B, C), float32
        grad[xp.arange(len(targets)), targets] -= 1.0
        grad *= widen(grad_output) / len(targets)
        return round_to(grad, logits.dtype), None
