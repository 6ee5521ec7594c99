"""The graph: Tensor (an array, the op that made it, its operators), grad mode,
topological order, backward.

Ops (minimp/ops, built on minimp/function.py) record one Node per application; `backward()` orders
the graph so each tensor comes after everything it depends on and walks it in reverse.

Tensor's Python operators and methods (+, *, @, .sum(), .reshape(), ...) each apply one op
Function. A Python number meets a tensor without being rounded to the tensor's dtype first: it
becomes a float32 scalar (float64 beside a float64 tensor), the op computes in float32 and rounds
the result once into the tensor's dtype, as PyTorch does (its CPU kernels compute half-precision
math in float). So `Tensor(float16 [60000]) / 70000.0` is 0.857 in float16, not 0 (70000 rounded
into float16 first would be inf), and `* 1e-8` does not flush to zero. Beside an integer tensor a
Python float gives a float32 result (PyTorch's default dtype) instead of truncating; `/` always
divides into floats.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import numpy as np
import numpy.typing as npt

from minimp import backend
from minimp.backend import Array
from minimp.function import Context, Function, add_gradients, node_backward
from minimp.precision import casting

NUMBER_TYPES = (bool, int, float, np.number, np.bool_)

# Grad mode is per thread: the simulated MPI world runs its ranks as threads of one process.
_grad_mode = threading.local()


def grad_enabled() -> bool:
    """False inside `minimp.no_grad()`: ops then record no graph and keep nothing for backward."""
    return getattr(_grad_mode, "enabled", True)


class no_grad:
    """Context manager: no graph is recorded inside (evaluation, optimizer updates)."""

    def __enter__(self) -> no_grad:
        self._previous = grad_enabled()
        _grad_mode.enabled = False
        return self

    def __exit__(self, *exc_info: object) -> None:
        _grad_mode.enabled = self._previous


@dataclass(slots=True, eq=False)
class Node:
    """A recorded application of a Function: the op, its context and the input tensors."""

    function: type[Function]
    context: Context
    inputs: tuple[Tensor, ...]


class RemovableHandle:
    """What `register_hook` returns: `.remove()` takes the hook away again (as in PyTorch)."""

    def __init__(self, hooks: list, hook: Callable):
        self._hooks, self._hook = hooks, hook

    def remove(self) -> None:
        """Take the hook away (a second call does nothing)."""
        if self._hook in self._hooks:
            self._hooks.remove(self._hook)


def _as_array(data: npt.ArrayLike) -> Array:
    """Arrays keep their dtype; Python numbers and float lists become float32 (as in PyTorch)."""
    if isinstance(data, np.generic):
        return np.asarray(data)
    if hasattr(data, "dtype") and hasattr(data, "shape") and hasattr(data, "view"):
        return data  # a NumPy or CuPy array: keep it, dtype and device included
    array = np.asarray(data)
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return backend.to_device(array)


# The floats a Tensor computes in (the ones that can carry gradients), and, beside them, any integer
# or bool array: token ids, labels and masks are Tensors too. Anything else NumPy can make (object
# from `[1, None]`, strings, complex, datetimes, fp8 bytes) has no kernels here, so it is refused
# when it arrives instead of failing later inside an op, or worse, computing on Python objects.
FLOATING_DTYPES = frozenset((casting.FLOAT16, casting.BFLOAT16, casting.FLOAT32, casting.FLOAT64))
INDEX_KINDS = "iub"  # NumPy's dtype.kind of signed and unsigned integers and of bool


def _checked_array(data: npt.ArrayLike, where: str) -> Array:
    """_as_array(data), or a TypeError naming what was given and what a Tensor holds; `where`
    names the path that set the data ("Tensor(data)" or "tensor.data = ...")."""
    array = _as_array(data)
    dtype = array.dtype
    if isinstance(dtype, np.dtype) and (dtype in FLOATING_DTYPES or dtype.kind in INDEX_KINDS):
        return array
    if isinstance(data, Tensor):  # NumPy made an object array of it
        raise TypeError(f"{where}: data is a Tensor, not an array; pass its .data instead")
    given = (f"data has dtype {dtype}" if hasattr(data, "dtype") else
             f"data is a {type(data).__name__}, which NumPy makes an array of dtype {dtype}")
    raise TypeError(
        f"{where}: {given}, which minimp cannot compute in; a Tensor holds float16, bfloat16, "
        "float32 or float64 (integers and bools too, for ids and masks): convert first, "
        "e.g. np.asarray(data, dtype=np.float32)")


def _lift_number(tensor: Tensor, number: float | np.number | np.bool_) -> tuple[Array, np.dtype]:
    """(a 0-d array holding number at the precision the op computes in, the result's dtype)."""
    dtype = np.dtype(tensor.dtype)
    if casting.is_floating(dtype):
        compute = casting.FLOAT64 if dtype == casting.FLOAT64 else casting.FLOAT32
        result = dtype
    elif isinstance(number, (float, np.floating)):  # an integer tensor meets a float
        compute = result = casting.FLOAT32
    else:  # integers with integers stay integers
        compute = result = dtype
    return backend.array_module(tensor.data).asarray(number, dtype=compute), result


def _binary(op: type[Function], x: Tensor, other: TensorLike, reflected: bool = False) -> Tensor:
    """op(x, other), or op(other, x) when reflected (`2.0 - x` calls x.__rsub__), where other may
    be a Python number or an array (see the file docstring)."""
    if isinstance(other, NUMBER_TYPES):
        scalar, dtype = _lift_number(x, other)
        other, options = Tensor(scalar), {"dtype": dtype}
    else:
        other, options = as_tensor(other), {}
    pair = (other, x) if reflected else (x, other)
    return op.apply(*pair, **options)


class Tensor:
    """An n-dimensional array that records how it was computed, so gradients can flow back to it.

    Tensor(data, requires_grad=False): data is a NumPy or CuPy array (kept as it is, dtype and
    device included), a Python number or a list (float64 becomes float32, as in PyTorch). It holds
    float16, bfloat16, float32 or float64 values, or integers and bools (ids, labels, masks); any
    other dtype (object, strings, complex, fp8, ...) is a TypeError. requires_grad: a bool,
    whether backward() fills this tensor's `.grad` (floating-point tensors only, as in PyTorch).
    Attributes: `.data` the array; `.grad` the gradient after `backward()` (same shape and dtype
    as data, or None); `.requires_grad`; `.node` the op application that made it (None for a
    leaf). Assigning `.data` or `.requires_grad` is checked as the constructor checks them.
    Operators (+, *, @, ...) and methods (.sum(), .reshape(), ...) are differentiable ops (see the
    file docstring for how a Python number meets a tensor).
    """

    __array_priority__ = 100  # so `numpy_array * tensor` calls Tensor.__rmul__
    _hooks: tuple | list = ()  # gradient hooks; a tensor gets its own list at its first hook
    _post_accumulate_hooks: tuple | list = ()  # hooks called after a leaf's .grad is updated

    def __init__(self, data: npt.ArrayLike, requires_grad: bool = False):
        self._data = _checked_array(data, "Tensor(data)")  # see the `data` property below
        # after backward(): d(output)/d(self), same shape and dtype as data
        self.grad: Array | None = None
        if requires_grad is not False:  # else the class's False below: every op's output is
            self.requires_grad = requires_grad  # made here; checked by its setter below
        self.node: Node | None = None  # the op application that made this tensor; None for leaves

    # ----- the two attributes whose values are checked on every assignment ---------------------
    # Properties, so that `t.data = array` and `t.requires_grad = True` meet the checks the
    # constructor makes: a wrong dtype is refused where it is set, not deep inside a later op.
    _requires_grad = False

    @property
    def data(self) -> Array:
        """The NumPy or CuPy array. Assigning one checks its dtype as `Tensor(data)` does (and,
        when this tensor requires grad, that it is floating-point, as in PyTorch)."""
        return self._data

    @data.setter
    def data(self, data: npt.ArrayLike) -> None:
        array = _checked_array(data, "tensor.data = data")
        if self._requires_grad and array.dtype not in FLOATING_DTYPES:
            raise TypeError(f"tensor.data = data: data has dtype {array.dtype}, but this tensor "
                            "requires grad, and only floating-point tensors can require gradients "
                            "(cast first, e.g. data.astype(np.float32))")
        self._data = array

    @property
    def requires_grad(self) -> bool:
        """Whether backward() computes a gradient for this tensor. Only floating-point tensors can
        require gradients (as in PyTorch): setting True on an integer or bool tensor is refused."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, requires_grad: bool) -> None:
        if not isinstance(requires_grad, (bool, np.bool_)):  # "yes", 1, None: a typo, a mix-up
            raise TypeError(f"requires_grad must be a bool (True or False), got "
                            f"{requires_grad!r} of type {type(requires_grad).__name__}")
        if requires_grad and self._data.dtype not in FLOATING_DTYPES:
            raise TypeError(
                f"only floating-point tensors can require gradients, got {self.dtype} "
                "(as in PyTorch; cast first, e.g. Tensor(array.astype(np.float32)))")
        self._requires_grad = bool(requires_grad)

    @property
    def dtype(self) -> np.dtype:
        """The array's dtype (float16, bfloat16, float32, ...)."""
        return self.data.dtype

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's shape."""
        return self.data.shape

    @property
    def ndim(self) -> int:
        """The number of axes."""
        return self.data.ndim

    @property
    def size(self) -> int:
        """The number of elements."""
        return self.data.size

    def __len__(self) -> int:
        """The length of the first axis."""
        return len(self.data)

    def __repr__(self) -> str:
        grad = ", requires_grad=True" if self.requires_grad else ""
        return f"Tensor({backend.to_numpy(self.data)!r}, dtype={self.dtype}{grad})"

    def numpy(self) -> np.ndarray:
        """The values as a NumPy array on the host."""
        return backend.to_numpy(self.data)

    def item(self) -> float:
        """The value of a one-element tensor as a Python number."""
        return self.numpy().item()

    def detach(self) -> Tensor:
        """The same array, cut from the graph."""
        return Tensor(self.data)

    # ----- operators and methods: each applies one op Function --------------------------------
    def __add__(self, other: TensorLike) -> Tensor:
        """self + other, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Add, self, other)

    def __radd__(self, other: TensorLike) -> Tensor:
        """other + self, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Add, self, other, reflected=True)

    def __sub__(self, other: TensorLike) -> Tensor:
        """self - other, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Sub, self, other)

    def __rsub__(self, other: TensorLike) -> Tensor:
        """other - self, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Sub, self, other, reflected=True)

    def __mul__(self, other: TensorLike) -> Tensor:
        """self * other, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Mul, self, other)

    def __rmul__(self, other: TensorLike) -> Tensor:
        """other * self, elementwise, broadcast; other may be an array or a Python number."""
        return _binary(ops.Mul, self, other, reflected=True)

    def __truediv__(self, other: TensorLike) -> Tensor:
        """self / other, elementwise, broadcast, in floats even for integers."""
        return _binary(ops.Div, self, other)

    def __rtruediv__(self, other: TensorLike) -> Tensor:
        """other / self, elementwise, broadcast, in floats even for integers."""
        return _binary(ops.Div, self, other, reflected=True)

    def __matmul__(self, other: TensorLike) -> Tensor:
        """self @ other: the matrix product, batched over leading axes (2 or more axes each)."""
        return _binary(ops.MatMul, self, other)

    def __rmatmul__(self, other: TensorLike) -> Tensor:
        """other @ self: the matrix product, batched over leading axes (2 or more axes each)."""
        return _binary(ops.MatMul, self, other, reflected=True)

    def __neg__(self) -> Tensor:
        """-self, elementwise."""
        return ops.Neg.apply(self)

    def relu(self) -> Tensor:
        """max(x, 0), elementwise."""
        return ops.ReLU.apply(self)

    def tanh(self) -> Tensor:
        """tanh(x), elementwise."""
        return ops.Tanh.apply(self)

    def exp(self) -> Tensor:
        """exp(x), elementwise."""
        return ops.Exp.apply(self)

    def log(self) -> Tensor:
        """The natural logarithm, elementwise."""
        return ops.Log.apply(self)

    def sum(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """Sum over axis (all axes by default), accumulated in float32."""
        return ops.Sum.apply(self, axis=axis, keepdims=keepdims)

    def mean(self, axis: int | tuple[int, ...] | None = None, keepdims: bool = False) -> Tensor:
        """Mean over axis (all axes by default), accumulated in float32."""
        return ops.Mean.apply(self, axis=axis, keepdims=keepdims)

    def __getitem__(self, key: ops.BasicIndex) -> Tensor:
        """Basic slicing (ints, slices, None, ...): a view forward, zeros + the slice backward."""
        return ops.Index.apply(self, key=key)

    def reshape(self, *shape: int | Sequence[int]) -> Tensor:
        """The same values with a new shape: reshape(2, 3) or reshape((2, 3))."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return ops.Reshape.apply(self, shape=shape)

    def transpose(self, *axes: int) -> Tensor:
        """Axes permuted as given, or reversed when none are given."""
        return ops.Transpose.apply(self, axes=axes or None)

    @property
    def T(self) -> Tensor:
        """The transpose (axes reversed)."""
        return ops.Transpose.apply(self, axes=None)

    def astype(self, dtype: npt.DTypeLike) -> Tensor:
        """A differentiable cast: the gradient comes back in this tensor's dtype."""
        return ops.Cast.apply(self, dtype=casting.dtype_named(dtype))

    # ----- backward ---------------------------------------------------------------------------
    def _initial_grad(self, grad: Tensor | Array | None, caller: str = "backward()") -> Array:
        """d(self)/d(self), where `caller` starts a backward walk (this tensor must require grad):
        ones for a scalar, else the caller's gradient, which must match this tensor's shape and
        dtype exactly (a mismatch would be summed or cast silently)."""
        if not self.requires_grad:
            raise RuntimeError(f"{caller} on a tensor that does not require grad: no graph to walk")
        if grad is None:
            if self.size != 1:
                raise RuntimeError(f"backward() without a gradient needs a scalar, this tensor "
                                   f"has shape {self.shape}; pass grad= an array of that shape")
            return backend.array_module(self.data).ones_like(self.data)
        grad = grad.data if isinstance(grad, Tensor) else grad
        if not (hasattr(grad, "shape") and hasattr(grad, "dtype")):  # 2.0, [1, 2], "x"
            raise TypeError(f"backward(grad): grad is a {type(grad).__name__}; pass an array (or a "
                            f"Tensor) of this tensor's shape {self.shape} and dtype {self.dtype}, "
                            "or nothing for a scalar loss")
        if tuple(grad.shape) != self.shape or grad.dtype != self.dtype:
            raise ValueError(
                f"backward(grad): grad has shape {tuple(grad.shape)} and dtype {grad.dtype}, "
                f"the tensor has shape {self.shape} and dtype {self.dtype}; they must match")
        return grad

    def register_hook(self, hook: Callable[[Array], Array | None]) -> RemovableHandle:
        """Call hook(grad) when this tensor's gradient is complete during backward; a non-None
        return value replaces the gradient (as torch.Tensor.register_hook). For a leaf this runs
        before the gradient is added into `.grad`."""
        hooks = vars(self).setdefault("_hooks", [])  # its own list, instead of the class's ()
        hooks.append(hook)
        return RemovableHandle(hooks, hook)

    def register_post_accumulate_grad_hook(self, hook: Callable[[Tensor], None]) -> RemovableHandle:
        """Call hook(self) after backward has added this leaf's gradient into `.grad` (PyTorch's
        name). ZeRO reduce-scatters a layer's gradients from here as soon as they are complete."""
        hooks = vars(self).setdefault("_post_accumulate_hooks", [])  # its own list, as above
        hooks.append(hook)
        return RemovableHandle(hooks, hook)

    def backward(self, grad: Tensor | Array | None = None) -> None:
        """Accumulate d(self)/d(leaf) into `.grad` of every leaf that requires grad.

        Reverse-mode autodiff: order the graph so each tensor comes after everything it depends on,
        then walk it backwards, handing each node the summed gradient of its output. Intermediate
        gradients live only in a local dict; saved arrays are released as each node finishes.
        """
        walk_backward(self, self._initial_grad(grad))


