"""Reference solutions to lesson 2's exercises (autograd). Try them yourself first."""

import numpy as np

from minimp.function import Function, unbroadcast


class Exp(Function):
    """y = exp(x);  dL/dx = dL/dy * exp(x) = dL/dy * y."""

    @staticmethod
    def forward(ctx, x):
        y = np.exp(x)
        ctx.save_for_backward(y)  # the derivative is the output itself
        return y

    @staticmethod
    def backward(ctx, grad_output):
        (y,) = ctx.saved_arrays
        return grad_output * y


class Pow(Function):
    """y = x ** p;  dL/dx = dL/dy * p x^(p-1),  dL/dp = dL/dy * x^p ln x  (x > 0)."""

    @staticmethod
    def forward(ctx, x, p):
        y = x**p
        ctx.save_for_backward(x, p, y)
        return y

    @staticmethod
    def backward(ctx, grad_output):
        x, p, y = ctx.saved_arrays
        grad_x = grad_output * p * x ** (p - 1)
        grad_p = grad_output * y * np.log(x)
        # Broadcasting stretched x or p to the output's shape: sum the gradient back down.
        return unbroadcast(grad_x, x.shape, x.dtype), unbroadcast(grad_p, p.shape, p.dtype)


def topological_order(root):
    """Depth first: a tensor is appended after all of its inputs. (Recursive, so very deep
    graphs need minimp's iterative version.)"""
    order, visited = [], set()

    def visit(tensor):
        if id(tensor) in visited:
            return
        visited.add(id(tensor))
        if tensor.node is not None:
            for parent in tensor.node.inputs:
                if parent.requires_grad:
                    visit(parent)
        order.append(tensor)

    visit(root)
    return order


def backward(root):
    """Reverse-mode: walk the order backwards, each node receiving the summed gradient of its
    output, and hand each input its share."""
    grads = {id(root): np.ones_like(root.data)}
    for tensor in reversed(topological_order(root)):
        grad = grads.pop(id(tensor), None)
        if grad is None:
            continue
        if tensor.node is None:  # a leaf: keep its gradient
            tensor.grad = grad if tensor.grad is None else tensor.grad + grad
            continue
        input_grads = tensor.node.function.backward(tensor.node.context, grad)
        if not isinstance(input_grads, tuple):
            input_grads = (input_grads,)
        for parent, parent_grad in zip(tensor.node.inputs, input_grads):
            if parent_grad is not None and parent.requires_grad:
                grads[id(parent)] = grads.get(id(parent), 0) + parent_grad
