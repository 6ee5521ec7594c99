"""Lesson 2 (autograd): the configuration its cells use and its claims tests check, and the
checkers of its exercises (two Functions against central differences, the topological order,
and backward itself). Reference solutions: lessons/solutions/lesson02.py."""

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np

import minimp.tensor
from minimp import Tensor
from minimp.lessons.checking import Failed, Report, call, expect

# ----- what the lesson's cells use (tests/lessons/test_lesson02.py checks the same) ----------
X = (1.0, 2.0, 3.0)  # where the lesson checks d/dx of f(x) = sum(2 x^3 + x)
H = 1e-6  # its central-difference step, as in tests/test_ops.py and tests/gradcheck.py
STEPS = np.logspace(-12, -1, 23)  # the steps of its error-against-h plot, half a decade apart


def best_step(f_value: float, third_derivative: float) -> float:
    """The h that minimises truncation h^2 |f3| / 6 plus rounding eps |f| / h in float64 (f3 the
    third derivative): d/dh = h |f3| / 3 - eps |f| / h^2 = 0 at h = (3 eps |f| / |f3|)^(1/3)."""
    eps = float(np.finfo(np.float64).eps)
    return (3 * eps * abs(f_value) / abs(third_derivative)) ** (1 / 3)


def scientific(value: float) -> str:
    """2 significant digits, the way the lesson's prose writes them: 1.7e-8, not 1.7e-08."""
    mantissa, exponent = f"{value:.1e}".split("e")
    return f"{mantissa}e{int(exponent)}"


STEP = H  # central-difference step in float64: rounding error ~eps / STEP = 2e-10 relative to f
RTOL, ATOL = 1e-5, 1e-7  # the tolerance of tests/test_ops.py and tests/gradcheck.py


def numerical_gradient(scalar: Callable[[list], float], arrays: list, index: int) -> np.ndarray:
    """d scalar(arrays) / d arrays[index], every entry, by central differences in float64."""
    grad = np.zeros_like(arrays[index])
    for position in np.ndindex(arrays[index].shape):
        values = []
        for sign in (1, -1):
            shifted = [a.copy() for a in arrays]
            shifted[index][position] += sign * STEP
            values.append(scalar(shifted))
        grad[position] = (values[0] - values[1]) / (2 * STEP)
    return grad


def gradient_check(function: Any, arrays: list, name: str) -> None:
    """Backward of sum(function.apply(*tensors) * weights) against central differences."""
    weights = np.random.default_rng(3).standard_normal(
        function.apply(*[Tensor(a) for a in arrays]).shape
    )

    def scalar(values):
        return float((function.apply(*[Tensor(v) for v in values]).data * weights).sum())

    tensors = [Tensor(a, requires_grad=True) for a in arrays]
    function.apply(*tensors).backward(weights)
    for index, tensor in enumerate(tensors):
        expect(tensor.grad is not None, f"{name}: no gradient reached input {index}")
        expected = numerical_gradient(scalar, arrays, index)
        worst = float(np.max(np.abs(tensor.grad - expected) - RTOL * np.abs(expected)))
        expect(worst <= ATOL, f"{name}: input {index}'s gradient differs from central "
               f"differences by up to {np.max(np.abs(tensor.grad - expected)):.3g}")


def check_exp(Exp: Any, quiet: bool = False) -> Report:
    """Exp: a Function with y = exp(x), of x's dtype, and dL/dx = dL/dy * exp(x)."""
    report = Report("Exp", quiet)
    x = np.random.default_rng(0).uniform(-3, 3, (3, 4))

    @report.case("forward computes exp(x)", hint="forward(ctx, x) returns np.exp(x)")
    def _():
        y = Exp.apply(Tensor(x))
        expect(np.allclose(y.data, np.exp(x), rtol=1e-12), f"got {y.data.ravel()[:3]}...")

    @report.case("float32 in, float32 out", hint="np.exp keeps the dtype; do not cast")
    def _():
        y = Exp.apply(Tensor(x.astype(np.float32)))
        expect(y.dtype == np.float32, f"a float32 input gave {y.dtype}")

    @report.case(
        "backward matches central differences",
        hint="the chain rule: return grad_output (dL/dy) times dy/dx = exp(x); save y = exp(x) "
        "in forward (ctx.save_for_backward(y)): it is its own derivative",
    )
    def _():
        gradient_check(Exp, [x], "Exp")

    return report.finish()


