"""What a column- or row-parallel Linear takes from the whole Linear when it is built: a missing
bias stays missing, an fp8 state is kept (the shards then multiply in fp8), features that do not
split are refused with the layer's own message, a device weight stays on the device (the cupy
stand-in), and partitions() names the cut parameters of a layer, of a model, and of a module that
lists a parameter it does not hold."""

import sys

import numpy as np
import pytest
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    partitions,
    take_shard,
)
from minimp.precision.fp8_scaling import NoScaling


def test_a_column_parallel_linear_without_a_bias_has_none_and_cuts_only_its_weight():
    """Linear(4, 6, bias=False) over 2 ranks: rank r holds rows 3r .. 3r + 3 of W and computes
    those output features of x W^T; its bias is None and partitions() lists the weight alone."""
    linear = nn.Linear(4, 6, bias=False, rng=np.random.default_rng(3)).to(np.float64)
    weight = linear.weight.data.copy()
    x = np.random.default_rng(4).standard_normal((2, 5, 4))

    def build(comm):
        column = ColumnParallelLinear(linear, comm)
        names = [name for name, _ in column.named_parameters()]
        return column(Tensor(x)).data, column.bias, names, partitions(column)

    for rank, (y, bias, names, cut) in enumerate(dist.simulate(2, build)):
        rows = weight[rank * 3 : (rank + 1) * 3]
        np.testing.assert_allclose(y, np.einsum("bsi,oi->bso", x, rows), rtol=1e-12, atol=1e-15)
        assert bias is None and names == ["weight"] and cut == {"weight": (0, 1)}


def test_partitions_of_a_parallel_linear_itself_name_its_parameters_without_a_prefix():
    def build(comm):
        column = ColumnParallelLinear(nn.Linear(4, 6), comm)
        return partitions(column), partitions(RowParallelLinear(nn.Linear(6, 4), comm))

    column, row = dist.simulate(2, build)[0]
    assert column == {"weight": (0, 1), "bias": (0, 1)}
    assert row == {"weight": (1, 1)}


class _Unbiased(nn.Module):
    """A layer that lists a bias in its partition but never sets one (no attribute at all)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(np.ones((2, 2), np.float32))
        self.partition = {"weight": (0, 1), "bias": (0, 1)}


def test_a_parameter_a_module_lists_but_does_not_hold_is_not_cut():
    model = nn.Sequential(_Unbiased(), nn.ReLU())
    assert partitions(model) == {"0.weight": (0, 1)}


@pytest.mark.parametrize(
    "out_features, sections, message",
    [(3, 1, "3 output features do not split into 1 section"), (9, 3, "9 output features do not")],
)
def test_output_features_that_do_not_split_are_refused_by_the_column_layer(
    out_features, sections, message
):
    # 3 rows over 2 ranks; 9 rows in 3 sections of 3, each over 2 ranks
    def build(comm):
        return ColumnParallelLinear(nn.Linear(4, out_features), comm, sections)

    with pytest.raises(ValueError, match=f"{message}.* over 2 ranks"):
        dist.simulate(2, build)


@pytest.mark.parametrize("layer", ["column", "row"])
def test_a_parallel_linear_keeps_the_fp8_state_and_its_shards_multiply_in_fp8(layer):
    """Linear(8, 6) with an fp8 state of scale 1 (NoScaling): x and W are rounded to E4M3 element
    by element, so the column shard's outputs are the whole fp8 layer's output features of this
    rank, and the row layer's sum of partial products is the whole fp8 output. The float32 product
    (no fp8) is off by E4M3's rounding, far more than the tolerance."""
    x = np.random.default_rng(5).standard_normal((3, 8)).astype(np.float32)

    def build(comm):
        linear = nn.enable_fp8(nn.Linear(8, 6, rng=np.random.default_rng(6)), NoScaling())
        whole = linear(Tensor(x)).data  # the one-process fp8 output
        plain = x @ linear.weight.data.T + linear.bias.data
        if layer == "column":
            cut = ColumnParallelLinear(linear, comm)
            y, rows = cut(Tensor(x)).data, slice(comm.rank * 3, (comm.rank + 1) * 3)
        else:
            cut = RowParallelLinear(linear, comm)
            y, rows = cut(Tensor(x[:, comm.rank * 4 : (comm.rank + 1) * 4])).data, slice(0, 6)
        return cut.fp8_meta is linear.fp8_meta, y, whole[:, rows], plain[:, rows]

    for kept, y, whole, plain in dist.simulate(2, build):
        assert kept
        np.testing.assert_allclose(y, whole, rtol=1e-5, atol=1e-6)
        assert np.abs(plain - whole).max() > 1e-2  # so the check above tells fp8 from float32


def test_a_device_weight_is_cut_into_device_shards(monkeypatch):
    """With the cupy stand-in, a Linear whose weight and bias are device arrays: the column and
    row shards are device arrays too, holding the host slices' values."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    whole = np.arange(24, dtype=np.float32).reshape(4, 6)
    assert type(take_shard(whole.view(DeviceLike), 1, 3, 1, 2)) is DeviceLike
    linear = nn.Linear(6, 4)
    linear.weight.data = whole.view(DeviceLike)
    linear.bias.data = np.arange(4, dtype=np.float32).view(DeviceLike)

    def build(comm):
        column, row = ColumnParallelLinear(linear, comm), RowParallelLinear(linear, comm)
        return column.weight.data, column.bias.data, row.weight.data, row.bias.data

    for rank, arrays in enumerate(dist.simulate(2, build)):
        assert all(type(array) is DeviceLike for array in arrays)
        rows, columns = slice(2 * rank, 2 * rank + 2), slice(3 * rank, 3 * rank + 3)
        expected = [whole[rows], np.arange(4.0)[rows], whole[:, columns], np.arange(4.0)]
        for array, values in zip(arrays, expected):
            np.testing.assert_array_equal(array, values)
