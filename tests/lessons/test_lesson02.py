"""Lesson 2 (autograd): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/02_autograd.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp.lessons import lesson02 as lesson

f16 = np.float16


def f(values):
    """The lesson's f = sum(2 x^3 + x), in the operations and order of its Cube graph."""
    return float(np.sum((values * values * values) * 2.0 + values))


def central_difference_error(h):
    """|central difference - 6x^2 - 1|, the largest over the lesson's x, and f(x)."""
    x = np.array(lesson.X)
    numerical = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(3)])
    return float(np.abs(numerical - (6 * x**2 + 1)).max()), f(x)


def test_lesson2_at_h_1e_minus_6_the_error_1e_minus_8_is_rounding_not_truncation():
    error, value = central_difference_error(lesson.H)
    eps = np.finfo(np.float64).eps
    assert value == 78 and lesson.scientific(eps * value / lesson.H) == "1.7e-8"
    assert lesson.scientific(2 * lesson.H**2) == "2.0e-12"
    assert 100 * 2 * lesson.H**2 < error < eps * value / lesson.H  # far above 2h^2, below eps|f|/h
    assert lesson.scientific(error) == "1.0e-8"


def test_lesson2_the_cube_by_products_is_the_cube_by_pow_within_an_ulp():
    x = np.array(lesson.X) + np.array([1e-6, -1e-6, 1e-6])
    assert np.allclose(x * x * x, x**3, rtol=2 * np.finfo(np.float64).eps, atol=0)


def test_lesson2_truncation_is_exactly_2h_squared_and_the_best_h_is_1_6e_minus_5():
    for h in (1e-1, 1e-2, 1e-3):
        assert central_difference_error(h)[0] == pytest.approx(2 * h**2, rel=1e-3)
    errors = [central_difference_error(h)[0] for h in lesson.STEPS]
    assert 1e-6 <= lesson.STEPS[int(np.argmin(errors))] <= 1e-4
    assert lesson.scientific(lesson.STEPS[int(np.argmin(errors))]) == "1.0e-5"
    assert lesson.scientific(lesson.best_step(78, 12)) == "1.6e-5"


def test_lesson2_the_gradient_check_tolerance_it_quotes():
    import inspect

    import gradcheck
    import test_ops

    source = inspect.getsource(gradcheck)
    assert inspect.signature(gradcheck.numerical_gradient).parameters["epsilon"].default == 1e-6
    assert "rtol=1e-5, atol=1e-7" in source
    assert inspect.signature(test_ops.numerical_gradient).parameters["epsilon"].default == 1e-6
    assert "rtol=1e-5,\n            atol=1e-7" in inspect.getsource(test_ops)
    assert (lesson.RTOL, lesson.ATOL, lesson.STEP) == (1e-5, 1e-7, 1e-6)


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def wrong_functions():
    from minimp.function import Function

    class ExpForgettingTheFactor(Function):
        @staticmethod
        def forward(ctx, x):
            return np.exp(x)

        @staticmethod
        def backward(ctx, grad_output):
            return grad_output

    class PowWithoutUnbroadcast(Function):
        @staticmethod
        def forward(ctx, x, p):
            ctx.save_for_backward(x, p)
            return x**p

        @staticmethod
        def backward(ctx, grad_output):
            x, p = ctx.saved_arrays
            return grad_output * p * x ** (p - 1), grad_output * x**p * np.log(x)

    class PowWithoutTheLog(solutions(2).Pow):
        @staticmethod
        def backward(ctx, grad_output):
            x, p, y = ctx.saved_arrays
            grad_x, _ = solutions(2).Pow.backward(ctx, grad_output)
            return grad_x, grad_output * y

    return ExpForgettingTheFactor, PowWithoutUnbroadcast, PowWithoutTheLog


def order_without_a_visited_set(root):
    order = []

    def visit(tensor):
        for parent in tensor.node.inputs if tensor.node else ():
            if parent.requires_grad:
                visit(parent)
        order.append(tensor)

    visit(root)
    return order


def order_root_first(root):
    return list(reversed(solutions(2).topological_order(root)))