def check_pow(Pow: Any, quiet: bool = False) -> Report:
    """Pow: a Function of two inputs, y = x ** p, with broadcasting between them."""
    report = Report("Pow", quiet)
    rng = np.random.default_rng(1)
    x, p = rng.uniform(0.5, 2.0, (3, 4)), rng.uniform(-2.0, 2.0, (3, 4))

    @report.case("forward computes x ** p", hint="forward(ctx, x, p) returns x ** p")
    def _():
        y = Pow.apply(Tensor(x), Tensor(p))
        expect(np.allclose(y.data, x**p, rtol=1e-12), f"got {y.data.ravel()[:3]}...")

    @report.case(
        "backward for both inputs matches central differences (same shapes)",
        hint="dy/dx = p x^(p-1); dy/dp = x^p ln(x); return one gradient per input, as a tuple",
    )
    def _():
        gradient_check(Pow, [x, p], "Pow")

    @report.case(
        "broadcasting: x of shape (3, 4) with p of shape (4,), (1, 4) and ()",
        hint="a broadcast input's gradient must be summed back to its shape: "
        "minimp.function.unbroadcast(grad, shape, dtype)",
    )
    def _():
        for shape in ((4,), (1, 4), ()):
            gradient_check(Pow, [x, rng.uniform(-2.0, 2.0, shape)], f"Pow with p of shape {shape}")

    @report.case(
        "broadcasting the other way: x of shape (4,) with p of shape (3, 4)",
        hint="unbroadcast each input's gradient to that input's own shape, x's too",
    )
    def _():
        gradient_check(Pow, [rng.uniform(0.5, 2.0, 4), p], "Pow with x of shape (4,)")

    return report.finish()


def _graphs() -> list[tuple[str, Callable[[], tuple[Tensor, list[Tensor]]]]]:
    """(name, builder) of small graphs; each builder returns (root, leaves) made afresh."""

    def diamond():
        x = Tensor(np.array([1.0, 2.0, 3.0]), requires_grad=True)
        a = x * 2.0
        b = a.exp() + a * a  # `a` feeds two ops, `x` reaches the root by two paths
        return (b * x).sum(), [x]

    def layers():
        rng = np.random.default_rng(2)
        x = Tensor(rng.standard_normal((4, 3)))  # data: no gradient wanted
        w1 = Tensor(rng.standard_normal((3, 5)), requires_grad=True)
        w2 = Tensor(rng.standard_normal((5, 2)), requires_grad=True)
        b = Tensor(rng.standard_normal(5), requires_grad=True)
        h = (x @ w1 + b).relu()
        return ((h @ w2).tanh() * (h @ w2)).mean(), [w1, w2, b]

    def chain():
        x = Tensor(np.array([0.5]), requires_grad=True)
        y = x
        for _ in range(200):
            y = y * 1.01 + x
        return y.sum(), [x]

    return [("a diamond", diamond), ("a two-layer network", layers), ("a chain of 400 ops", chain)]


def _refused(*args: Any, **kwargs: Any) -> None:
    # runs as the code of a library function, in that function's module: builtins only
    raise RuntimeError("that is minimp's own answer (the library shortcut): write it yourself")


def _refused_backward(self: Any, *args: Any, **kwargs: Any) -> None:
    raise Failed("called Tensor.backward (root.backward()), minimp's own answer: walk the "
                 "graph yourself")


