"""Tensor parallelism's conjugate operators, each a Function on minimp's own ring: f, g and the
sequence-parallel three (Shoeybi et al. 2019, "Megatron-LM", section 3; Korthikanti et al. 2022,
"Reducing Activation Recomputation in Large Transformer Models", section 4.2.2).

A column-parallel Linear needs its whole input on every rank and leaves each rank a slice of the
output features; a row-parallel Linear takes such a slice and leaves each rank a partial sum of the
whole output. Two operators make the pair exact, one the other's transpose:

    f  forward: identity         backward: all-reduce     (in front of the column-parallel Linear:
                                                           each rank's dL/dx is a partial sum)
    g  forward: all-reduce       backward: identity       (behind the row-parallel Linear: the
                                                           partial outputs add up; dL/dy is whole)

With sequence parallelism the regions between g and the next f (residual adds, LayerNorm, dropout)
run on a slice of the sequence instead of repeating the same work on every rank. An all-reduce is a
reduce-scatter followed by an all-gather (distributed/ring.py), so g becomes a reduce-scatter along
the sequence and f an all-gather: the same bytes, and no activation is repeated on every rank.

    gather_from_sequence_parallel_region       forward: all-gather   backward: reduce-scatter
                                               (or, before work every rank repeats: split)
    reduce_scatter_to_sequence_parallel_region forward: reduce-scatter  backward: all-gather
    scatter_to_sequence_parallel_region        forward: split        backward: all-gather

Activations are (batch, sequence, ...); axis 1 is split. The collectives call the ring's halves
without the per-call agreement on the array's length (one more small all-reduce each time, as
ZeRO's reduce-scatters also skip): every rank's shapes come from the same model and batch.
"""

from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import chunk_bounds, ring_all_gather_inplace, ring_reduce_scatter_into
from minimp.function import Context, Function
from minimp.tensor import Tensor


def all_reduce(comm: Communicator, x: Array) -> Array:
    """The sum of x over comm's ranks, a new array shaped like x (2 (p - 1)/p of x sent)."""
    xp = array_module(x)
    flat = xp.ascontiguousarray(x).reshape(-1)
    if comm.size == 1:
        return flat.copy().reshape(x.shape)
    out = xp.empty_like(flat)
    bounds = chunk_bounds(flat.size, comm.size)
    ring_reduce_scatter_into(comm, flat, out, bounds)
    ring_all_gather_inplace(comm, out, bounds)
    return out.reshape(x.shape)


def all_gather_sequence(comm: Communicator, x: Array) -> Array:
    """(B, S/p, ...) slices -> (B, S, ...), rank r's slice at positions r S/p .. (r + 1) S/p."""
    xp = array_module(x)
    local = xp.ascontiguousarray(xp.moveaxis(x, 1, 0))  # (S/p, B, ...): the slice is contiguous
    whole = xp.empty((local.shape[0] * comm.size, *local.shape[1:]), x.dtype)  # (S, B, ...)
    flat = whole.reshape(-1)
    bounds = chunk_bounds(flat.size, comm.size)
    start, stop = bounds[comm.rank]
    flat[start:stop] = local.reshape(-1)
    ring_all_gather_inplace(comm, flat, bounds)
    return xp.ascontiguousarray(xp.moveaxis(whole, 0, 1))  # (B, S, ...)