def backward_overwriting(root):
    grads = {id(root): np.ones_like(root.data)}
    for tensor in reversed(solutions(2).topological_order(root)):
        grad = grads.pop(id(tensor), None)
        if tensor.node is None:
            tensor.grad = grad
            continue
        input_grads = tensor.node.function.backward(tensor.node.context, grad)
        input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        for parent, parent_grad in zip(tensor.node.inputs, input_grads):
            if parent_grad is not None and parent.requires_grad:
                grads[id(parent)] = parent_grad  # a second use overwrites the first


def more_wrong_functions():
    from minimp.function import Function

    class ExpWithoutTheChainRule(Function):
        @staticmethod
        def forward(ctx, x):
            y = np.exp(x)
            ctx.save_for_backward(y)
            return y

        @staticmethod
        def backward(ctx, grad_output):
            (y,) = ctx.saved_arrays
            return y  # dy/dx alone: grad_output forgotten

    class ExpInFloat64(solutions(2).Exp):
        @staticmethod
        def forward(ctx, x):
            y = np.exp(x.astype(np.float64))
            ctx.save_for_backward(y)
            return y

    class PowUnbroadcastingOnlyP(solutions(2).Pow):
        @staticmethod
        def backward(ctx, grad_output):
            from minimp.function import unbroadcast

            x, p, y = ctx.saved_arrays
            grad_p = unbroadcast(grad_output * y * np.log(x), p.shape, p.dtype)
            return grad_output * p * x ** (p - 1), grad_p

    return ExpWithoutTheChainRule, ExpInFloat64, PowUnbroadcastingOnlyP


def order_with_tensors_that_need_no_grad(root):
    order, visited = [], set()

    def visit(tensor):
        if id(tensor) in visited:
            return
        visited.add(id(tensor))
        for parent in tensor.node.inputs if tensor.node else ():
            visit(parent)  # constants and data too
        order.append(tensor)

    visit(root)
    return order


def backward_in_forward_order(root):
    grads = {id(root): np.ones_like(root.data)}
    for tensor in solutions(2).topological_order(root):  # not reversed
        grad = grads.pop(id(tensor), None)
        if grad is None:
            continue
        if tensor.node is None:
            tensor.grad = grad if tensor.grad is None else tensor.grad + grad
            continue
        input_grads = tensor.node.function.backward(tensor.node.context, grad)
        input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        for parent, parent_grad in zip(tensor.node.inputs, input_grads):
            if parent_grad is not None and parent.requires_grad:
                grads[id(parent)] = grads.get(id(parent), 0) + parent_grad


def backward_overwriting_the_leaves_grad(root):
    grads = {id(root): np.ones_like(root.data)}
    for tensor in reversed(solutions(2).topological_order(root)):
        grad = grads.pop(id(tensor), None)
        if grad is None:
            continue
        if tensor.node is None:
            tensor.grad = grad  # what .grad held is lost
            continue
        input_grads = tensor.node.function.backward(tensor.node.context, grad)
        input_grads = input_grads if isinstance(input_grads, tuple) else (input_grads,)
        for parent, parent_grad in zip(tensor.node.inputs, input_grads):
            if parent_grad is not None and parent.requires_grad:
                grads[id(parent)] = grads.get(id(parent), 0) + parent_grad


def order_by_the_library(root):
    import minimp.tensor

    return minimp.tensor.topological_order(root)  # minimp's own, not the learner's


def backward_by_the_library(root):
    root.backward()  # what the exercise asks you to write


WRONG = {
    "check_exp": [
        Wrong(lambda: wrong_functions()[0], "exp(x)", factory=True),
        Wrong(lambda: more_wrong_functions()[0], "grad_output", factory=True),
        Wrong(lambda: more_wrong_functions()[1], "float32", factory=True),
    ],
    "check_pow": [
        Wrong(lambda: wrong_functions()[1], "unbroadcast", factory=True),
        Wrong(lambda: wrong_functions()[2], "ln", factory=True),
        Wrong(lambda: more_wrong_functions()[2], "x's too", factory=True),
    ],
    "check_topological_order": [
        Wrong(order_without_a_visited_set, "once"),
        Wrong(order_root_first, "root"),
        Wrong(order_with_tensors_that_need_no_grad, "require grad"),
        Wrong(order_by_the_library, "library"),
    ],
    "check_backward": [
        Wrong(backward_overwriting, "add"),
        Wrong(backward_in_forward_order, "reversed"),
        Wrong(backward_overwriting_the_leaves_grad, "adds to it"),
        Wrong(backward_by_the_library, "Tensor.backward"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(2, WRONG)
