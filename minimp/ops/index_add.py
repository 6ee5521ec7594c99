"""Rows added into a zero array at integer indices (PyTorch's index_add): how a mixture of experts
adds each expert's outputs back to the tokens they came from; its backward is a row gather."""

from minimp.backend import Array
from minimp.function import Context, Function
from minimp.ops.embedding import _scatter_add_rows
from minimp.precision.casting import round_to, widen


class IndexAdd(Function):
    """y = zeros (num_rows, C), y[indices[i]] += rows[i];  dL/drows[i] = dL/dy[indices[i]].

    The forward sums in float32 (float64 stays float64) and rounds once: a token picked by two
    experts gets the sum of both rows. The backward moves numbers only: a gather, no rounding.
    """

    @staticmethod
    def forward(ctx: Context, rows: Array, indices: Array, num_rows: int) -> Array:
        ctx.save_for_backward(indices)
        return round_to(_scatter_add_rows(indices, widen(rows), num_rows), rows.dtype)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        (indices,) = ctx.saved_arrays
        return grad_output[indices]  # (N_rows, C), the rows' dtype
