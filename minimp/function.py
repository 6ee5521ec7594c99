"""The base of every differentiable op: a Function with forward and backward, a Context,
unbroadcast."""

import threading

from minimp.precision import casting

# Grad mode is per thread: the simulated MPI world runs its ranks as threads of one process.
_grad_mode = threading.local()


def grad_enabled():
    """False inside `minimp.no_grad()`: ops then record no graph and keep nothing for backward."""
    return getattr(_grad_mode, "enabled", True)


class no_grad:
    """Context manager: no graph is recorded inside (evaluation, optimizer updates)."""

    def __enter__(self):
        self._previous = grad_enabled()
        _grad_mode.enabled = False
        return self

    def __exit__(self, *exc_info):
        _grad_mode.enabled = self._previous
        return False


class Context:
    """What forward leaves for backward: saved arrays and a few plain attributes."""

    def __init__(self, needs_input_grad):
        # One bool per input: backward skips the gradients nobody asked for (data, targets).
        self.needs_input_grad = needs_input_grad
        self.saved_arrays = ()

    def save_for_backward(self, *arrays):
        """Keep these arrays alive until backward. They are stored as they are: float16 stays
        float16."""
        self.saved_arrays = arrays


class Node:
    """A recorded application of a Function: the op, its context and the input tensors."""

    __slots__ = ("function", "context", "inputs")

    def __init__(self, function, context, inputs):
        self.function, self.context, self.inputs = function, context, inputs


class Function:
    """One differentiable op. Subclasses write `forward(ctx, *arrays, **options)` -> array and
    `backward(ctx, grad_output)` -> one gradient (or None) per input, both on raw arrays."""

    @staticmethod
    def forward(ctx, *arrays, **options):
        raise NotImplementedError

    @staticmethod
    def backward(ctx, grad_output):
        raise NotImplementedError

    @classmethod
    def apply(cls, *inputs, **options):
        """Run forward on the inputs' arrays and, when a gradient is wanted, record the graph
        node."""
        from minimp.tensor import Tensor

        needs_input_grad = tuple(grad_enabled() and t.requires_grad for t in inputs)
        ctx = Context(needs_input_grad)
        output = Tensor(cls.forward(ctx, *(t.data for t in inputs), **options))
        if any(needs_input_grad):
            output.requires_grad = True
            output.node = Node(cls, ctx, inputs)
        return output


def unbroadcast(grad, shape, dtype):
    """Sum a gradient over the axes that broadcasting added or stretched, then round it into dtype.

    The sum runs in float32 even for a float16 gradient: many small terms added in float16 swamp.
    """
    if grad.shape != tuple(shape):
        grad = casting.widen(grad)
        leading = grad.ndim - len(shape)
        if leading > 0:
            grad = grad.sum(axis=tuple(range(leading)))
        stretched = tuple(i for i, size in enumerate(shape) if size == 1 and grad.shape[i] != 1)
        if stretched:
            grad = grad.sum(axis=stretched, keepdims=True)
    return casting.round_to(grad, dtype)
