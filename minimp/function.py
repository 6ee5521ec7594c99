"""What an op is: a Function with forward and backward side by side, its Context, and the two
gradient sums ops and the backward walk share (unbroadcast, add_gradients).

A Function works on raw arrays; `Function.apply` runs it on Tensors and, when a gradient is wanted,
records a node of the graph; `node_backward` runs a node's backward (the graph itself, and the walk
back through it, live in tensor.py).
"""

import threading
from typing import TYPE_CHECKING, Any, Callable, ClassVar

import numpy as np

from minimp import backend
from minimp.backend import Array
from minimp.precision import casting

# Saved-tensor hooks are per thread, as grad mode is: the simulated world's ranks are threads.
_saved_hooks = threading.local()


class saved_tensors_hooks:
    """Context manager (PyTorch's torch.autograd.graph.saved_tensors_hooks): inside it, every array
    an op saves for backward is stored as pack(array), and backward gets unpack(that) back.

    ZeRO stage 3 uses it to keep gathered weights out of the graph: pack turns a weight into a
    note of where it lives, the weight is freed after the forward, and unpack finds it again once
    it has been gathered anew for the backward (minimp/parallel/zero/stage3.py).
    """

    def __init__(self, pack: Callable[[Array], object], unpack: Callable[[Any], Array]):
        self.pack, self.unpack = pack, unpack

    def __enter__(self) -> "saved_tensors_hooks":
        self._previous = getattr(_saved_hooks, "current", None)
        _saved_hooks.current = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        _saved_hooks.current = self._previous


class Context:
    """What forward leaves for backward: saved arrays and a few plain attributes."""

    def __init__(self, needs_input_grad: tuple[bool, ...]):
        # One bool per input: backward skips the gradients nobody asked for (data, targets).
        self.needs_input_grad = needs_input_grad
        self.saved_arrays: tuple[Any, ...] | None = ()  # arrays, or what saved-tensor hooks packed
        self.unpack: Callable[[Any], Array] | None = None  # set when saved-tensor hooks packed them

    if TYPE_CHECKING:  # an op keeps any plain attribute on ctx (ctx.axis, ctx.scale), as in PyTorch

        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: object) -> None: ...

    def save_for_backward(self, *arrays: Array) -> None:
        """Keep these arrays alive until backward, stored as they are: float16 stays float16
        (or as the active saved_tensors_hooks pack them)."""
        hooks = getattr(_saved_hooks, "current", None)
        if hooks is None:
            self.saved_arrays = arrays
        else:
            self.saved_arrays = tuple(hooks.pack(array) for array in arrays)
            self.unpack = hooks.unpack

    def unpack_saved(self) -> None:
        """Turn packed saved arrays back into arrays (backward calls this before the op's own)."""
        if self.unpack is not None and self.saved_arrays is not None:
            self.saved_arrays = tuple(self.unpack(packed) for packed in self.saved_arrays)
            self.unpack = None


class Function:
    """One differentiable op. Subclasses write `forward(ctx, *arrays, **options)` -> array and
    `backward(ctx, grad_output)` -> one gradient (or None) per input, both on raw arrays."""

    # Each op writes both as static methods with its own inputs and options (Add: ctx, a, b).
    forward: ClassVar[Callable[..., Array]]
    backward: ClassVar[Callable[..., Array | tuple[Array | None, ...]]]

    @classmethod
    def apply(cls, *inputs: "graph.Tensor", **options: object) -> "graph.Tensor":
        """Run forward on the inputs' arrays; when a gradient is wanted, record the graph node."""
        for position, value in enumerate(inputs):
            if not isinstance(value, graph.Tensor):
                raise TypeError(
                    f"{cls.__name__}: input {position} is a {type(value).__module__}."
                    f"{type(value).__name__}, not a Tensor (wrap it: minimp.Tensor(value))")
        enabled = graph.grad_enabled()
        ctx = Context(tuple(enabled and t.requires_grad for t in inputs))
        output = graph.Tensor(cls.forward(ctx, *(t.data for t in inputs), **options))
        if any(ctx.needs_input_grad):
            output.requires_grad = True
            output.node = graph.Node(cls, ctx, inputs)
        return output


def node_backward(
    node: "graph.Node", grad_output: Array, wanted: Callable[["graph.Tensor"], bool] | None = None
) -> tuple[Array | None, ...]:
    """The op's backward: one gradient (or None) per input, checked against the input. With
    `wanted` (a predicate on inputs), only the inputs it accepts get a gradient: the op is told
    through ctx.needs_input_grad (and skips the others' work), and anything else is dropped."""
    context, everything = node.context, node.context.needs_input_grad
    if wanted is not None:
        context.needs_input_grad = tuple(
            needed and wanted(parent) for needed, parent in zip(everything, node.inputs))
    try:
        if any(context.needs_input_grad):
            input_grads = node.function.backward(context, grad_output)
        else:
            input_grads = (None,) * len(node.inputs)
        asked = context.needs_input_grad
    finally:
        context.needs_input_grad = everything
    if not isinstance(input_grads, tuple):
        input_grads = (input_grads,)
    checked = tuple(grad if needed else None for grad, needed in zip(input_grads, asked))
    for parent, grad in zip(node.inputs, checked):
        if grad is not None and (grad.shape != parent.shape or grad.dtype != parent.dtype):
            raise RuntimeError(  # a bug in that op's backward, not in the caller's code
                f"{node.function.__name__}.backward returned a {grad.dtype} gradient of shape "
                f"{grad.shape} for a {parent.dtype} input of shape {parent.shape}")
    return checked


def unbroadcast(grad: Array, shape: tuple[int, ...], dtype: np.dtype) -> Array:
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


def add_gradients(a: Array, b: Array) -> Array:
    """a + b for two gradients of one tensor: in float32 when they are stored in 16 bits, rounded
    once, into the float32 copy widening made or an array from the memory pool (fresh memory for
    every sum costs a page fault per 4 KiB in every step)."""
    wide = casting.widen(a)
    out = backend.empty(a.shape, a.dtype, a) if wide is a else wide
    return casting.round_to(backend.array_module(a).add(wide, casting.widen(b), out=out), a.dtype)


# The one import cycle of every autograd engine: a Tensor's operators are Functions, and a Function
# makes Tensors. Imported last and used by module, so either file may be imported first.
from minimp import tensor as graph  # noqa: E402
