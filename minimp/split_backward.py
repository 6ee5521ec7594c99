"""Backward in two passes, as zero-bubble pipelines need: input gradients now, weights' later.

A stage's backward computes two things: the gradient of its input, which the previous stage is
waiting for, and the gradients of its weights, which nobody needs until the optimizer step. Qi et
al. 2023 ("Zero Bubble Pipeline Parallelism") call them B and W and schedule W into the time a
stage would otherwise idle. `backward_input(output, grad, weights)` walks the graph once; every op
that reads a weight computes only its other inputs' gradients (ctx.needs_input_grad tells it:
a Linear computes dL/dx = dL/dy W now and leaves dL/dW = dL/dy^T x) and keeps what forward saved,
with the gradient of its output. `backward_weight(pending)` runs those ops once more for the weights
alone, and each weight's gradient goes into `.grad` (hooks included) as soon as its last op is done.

B then W gives the same bits as one backward: each op computes the same products from the same
arrays; only when they run changes. What W needs stays alive until W: the ops' saved arrays and the
gradients of their outputs (the memory price of deferring).
"""

from dataclasses import dataclass, field
from typing import Sequence

from minimp.backend import Array
from minimp.function import add_gradients, node_backward
from minimp.tensor import Node, Tensor, accumulate_leaf, walk_backward


@dataclass
class PendingWeightGradients:
    """What backward_input left for backward_weight: (node, gradient of its output) per op that
    reads a weight, in the order backward reached them, and the weights."""

    deferred: list[tuple[Node, Array]] = field(default_factory=list)
    weights: Sequence[Tensor] = ()


def backward_input(output: Tensor, grad: Tensor | Array | None,
                   weights: Sequence[Tensor]) -> PendingWeightGradients:
    """Backward through output's graph for everything but `weights` (leaves): leaf inputs such as a
    stage's input get their `.grad`; the weights' gradients are left for backward_weight."""
    deferred = walk_backward(output, output._initial_grad(grad, "backward_input()"), weights)
    return PendingWeightGradients(deferred, weights)


def backward_weight(pending: PendingWeightGradients) -> None:
    """The weights' gradients from the ops backward_input deferred, each summed over the ops that
    read it and accumulated (with its hooks) once its last op has run."""
    wanted = {id(weight) for weight in pending.weights}
    remaining: dict[int, int] = {}  # how many deferred ops still read each weight
    for node, _ in pending.deferred:
        for parent in {id(p): p for p in node.inputs if id(p) in wanted}.values():
            remaining[id(parent)] = remaining.get(id(parent), 0) + 1
    sums: dict[int, Array] = {}
    for node, grad_output in pending.deferred:
        grads = node_backward(node, grad_output, lambda t: id(t) in wanted)
        node.context.saved_arrays = None  # both halves have run: release what forward kept
        for parent, parent_grad in zip(node.inputs, grads):
            if parent_grad is not None:
                previous = sums.get(id(parent))
                sums[id(parent)] = (parent_grad if previous is None
                                    else add_gradients(previous, parent_grad))
        for parent in {id(p): p for p in node.inputs if id(p) in wanted}.values():
            remaining[id(parent)] -= 1
            if remaining[id(parent)] == 0 and id(parent) in sums:
                accumulate_leaf(parent, sums.pop(id(parent)))
    pending.deferred = []
