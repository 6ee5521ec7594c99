"""Reference solutions to lesson 10's exercises (mixed precision meets attention). Try them
yourself first."""

import numpy as np


def scaled_masked_softmax(scores, scale, mask=None):
    """softmax(scale * scores) over the keys, causal (and `mask`), in float32, rounded once.

    Widen before scaling, so the logits are not rounded a second time; mask with -inf; shift
    each row by its maximum, so every exp is at most 1 (the maximum of a fully masked row is
    -inf: shift it by 0 instead, its exps are all 0, and divide its sum of 0 by 1).
    """
    queries, keys = scores.shape[-2:]
    keep = np.tri(queries, keys, k=keys - queries, dtype=bool)  # query i sees keys 0..i
    if mask is not None:
        keep = keep & np.asarray(mask, bool)
    logits = np.where(keep, scores.astype(np.float32) * np.float32(scale), np.float32(-np.inf))
    row_max = logits.max(axis=-1, keepdims=True)
    exps = np.exp(logits - np.where(row_max == -np.inf, np.float32(0), row_max))
    total = exps.sum(axis=-1, keepdims=True)
    return (exps / np.where(total == 0, np.float32(1), total)).astype(scores.dtype)


def softmax_backward(y, grad_output, scale):
    """dL/ds = scale * y * (dL/dy - sum over the keys of dL/dy * y), in float32 for 16-bit
    inputs (float64 stays float64), rounded once into y's dtype.

    Where a row is nearly one-hot the bracket is a small difference of two large numbers; in
    float32 its rounding error stays far below a float16 ulp of the result.
    """
    wide = np.float64 if y.dtype == np.float64 else np.float32
    y32, grad = y.astype(wide), grad_output.astype(wide)
    dot = (grad * y32).sum(axis=-1, keepdims=True)
    return (wide(scale) * y32 * (grad - dot)).astype(y.dtype)


def block_bytes(s, b, h, a, itemsize, dropout):
    """Bytes one GPT block keeps for backward, activations of d = itemsize bytes.

    sbh terms, d bytes each: ln_1's and ln_2's inputs (2), c_attn's input (1), q and k (2, the
    inputs of q @ k^T), v (1), c_proj's input (1), c_fc's input (1), GELU's input (4) and
    mlp.c_proj's input (4): 16 d sbh. The softmax keeps its output: d as^2 b. With dropout the
    product with v keeps the dropped-out attention too (another d as^2 b) and three masks of 1
    byte: attention's (as^2 b) and the two residual dropouts' (2 sbh). Each LayerNorm keeps a
    mean and a 1/std per row in float32 (in float64 when the activations are): 2 x 2 x sb.
    """
    d = itemsize
    statistics = 2 * 2 * max(d, 4) * s * b
    if dropout:
        return (16 * d + 2) * s * b * h + (2 * d + 1) * a * s * s * b + statistics
    return 16 * d * s * b * h + d * a * s * s * b + statistics


GAMMA = 0x9E3779B97F4A7C15  # 2^64 / golden ratio: SplitMix64's increment (Steele et al. 2014)


def _mix(z):
    """SplitMix64's finalizer on uint64 arrays (wrapping arithmetic, as on the hardware)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def keep_mask(shape, p, seed, step, layer, sample_indices):
    """A counter-based hash: key = mix of (seed, step, layer), counter = (sample, position);
    bits = mix(key + (counter + 1) * g); keep where bits >= p * 2^64. Nothing is drawn in
    sequence, so a sample's mask is the same in any batch, shard or micro-batch."""
    with np.errstate(over="ignore"):  # uint64 scalars warn on wrap-around; arrays do not
        key = np.zeros(1, np.uint64)
        for word in (seed, step, layer):
            key = _mix(key + np.uint64(word) + np.uint64(GAMMA))
        samples = np.asarray(sample_indices, np.uint64).reshape(-1, 1)
        positions = np.arange(int(np.prod(shape[1:])), dtype=np.uint64).reshape(1, -1)
        counters = (samples << np.uint64(32)) | positions  # (B, elements)
        bits = _mix((counters + np.uint64(1)) * np.uint64(GAMMA) + key)
    return (bits >= np.uint64(min(int(p * 2.0**64), 2**64 - 1))).reshape(shape)
