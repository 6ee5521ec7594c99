"""Column- and row-parallel Linear layers (Megatron-LM's split of a matrix product), and the slicing
that cuts a whole weight into a rank's shard and joins the shards again.

A Linear computes y = x W^T + b with W of shape (out, in). Cut W by rows (output features) and
each rank computes its own columns of y from the whole x: ColumnParallelLinear, whose output stays
split. Cut W by columns (input features) and each rank multiplies its slice of x by its slice of
W, giving a partial sum of the whole y: RowParallelLinear, whose outputs add up (g). Chained
column -> row (attention: the heads; the MLP: the 4h features) the split activation in between
never travels; only the row layer's output does, once forward and once backward (through f).

The bias of a column layer is cut with its rows; a row layer's bias is whole on every rank and
added once, after the sum. With sequence parallelism the column layer gathers its input along the
sequence instead of f, and the row layer reduce-scatters its output instead of g.

Weights are cut from the whole float32 model every rank builds from the seed, so the shards hold
exactly the one-process values. `sections`: a weight that stacks several matrices along the cut
axis (attention's (3h, h) q, k, v projection) is cut section by section, so each rank gets the
q, k and v rows of the same heads.
"""

from minimp import functional, nn
from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator
from minimp.parallel.tensor.mappings import (copy_to_tensor_parallel_region,
                                             gather_from_sequence_parallel_region,
                                             reduce_from_tensor_parallel_region,
                                             reduce_scatter_to_sequence_parallel_region)
from minimp.tensor import Tensor


def take_shard(array: Array, axis: int, sections: int, rank: int, ranks: int) -> Array:
    """Rank's shard: each of `sections` equal parts of `axis` cut into `ranks` equal slices, the
    rank-th slice of every part, in order (a contiguous copy)."""
    xp = array_module(array)
    parts = xp.split(array, sections, axis=axis)
    slices = [xp.split(part, ranks, axis=axis)[rank] for part in parts]
    return xp.ascontiguousarray(xp.concatenate(slices, axis=axis))


def join_shards(shards: list[Array], axis: int, sections: int) -> Array:
    """The whole array again from every rank's shard, in rank order (take_shard's inverse)."""
    xp = array_module(shards[0])
    cut = [xp.split(shard, sections, axis=axis) for shard in shards]  # [rank][section]
    parts = [xp.concatenate([cut[r][s] for r in range(len(shards))], axis) for s in range(sections)]
    return xp.concatenate(parts, axis=axis)


class _ParallelLinear(nn.Linear):
    """What the column and the row layer share: a whole Linear's weight cut along one axis."""

    def __init__(self, linear: nn.Linear, comm: Communicator, axis: int, sections: int,
                 sequence: bool) -> None:
        """The weight's shard that rank comm.rank of comm.size holds, cut along `axis` (0: by
        output features, 1: by input features) in `sections` sections; sequence: whether
        sequence parallelism runs around the layer."""
        nn.Module.__init__(self)  # not Linear's: the values come from `linear`, none are drawn
        self.comm, self.axis, self.fp8_meta = comm, axis, linear.fp8_meta
        self.sequence_parallel = sequence
        features = linear.weight.shape[axis]
        if features % (sections * comm.size):
            raise ValueError(f"{type(self).__name__}: {features} {('output', 'input')[axis]} "
                             f"features do not split into {sections} section(s) over {comm.size} "
                             "ranks")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = self._cut(linear.weight.data, sections)
        self.partition = {"weight": (axis, sections)}

    def _cut(self, array: Array, sections: int) -> nn.Parameter:
        """This rank's shard of a whole array, cut along the layer's axis."""
        return nn.Parameter(take_shard(array, self.axis, sections, self.comm.rank, self.comm.size))

    def __repr__(self) -> str:
        sizes = [str(self.in_features), str(self.out_features)]
        cut = 1 - self.axis  # the weight is (out, in): axis 0 cuts the output features
        sizes[cut] += f" of {(self.in_features, self.out_features)[cut] * self.comm.size}"
        return f"{type(self).__name__}({', '.join(sizes)}, bias={self.bias is not None})"


class ColumnParallelLinear(_ParallelLinear):
    """y_r = f(x) W_r^T + b_r: this rank's rows W_r of the weight, its slice of the output features.

    partition: {parameter: (axis, sections)} of the parameters cut across the ranks (both here).
    """

    def __init__(self, linear: nn.Linear, comm: Communicator, sections: int = 1,
                 sequence_parallel: bool = False):
        """The shard of a whole (float32) Linear `linear` that rank comm.rank of comm.size holds;
        sections: how many blocks the output features form (3 for the fused q, k, v), each cut
        on its own; sequence_parallel: x arrives cut by positions and is all-gathered first."""
        super().__init__(linear, comm, 0, sections, sequence_parallel)
        self.out_features //= comm.size
        self.bias = None if linear.bias is None else self._cut(linear.bias.data, sections)
        self.partition["bias"] = (0, sections)

    def forward(self, x: Tensor) -> Tensor:
        if self.sequence_parallel:  # (B, S/tp, in) -> (B, S, in): every position's input
            x = gather_from_sequence_parallel_region(x, self.comm)
        else:
            x = copy_to_tensor_parallel_region(x, self.comm)
        return functional.linear(x, self.weight, self.bias, self.fp8_meta)  # (..., out/tp)


class RowParallelLinear(_ParallelLinear):
    """y = g(x_r W_r^T) + b: this rank's columns W_r of the weight read its slice x_r of the input
    features; the partial products add up over the ranks, then the (whole) bias is added once."""

    def __init__(self, linear: nn.Linear, comm: Communicator, sequence_parallel: bool = False):
        """The shard of a whole (float32) Linear `linear` that rank comm.rank of comm.size holds;
        sequence_parallel: the sum is reduce-scattered by positions instead of all-reduced."""
        super().__init__(linear, comm, 1, 1, sequence_parallel)
        self.in_features //= comm.size
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.copy())

    def forward(self, x: Tensor) -> Tensor:
        # The partial product is rounded into the activation dtype before the sum, and the bias
        # is added after it (one rounding each; one process fuses both into one rounding).
        partial = functional.linear(x, self.weight, None, self.fp8_meta)  # (..., out), partial
        if self.sequence_parallel:  # (B, S, out) partial sums -> (B, S/tp, out) whole sums
            y = reduce_scatter_to_sequence_parallel_region(partial, self.comm)
        else:
            y = reduce_from_tensor_parallel_region(partial, self.comm)
        return y if self.bias is None else y + self.bias


def partitions(model: nn.Module) -> dict[str, tuple[int, int]]:
    """{parameter name: (axis, sections)} of every parameter of the model cut across the
    tensor-parallel ranks; the parameters not listed are whole (replicated) on every rank."""
    cut = {}
    for name, module in model.named_modules():
        for parameter, spec in getattr(module, "partition", {}).items():
            if getattr(module, parameter, None) is not None:
                cut[f"{name}.{parameter}" if name else parameter] = spec
    return cut
