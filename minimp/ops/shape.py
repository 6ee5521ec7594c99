"""Shape ops: reshape and transpose move no numbers, so they need no widening and no rounding."""

from minimp.backend import array_module
from minimp.function import Function


class Reshape(Function):
    """y = x viewed with a new shape;  dL/dx = dL/dy viewed with x's shape."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.input_shape = x.shape
        return x.reshape(shape)

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output.reshape(ctx.input_shape)


class Transpose(Function):
    """y = x with axes permuted (reversed when axes is None);
    dL/dx = dL/dy with the inverse permutation."""

    @staticmethod
    def forward(ctx, x, axes=None):
        ctx.axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(axes)
        return array_module(x).transpose(x, ctx.axes)

    @staticmethod
    def backward(ctx, grad_output):
        inverse = [0] * len(ctx.axes)
        for position, axis in enumerate(ctx.axes):
            inverse[axis] = position
        return array_module(grad_output).transpose(grad_output, inverse)