# What Tensor(data) takes, or a Tensor itself: an operator's other operand, an op's data input.
TensorLike = Tensor | npt.ArrayLike


def as_tensor(data: TensorLike) -> Tensor:
    """data itself when it is a Tensor, else Tensor(data) (torch.as_tensor: an array is
    not copied)."""
    return data if isinstance(data, Tensor) else Tensor(data)


def walk_backward(root: Tensor, grad: Array,
                  weights: Sequence[Tensor] = ()) -> list[tuple[Node, Array]]:
    """Tensor.backward's walk. With `weights` (leaves), an op that reads one of them computes only
    its other inputs' gradients now (its ctx.needs_input_grad says so) and keeps what forward saved;
    it is returned, with the gradient of its output, as (node, grad_output), for the weights'
    gradients later (minimp/split_backward.py). Without, the list is empty."""
    weight_ids = {id(weight) for weight in weights}
    deferred = []
    grads = {id(root): grad}
    for tensor in reversed(topological_order(root)):
        grad_output = grads.pop(id(tensor), None)
        if grad_output is None:
            continue
        if tensor.node is None:
            accumulate_leaf(tensor, grad_output)
            continue
        grad_output = _run_hooks(tensor._hooks, grad_output)
        node = tensor.node
        if node.context.saved_arrays is None:
            raise RuntimeError("backward() through a graph already freed by an earlier backward()")
        node.context.unpack_saved()
        if weight_ids and any(id(parent) in weight_ids for parent in node.inputs):
            input_grads = node_backward(node, grad_output, lambda t: id(t) not in weight_ids)
            deferred.append((node, grad_output))
        else:
            input_grads = node_backward(node, grad_output)
            node.context.saved_arrays = None  # release what forward kept, as soon as it is used
        for parent, parent_grad in zip(node.inputs, input_grads):
            if parent_grad is None or not parent.requires_grad:
                continue
            previous = grads.get(id(parent))
            grads[id(parent)] = (parent_grad if previous is None
                                 else add_gradients(previous, parent_grad))
    return deferred


