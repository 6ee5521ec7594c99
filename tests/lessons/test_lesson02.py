"""Lesson 2 (autograd): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/02_autograd.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

f16 = np.float16


def central_difference_error(h):
    """Lesson 2's f = sum(2x^3 + x) at x = (1, 2, 3): |central difference - 6x^2 - 1|, max."""
    x = np.array([1.0, 2.0, 3.0])

    def f(values):
        return float(np.sum(2 * values**3 + values))

    numerical = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(3)])
    return float(np.abs(numerical - (6 * x**2 + 1)).max()), f(x)


def test_lesson2_at_h_1e_minus_6_the_error_is_rounding_not_truncation():
    error, value = central_difference_error(1e-6)
    eps = np.finfo(np.float64).eps
    assert value == 78
    assert 100 * 2 * 1e-6**2 < error < eps * value / 1e-6  # far above 2h^2, below eps |f| / h


def test_lesson2_truncation_is_exactly_2h_squared_and_the_best_h_is_near_1_6e_minus_5():
    for h in (1e-1, 1e-2, 1e-3):
        assert central_difference_error(h)[0] == pytest.approx(2 * h**2, rel=1e-3)
    steps = np.logspace(-12, -1, 23)
    errors = [central_difference_error(h)[0] for h in steps]
    assert 1e-6 <= steps[int(np.argmin(errors))] <= 1e-4
    assert (3 * np.finfo(np.float64).eps * 78 / 12) ** (1 / 3) == pytest.approx(1.6e-5, rel=0.05)


def test_lesson2_the_gradient_check_tolerance_it_quotes():
    import inspect

    import gradcheck

    source = inspect.getsource(gradcheck)
    assert inspect.signature(gradcheck.numerical_gradient).parameters["epsilon"].default == 1e-6
    assert "rtol=1e-5, atol=1e-7" in source


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


WRONG = {
    "check_exp": [
        Wrong(lambda: wrong_functions()[0], "", factory=True),
    ],
    "check_pow": [
        Wrong(lambda: wrong_functions()[1], "", factory=True),
        Wrong(lambda: wrong_functions()[2], "", factory=True),
    ],
    "check_topological_order": [
        Wrong(order_without_a_visited_set, ""),
        Wrong(order_root_first, ""),
    ],
    "check_backward": [
        Wrong(backward_overwriting, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(2, WRONG)