@contextmanager
def _without(*functions: Callable, tensor_backward: bool = False) -> Iterator[None]:
    """While a learner's code runs, the given library functions (under any name they were
    imported as: their code is swapped) and, with tensor_backward, Tensor.backward refuse."""
    codes = [function.__code__ for function in functions]
    saved_backward = Tensor.backward
    try:
        for function in functions:
            function.__code__ = _refused.__code__
        if tensor_backward:
            Tensor.backward = _refused_backward  # type: ignore[method-assign]
        yield
    finally:
        for function, code in zip(functions, codes):
            function.__code__ = code
        Tensor.backward = saved_backward  # type: ignore[method-assign]


def check_topological_order(topological_order: Callable[[Tensor], list],
                            quiet: bool = False) -> Report:
    """topological_order(root): every tensor that requires grad and is reachable from root,
    each after all of its inputs, each once."""
    report = Report("topological_order", quiet)
    from minimp.tensor import topological_order as reference

    for name, build in _graphs():

        @report.case(
            f"{name}: each tensor once, after its inputs, the root last",
            hint="depth first: visit a tensor's inputs (tensor.node.inputs, those with "
            "requires_grad), then append the tensor; keep a set of ids already visited",
        )
        def _():
            root, _ = build()
            with _without(minimp.tensor.topological_order):
                order = list(call(topological_order, root))
            ids = [id(t) for t in order]
            expect(len(set(ids)) == len(ids), "a tensor appears more than once")
            expect(set(ids) == {id(t) for t in reference(root)},
                   f"{len(order)} tensors listed, {len(reference(root))} require grad and are "
                   "reachable from the root")
            position = {i: n for n, i in enumerate(ids)}
            for tensor in order:
                for parent in tensor.node.inputs if tensor.node else ():
                    if parent.requires_grad and position[id(parent)] > position[id(tensor)]:
                        raise Failed(f"a {tensor.node.function.__name__} output comes before "
                                     f"its input")
            expect(order[-1] is root, "the root is not last")

    return report.finish()


def check_backward(backward: Callable[[Tensor], None], quiet: bool = False) -> Report:
    """backward(root): add d(root)/d(leaf) into `.grad` of every leaf that requires grad, as
    root.backward() does (root a scalar)."""
    report = Report("backward", quiet)
    for name, build in _graphs():

        @report.case(
            f"{name}: the leaves' gradients equal minimp's",
            hint="walk reversed(topological_order(root)); keep a dict id(tensor) -> summed "
            "gradient; call node.function.backward(node.context, grad) and add each result to "
            "its input's entry (a tuple for several inputs, None for inputs to skip)",
        )
        def _():
            root, leaves = build()
            with _without(minimp.tensor.walk_backward, tensor_backward=True):
                backward(root)
            reference_root, reference_leaves = build()
            reference_root.backward()
            for number, (leaf, want) in enumerate(zip(leaves, reference_leaves)):
                expect(leaf.grad is not None, f"leaf {number} has no .grad")
                expect(np.allclose(leaf.grad, want.grad, rtol=1e-12, atol=1e-12),
                       f"leaf {number}'s gradient differs from minimp's by up to "
                       f"{np.max(np.abs(leaf.grad - want.grad)):.3g}")

    @report.case(
        "a leaf whose .grad holds a gradient already: backward adds to it",
        hint="as root.backward() does: leaf.grad = grad where leaf.grad is None, else "
        "leaf.grad + grad (two backward passes add up, as micro-batches do)",
    )
    def _():
        root, (leaf,) = _graphs()[0][1]()
        leaf.grad = np.ones_like(leaf.data)
        with _without(minimp.tensor.walk_backward, tensor_backward=True):
            backward(root)
        reference_root, (reference_leaf,) = _graphs()[0][1]()
        reference_leaf.grad = np.ones_like(reference_leaf.data)
        reference_root.backward()
        expect(leaf.grad is not None and np.allclose(leaf.grad, reference_leaf.grad, rtol=1e-12),
               f".grad became {leaf.grad}, expected {reference_leaf.grad} (the gradient plus the "
               "ones it held)")

    return report.finish()


EXERCISES = [
    ("Exp", check_exp),
    ("Pow", check_pow),
    ("topological_order", check_topological_order),
    ("backward", check_backward),
]