def accumulate_leaf(tensor: Tensor, grad: Array) -> None:
    """A leaf's gradient is complete: its hooks, then into `.grad`, then its
    post-accumulate hooks."""
    grad = _run_hooks(tensor._hooks, grad)
    tensor.grad = grad if tensor.grad is None else add_gradients(tensor.grad, grad)
    for hook in tuple(tensor._post_accumulate_hooks):
        hook(tensor)


def _run_hooks(hooks: Sequence[Callable[[Array], Array | None]], grad: Array) -> Array:
    for hook in tuple(hooks):  # a hook may remove itself
        replaced = hook(grad)
        grad = grad if replaced is None else replaced
    return grad


def topological_order(root: Tensor) -> list[Tensor]:
    """Every tensor that requires grad and is reachable from root, each after all of its inputs
    (iterative depth-first search: no recursion limit on deep graphs).

    An op's first input (its activation: x in x @ W^T + b) is explored first, so everything it
    leads back to comes before the op's weights here, and backward, walking this list reversed,
    reaches each weight right after the ops that use it: a layer's gradients are complete as soon
    as its backward is done (ZeRO reduce-scatters and frees layer by layer from that moment)."""
    order, visited, stack = [], set(), [(root, False)]
    while stack:
        tensor, inputs_done = stack.pop()
        if inputs_done:
            order.append(tensor)
            continue
        if id(tensor) in visited:
            continue
        visited.add(id(tensor))
        stack.append((tensor, True))
        if tensor.node is not None:  # pushed last, popped (and explored) first
            parents = [parent for parent in tensor.node.inputs if parent.requires_grad]
            stack.extend((parent, False) for parent in reversed(parents))
    return order


def saved_bytes(root: Tensor, exclude: Iterable[Array] = ()) -> int:
    """Bytes of the arrays the graph behind root keeps for backward, each array counted once.

    `exclude` lists arrays not to count (say, the parameters, which exist whether or not we train),
    views of their memory included (a head that multiplies by `weight.T` saves such a view).
    Arrays packed by saved_tensors_hooks are not arrays while packed, so they are not counted.
    """
    excluded = {id(memory_owner(array)) for array in exclude}
    seen, total = set(), 0
    for tensor in topological_order(root):
        if tensor.node is None or tensor.node.context.saved_arrays is None:
            continue
        for array in tensor.node.context.saved_arrays:
            if not hasattr(array, "nbytes") or id(array) in seen:
                continue
            seen.add(id(array))
            if id(memory_owner(array)) not in excluded:
                total += array.nbytes
    return total


def memory_owner(array: Array) -> Array:
    """The array that owns the memory `array` looks at (itself unless it is a view)."""
    while getattr(array, "base", None) is not None:
        array = array.base
    return array


# Imported last: the ops build on Function, which makes Tensors (minimp/function.py says why).
from minimp import ops  # noqa: E402
