"""Softmax in float32 and the ops built on it: softmax, log-softmax, cross-entropy, and attention's
fused scaled, causally masked softmax.

Why float32: exp() overflows float16 at x > 11.09, so a float16 softmax of ordinary logits
gives inf/inf; log-probabilities of rare classes need more than 11 bits; and the loss is
multiplied by the loss scale (2^16 by default), which would overflow float16's 65504 for any
loss above 1. The loss itself is returned in float32; the gradients going back into the network
are rounded to the logits' dtype.

Attention's fused softmax (ScaledMaskedSoftmax) is computed in float32 from 16-bit scores.
Attention scores s = q @ k^T leave the matrix product rounded once into 16 bits. This op reads
them, and in float32 scales, masks, normalizes and rounds once. Each of those steps goes wrong if
done in float16 (compare Megatron-LM's fused `scaled_upper_triang_masked_softmax` kernel):

- Masking with -inf, then shifting by the row maximum: in a row where every entry is masked the
  maximum is -inf itself and (-inf) - (-inf) is NaN. Masking with a large finite number instead
  (-1e9, say) does not help in float16: -1e9 rounds to -inf there.
- exp(x) overflows float16 for x > 11.09 (e^11.09 ~ 65504), so logits must be shifted by their
  maximum first; and the sum of a row's exps, each up to 1, stalls in float16 once it passes 2048.
- Where the 1/sqrt(d) goes: scaled here, after the product, in float32, so the scaled logits never
  round again. The price is that the unscaled product must fit the 16-bit score: |q . k| <= 65504,
  i.e. a scaled logit up to 65504 / sqrt(d) (8188 for d = 64; the softmax is one-hot long before).
  A product past that is inf and makes the row NaN. Scaling q before the product instead rounds q a
  second time (unless the scale is a power of two: 1/8 for d = 64 is exact), and Megatron's
  query-key layer scaling divides inside the product and multiplies back in float32 for the same
  reason. bfloat16 has float32's range, so there the question is only precision, not overflow.
- A fully masked row (a padded query, or a mask that hides everything) is 0/0. Here it gives
  zeros, and so a zero gradient, never NaN.
"""

from types import ModuleType

import numpy as np

from minimp import backend
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
    included (Softmax's backward, and ScaledMaskedSoftmax's before its scale)."""
    grad, wide_y = widen(grad_output), widen(y)
    xp = array_module(wide_y)
    # In place in one array from the memory pool, in the formula's order: the same bits.
    result = xp.multiply(grad, wide_y, out=backend.empty(wide_y.shape, wide_y.dtype, wide_y))
    xp.subtract(grad, result.sum(axis=axis, keepdims=True), out=result)
    result *= wide_y
    return result


def _times(array: Array, scale: float) -> Array:
    """scale * array, in place when the product keeps the array's dtype (scale a Python float:
    NumPy rounds it to the array's dtype first, as `scale * array` does), else a new array."""
    if np.result_type(array.dtype, scale) != array.dtype:
        return scale * array
    array *= scale
    return array


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

    Backward keeps the logits (in their own dtype: a Linear keeps its input, not its output, so
    these are held for the loss alone) and the targets, and recomputes the softmax, so a float16
    graph holds no float32 copy of the probabilities.
    """

    @staticmethod
    def forward(ctx: Context, logits: Array, targets: Array) -> Array:
        if logits.ndim != 2 or targets.shape != logits.shape[:1]:
            raise ValueError(f"cross_entropy needs logits (B, C) and targets (B,), got "
                             f"{logits.shape} and {targets.shape}")
        xp = array_module(logits)
        targets = xp.asarray(targets)  # integer labels may come from the host: index on the device
        if targets.dtype.kind not in "iu":  # a float or bool label would index the wrong class
            raise TypeError(f"cross_entropy: targets must be integer class indices, got "
                            f"{targets.dtype} (use labels.astype(np.int64))")
        if targets.size and (int(targets.min()) < 0 or int(targets.max()) >= logits.shape[1]):
            raise ValueError(f"cross_entropy: targets must lie in 0..{logits.shape[1] - 1}, got "
                             f"values in {int(targets.min())}..{int(targets.max())}")
        ctx.save_for_backward(logits, targets)
        log_probabilities = _log_softmax32(logits, axis=1)
        picked = log_probabilities[xp.arange(len(targets)), targets]
        # float32 at least; float64 logits (gradient checks) keep float64.
        return xp.asarray(
            -picked.mean(dtype=casting.result_dtype(logits.dtype, casting.ACCUMULATE_DTYPE)))

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array, None]:
        logits, targets = ctx.saved_arrays
        xp = array_module(logits)
        grad = xp.exp(_log_softmax32(logits, axis=1))  # softmax, (B, C), float32
        grad[xp.arange(len(targets)), targets] -= 1.0
        grad *= widen(grad_output) / len(targets)
        return round_to(grad, logits.dtype), None


def attention_mask(xp: ModuleType, shape: tuple[int, ...], causal: bool = True,
                   mask: Array | None = None) -> Array | None:
    """Where a query may attend, broadcastable to the scores' shape (..., T_q, T_k): True on and
    below the diagonal when causal (query i sees keys up to i + T_k - T_q, so a query block at
    the end of a longer key sequence works too), and'ed with `mask` (True = may attend)."""
    keep = None
    if causal:
        queries, keys = shape[-2], shape[-1]
        keep = xp.tri(queries, keys, k=keys - queries, dtype=bool)  # (T_q, T_k)
    if mask is not None:
        mask = xp.asarray(mask, dtype=bool)
        keep = mask if keep is None else keep & mask
    return keep


class ScaledMaskedSoftmax(Function):
    """y = softmax(scale * s, over the last axis, with masked entries set to -inf; all-masked rows
    give 0);  dL/ds = scale * y * (dL/dy - sum(dL/dy * y)).

    `causal=True` masks keys after each query; `mask` (bool, True = may attend, broadcastable to s)
    masks more, e.g. padding. Backward keeps only y, in the scores' dtype, as a plain softmax does.
    """

    @staticmethod
    def forward(ctx: Context, scores: Array, scale: float, causal: bool = True,
                mask: Array | None = None) -> Array:
        xp = array_module(scores)
        ctx.scale = scale
        # float32: logits past 11.09 would overflow exp in float16. Every step below works in
        # place in one array from the memory pool (the same operations, so the same bits, as
        # new arrays for each, without their allocations).
        wide_scores = widen(scores)
        wide = xp.multiply(wide_scores, scale, out=backend.empty(
            scores.shape, np.result_type(wide_scores.dtype, scale), scores))
        keep = attention_mask(xp, scores.shape, causal, mask)
        if keep is not None:
            xp.copyto(wide, wide.dtype.type(-np.inf), where=~keep)
        row_max = wide.max(axis=-1, keepdims=True)
        # A fully masked row has maximum -inf: shift it by 0 instead, so exp(-inf) = 0, not NaN.
        row_max = xp.where(row_max == -np.inf, row_max.dtype.type(0), row_max)
        xp.subtract(wide, row_max, out=wide)
        exps = xp.exp(wide, out=wide)
        total = exps.sum(axis=-1, keepdims=True)
        total = xp.where(total == 0, total.dtype.type(1), total)  # 0 / 1, not 0 / 0
        y = round_to(xp.divide(exps, total, out=exps), scores.dtype)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (y,) = ctx.saved_arrays
        return round_to(_times(softmax_backward(grad_output, y, axis=-1), ctx.scale), y.dtype)
