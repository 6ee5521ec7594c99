"""Activation recomputation: a block keeps only its input for backward and reruns its forward there.

Memory for compute (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost"; PyTorch's
torch.utils.checkpoint; Megatron-LM's full recomputation, Korthikanti et al. 2022, section 5).
Without it, every op of a block keeps what its backward reads (a GPT block: 34 sbh + 5 as^2 b
bytes in fp16, models/gpt.py); with it, the block keeps its input alone (2 sbh) and its backward
first runs the block's forward again, with the graph on, then walks back through that graph. The
price is one more forward of every recomputed block: about a third more compute for a step whose
backward costs two forwards.

The results are the same bit for bit: the second forward computes the same arrays from the same
input, and the backward through it adds the same terms in the same order. Dropout draws the same
masks because a mask is a pure function of (seed, step, layer, sample) and the block's dropout
states, captured at the first forward, are put back for the second (minimp/ops/dropout.py).
"""

from typing import Sequence

from minimp.backend import Array
from minimp.function import Context, Function
from minimp.nn.layers import Dropout, Sequential
from minimp.nn.module import Module
from minimp.tensor import Tensor, grad_enabled, no_grad


class Recompute(Function):
    """y = block(x), with nothing of the block kept but x;
    dL/dx and the parameters' dL/dW = those of block(x), computed by rerunning it in backward.

    The block's parameters are inputs of this op (so its output wants a gradient even when x is
    data), but their gradients are not returned: the inner backward leaves them in `.grad`, as any
    backward does, and runs their hooks there.
    """

    @staticmethod
    def forward(ctx: Context, x: Array, *parameter_arrays: Array, block: Sequential) -> Array:
        """The block's forward without a graph; keeps x and the states of the block's dropouts."""
        ctx.save_for_backward(x)
        ctx.block, ctx.parameter_count = block, len(parameter_arrays)
        ctx.dropout_states = [(d, d.state) for d in block.modules() if isinstance(d, Dropout)]
        with no_grad():
            return block(Tensor(x)).data

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array | None, ...]:
        """The forward again, with the graph and the same masks, then backward through it."""
        (x,) = ctx.saved_arrays
        current = [(dropout, dropout.state) for dropout, _ in ctx.dropout_states]
        for dropout, state in ctx.dropout_states:  # this micro-batch's masks, not the latest
            dropout.state = state
        leaf = Tensor(x, requires_grad=ctx.needs_input_grad[0])
        ctx.block(leaf).backward(grad_output)  # the graph is recorded during backward
        for dropout, state in current:
            dropout.state = state
        return (leaf.grad, *[None] * ctx.parameter_count)


def recompute(modules: Sequence[Module], x: Tensor) -> Tensor:
    """The modules applied in order to x, keeping only x for backward (PyTorch:
    torch.utils.checkpoint.checkpoint). Without grad mode there is no backward: a plain forward."""
    block = Sequential(*modules)  # the modules in order, as one module
    if not grad_enabled():
        return block(x)
    return Recompute.apply(x, *block.parameters(), block=block)