def reduce_scatter_sequence(comm: Communicator, x: Array) -> Array:
    """(B, S, ...) partial sums -> this rank's (B, S/p, ...) slice of their sum over the ranks."""
    xp = array_module(x)
    sequence = x.shape[1]
    _check_divides(sequence, comm.size)
    if comm.size == 1:
        return x.copy()
    flat = xp.ascontiguousarray(xp.moveaxis(x, 1, 0)).reshape(-1)  # (S, B, ...) flat
    out = xp.empty_like(flat)
    bounds = chunk_bounds(flat.size, comm.size)
    ring_reduce_scatter_into(comm, flat, out, bounds)
    start, stop = bounds[comm.rank]
    local = out[start:stop].reshape(sequence // comm.size, x.shape[0], *x.shape[2:])
    return xp.ascontiguousarray(xp.moveaxis(local, 0, 1))


def split_sequence(comm: Communicator, x: Array) -> Array:
    """This rank's (B, S/p, ...) slice of x (B, S, ...), a contiguous copy; nothing is sent."""
    _check_divides(x.shape[1], comm.size)
    size = x.shape[1] // comm.size
    start = comm.rank * size
    return array_module(x).ascontiguousarray(x[:, start : start + size])


def _check_divides(sequence: int, ranks: int) -> None:
    if sequence % ranks:
        raise ValueError(f"sequence parallelism splits a sequence of {sequence} over {ranks} "
                         "ranks: the sequence length must be a multiple of the tensor-parallel "
                         "size")


class CopyToTensorParallelRegion(Function):
    """f:  y = x;  dL/dx = sum over the tensor-parallel ranks of dL/dy (all-reduce)."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator) -> Array:
        ctx.comm = comm
        return x

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return all_reduce(ctx.comm, grad_output)


class ReduceFromTensorParallelRegion(Function):
    """g:  y = sum over the tensor-parallel ranks of x (all-reduce);  dL/dx = dL/dy."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator) -> Array:
        return all_reduce(comm, x)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return grad_output


class GatherFromSequenceParallelRegion(Function):
    """y = the ranks' sequence slices side by side (all-gather);
    dL/dx = this rank's slice of the sum of dL/dy over the ranks (reduce-scatter), or, when every
    rank computes the same dL/dy (`tensor_parallel_output_grad=False`), just its slice."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator,
                tensor_parallel_output_grad: bool = True) -> Array:
        ctx.comm, ctx.reduce = comm, tensor_parallel_output_grad
        return all_gather_sequence(comm, x)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        if ctx.reduce:
            return reduce_scatter_sequence(ctx.comm, grad_output)
        return split_sequence(ctx.comm, grad_output)


class ReduceScatterToSequenceParallelRegion(Function):
    """y = this rank's sequence slice of the sum of x over the ranks (reduce-scatter);
    dL/dx = the ranks' slices of dL/dy side by side (all-gather)."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator) -> Array:
        ctx.comm = comm
        return reduce_scatter_sequence(comm, x)

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> Array:
        return all_gather_sequence(ctx.comm, grad_output)


class ScatterToSequenceParallelRegion(ReduceScatterToSequenceParallelRegion):
    """y = this rank's sequence slice of x (every rank holds the same x, so nothing is summed);
    dL/dx = the ranks' slices of dL/dy side by side (all-gather): the reduce-scatter's backward."""

    @staticmethod
    def forward(ctx: Context, x: Array, comm: Communicator) -> Array:
        ctx.comm = comm
        return split_sequence(comm, x)


def copy_to_tensor_parallel_region(x: Tensor, comm: Communicator) -> Tensor:
    """f: identity forward, all-reduce backward (Megatron-LM's
    copy_to_tensor_model_parallel_region)."""
    return CopyToTensorParallelRegion.apply(x, comm=comm)


def reduce_from_tensor_parallel_region(x: Tensor, comm: Communicator) -> Tensor:
    """g: all-reduce forward, identity backward."""
    return ReduceFromTensorParallelRegion.apply(x, comm=comm)


def gather_from_sequence_parallel_region(x: Tensor, comm: Communicator,
                                         tensor_parallel_output_grad: bool = True) -> Tensor:
    """All-gather along the sequence forward; reduce-scatter (or split) backward."""
    return GatherFromSequenceParallelRegion.apply(
        x, comm=comm, tensor_parallel_output_grad=tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x: Tensor, comm: Communicator) -> Tensor:
    """Reduce-scatter along the sequence forward; all-gather backward."""
    return ReduceScatterToSequenceParallelRegion.apply(x, comm=comm)


def scatter_to_sequence_parallel_region(x: Tensor, comm: Communicator) -> Tensor:
    """Split along the sequence forward; all-gather backward."""
    return ScatterToSequenceParallelRegion.apply(x, comm=comm)
