"""Tensor functions that aren't methods: softmax, cross_entropy, linear, layer_norm, attention, ...

Names and arguments follow torch.nn.functional where PyTorch has the function.
"""

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy.typing as npt

from minimp import backend, ops
from minimp.backend import Array
from minimp.tensor import Tensor, TensorLike, as_tensor

if TYPE_CHECKING:  # for the annotation only: precision.fp8_scaling is a layer above the ops
    from minimp.precision.fp8_scaling import Fp8Meta
    from minimp.precision.recipes import BlockScaledMeta


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along axis, computed in float32, returned in x's dtype."""
    return ops.Softmax.apply(x, axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """x - logsumexp(x) along axis, computed in float32, returned in x's dtype."""
    return ops.LogSoftmax.apply(x, axis=axis)


def cross_entropy(logits: Tensor, targets: TensorLike) -> Tensor:
    """Mean over the batch of -log softmax(logits)[target]; logits (B, C), integer targets (B,).

    The loss is a float32 scalar whatever the logits' dtype (see minimp/ops/softmax.py for why).
    """
    return ops.CrossEntropy.apply(logits, as_tensor(targets))


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           fp8_meta: "Fp8Meta | BlockScaledMeta | None" = None) -> Tensor:
    """x @ weight^T + bias with float32 accumulation (weight is (out_features, in_features)).
    With an `fp8_meta`, x and weight enter the product in fp8: a scale per tensor
    (precision.Fp8Meta, ops.Fp8Linear) or per group (precision.recipes.BlockScaledMeta,
    ops.BlockScaledLinear)."""
    if fp8_meta is not None:
        if bias is None:  # a constant zero bias: the fused op always adds one
            bias = Tensor(backend.current_device().xp.zeros(weight.shape[0], weight.dtype))
        if not fp8_meta.per_tensor:  # a block-scaled recipe (precision/recipes.py)
            return ops.BlockScaledLinear.apply(x, weight, bias, meta=fp8_meta)
        return ops.Fp8Linear.apply(x, weight, bias, meta=fp8_meta)
    if bias is not None:
        return ops.Linear.apply(x, weight, bias)
    if x.ndim == 2:
        return x @ weight.T
    # One (N, in) @ (in, out) product: a batched one would build a (B, in, out) weight gradient.
    rows = x.reshape(-1, x.shape[-1]) @ weight.T  # (N, out), N = all leading axes together
    return rows.reshape(*x.shape[:-1], weight.shape[0])


def relu(x: Tensor) -> Tensor:
    """max(x, 0), elementwise."""
    return ops.ReLU.apply(x)


def gelu(x: Tensor, approximate: str = "tanh") -> Tensor:
    """x/2 (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), in float32; only the tanh form (GPT-2's)."""
    if approximate != "tanh":
        raise ValueError(f"gelu: only approximate='tanh' is implemented, got {approximate!r}")
    return ops.GELU.apply(x)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Normalize the last axis to mean 0 and variance 1, then scale and shift."""
    return ops.LayerNorm.apply(x, weight, bias, eps=eps)


def embedding(indices: TensorLike, weight: Tensor) -> Tensor:
    """weight[indices]: one row of weight per integer index (token ids -> vectors)."""
    return ops.Embedding.apply(as_tensor(indices), weight)


def index_add(rows: Tensor, indices: Array, num_rows: int) -> Tensor:
    """zeros (num_rows, C) with rows[i] added at row indices[i] (PyTorch's index_add)."""
    return ops.IndexAdd.apply(rows, indices=indices, num_rows=num_rows)


def dropout(x: Tensor, p: float, seed: int, step: int, layer: int, sample_indices: npt.ArrayLike,
            offset: int = 0) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1 - p); the mask is a pure
    function of (seed, step, layer, sample_indices[row], offset + position) (see
    minimp/ops/dropout.py; `offset` places a slice of a larger tensor)."""
    if p == 0.0:
        return x
    return ops.Dropout.apply(
        x, p=p, seed=seed, step=step, layer=layer, sample_indices=sample_indices, offset=offset)


def scaled_masked_softmax(scores: Tensor, scale: float, causal: bool = True,
                          mask: Array | None = None) -> Tensor:
    """softmax(scale * scores) over the last axis with keys after each query (causal) and where
    mask is False hidden; float32 inside, fully masked rows give zeros (minimp/ops/softmax.py)."""
    return ops.ScaledMaskedSoftmax.apply(scores, scale=scale, causal=causal, mask=mask)


def tiled_attention(q: Tensor, k: Tensor, v: Tensor, chunk_size: int,
                    order: Sequence[Sequence[int]] | None = None) -> Tensor:
    """Causal attention softmax(q k^T / sqrt(D)) v of (B, H, T, D) inputs, merged one key/value
    chunk of chunk_size positions at a time with an online softmax, never holding the T x T
    probabilities; order[i] lists the key chunks 0..i query chunk i merges, in order (None:
    ascending) (minimp/ops/attention.py)."""
    return ops.TiledAttention.apply(q, k, v, chunk_size=chunk_size, order=order)


def split(x: Tensor, size: int, axis: int = -1) -> tuple[Tensor, ...]:
    """Views of x, `size` long each along axis (torch.split): (B, T, 3C) -> 3 of (B, T, C)."""
    axis = axis % x.ndim
    length = x.shape[axis]
    if length % size:
        raise ValueError(f"split: axis {axis} of length {length} is not a multiple of {size}")
    before = (slice(None),) * axis
    return tuple(x[before + (slice(start, start + size),)] for start in range(0, length, size))
