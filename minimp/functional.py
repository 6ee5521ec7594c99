"""Tensor functions that aren't methods: softmax, log_softmax, cross_entropy, linear, layer_norm."""

from typing import Any

from minimp import ops
from minimp.tensor import Tensor


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x) / sum(exp(x)) along axis, computed in float32, returned in x's dtype."""
    return ops.Softmax.apply(x, axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """x - logsumexp(x) along axis, computed in float32, returned in x's dtype."""
    return ops.LogSoftmax.apply(x, axis=axis)


def cross_entropy(logits: Tensor, targets: Any) -> Tensor:
    """Mean over the batch of -log softmax(logits)[target]; logits (B, C), integer targets (B,).

    The loss is a float32 scalar whatever the logits' dtype (see minimp/ops/loss.py for why).
    """
    if not isinstance(targets, Tensor):
        targets = Tensor(targets)
    return ops.CrossEntropy.apply(logits, targets)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """x @ weight^T + bias with float32 accumulation (weight is (out_features, in_features))."""
    if bias is None:
        return x @ weight.T
    return ops.Linear.apply(x, weight, bias)


def relu(x: Tensor) -> Tensor:
    """max(x, 0), elementwise."""
    return ops.ReLU.apply(x)


def layer_norm(x: Tensor, weight: Tensor, bias: Tensor, eps: float = 1e-5) -> Tensor:
    """Normalize the last axis to mean 0 and variance 1, then scale and shift."""
    return ops.LayerNorm.apply(x, weight, bias, eps=eps)
