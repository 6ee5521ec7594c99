"""take_shard and join_shards value by value: shards written out with NumPy slicing, cut from and
joined back along either axis, in sections (q, k and v), on worlds of 1, 2 and 4 ranks; a fused
q, k, v column-parallel Linear's non-zero bias cut into each rank's heads; a row-parallel Linear
without a bias against the product written out in NumPy."""

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.parallel.tensor.layers import (ColumnParallelLinear, RowParallelLinear, join_shards,
                                          partitions, take_shard)

SECTIONS, SECTION = 3, 4  # three sections (q, k, v) of 4 rows or columns each


def _shards_by_hand(whole, axis, ranks):
    """Rank r's shard: its SECTION // ranks rows (axis 0) or columns (axis 1) of every section,
    sections in order, cut with plain slices (no minimp code)."""
    width = SECTION // ranks
    shards = []
    for rank in range(ranks):
        starts = [section * SECTION + rank * width for section in range(SECTIONS)]
        if axis == 0:
            shards.append(np.concatenate([whole[s : s + width] for s in starts], axis=0))
        else:
            shards.append(np.concatenate([whole[:, s : s + width] for s in starts], axis=1))
    return shards


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_join_shards_puts_every_rank_s_part_of_each_section_back_in_place(axis, ranks):
    # the other axis is 2 long, which 3 sections do not divide: cutting or joining along it fails
    shape = (SECTIONS * SECTION, 2) if axis == 0 else (2, SECTIONS * SECTION)
    whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    shards = _shards_by_hand(whole, axis, ranks)
    joined = join_shards(shards, axis, SECTIONS)
    assert joined.shape == whole.shape
    np.testing.assert_array_equal(joined, whole)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("axis", [0, 1])
def test_take_shard_gives_each_rank_its_part_of_each_section_along_either_axis(axis, ranks):
    shape = (SECTIONS * SECTION, 2) if axis == 0 else (2, SECTIONS * SECTION)
    whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
    for rank, expected in enumerate(_shards_by_hand(whole, axis, ranks)):
        shard = take_shard(whole, axis, SECTIONS, rank, ranks)
        assert shard.shape == expected.shape and shard.flags.c_contiguous
        np.testing.assert_array_equal(shard, expected)


def test_one_rank_s_shard_is_the_whole_array():
    # a world of size 1: the single shard comes back unchanged, whatever the sections
    whole = np.arange(12.0).reshape(2, 6)
    for axis, sections in [(0, 1), (0, 2), (1, 1), (1, 3)]:
        np.testing.assert_array_equal(join_shards([whole], axis, sections), whole)


def test_a_fused_qkv_column_layer_cuts_its_bias_into_each_rank_s_q_k_and_v_pieces():
    """Linear(4, 12) as attention's fused q, k, v projection (3 sections of 4 features, 2 heads
    of 2) over 2 ranks, with a bias that is not zero (a GPT starts with zero biases, where every
    cut looks right): rank r's bias is its head's q, k and v pieces, its output is those features
    of the whole layer's, and the shards joined as partitions() says give the whole bias back."""
    linear = nn.Linear(4, 12, rng=np.random.default_rng(5)).to(np.float64)
    linear.bias.data[:] = np.arange(1.0, 13.0)  # q 1..4, k 5..8, v 9..12
    weight, bias = linear.weight.data.copy(), linear.bias.data.copy()
    x = np.random.default_rng(6).standard_normal((2, 3, 4))

    def build(comm):
        column = ColumnParallelLinear(linear, comm, sections=3)
        return column.bias.data, column(Tensor(x)).data, partitions(column)["bias"]

    results = dist.simulate(2, build)
    whole = np.einsum("bsi,oi->bso", x, weight) + bias
    pieces = [[1.0, 2.0, 5.0, 6.0, 9.0, 10.0], [3.0, 4.0, 7.0, 8.0, 11.0, 12.0]]  # q, k, v of r
    for (shard, y, _), expected in zip(results, pieces):
        np.testing.assert_array_equal(shard, expected)
        features = [int(value) - 1 for value in expected]  # where those biases sit in the whole
        np.testing.assert_allclose(y, whole[..., features], rtol=1e-12, atol=1e-15)
    axis, sections = results[0][2]
    np.testing.assert_array_equal(join_shards([r[0] for r in results], axis, sections), bias)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "tp+sp"])
def test_a_row_parallel_linear_without_a_bias_gives_the_sum_of_the_partial_products(
    sequence_parallel,
):
    """Linear(6, 3, bias=False) cut over 2 ranks: rank r reads input features 3r .. 3r + 3 and
    every rank ends with x @ W^T (with sequence parallelism, its half of the positions); no bias
    is added, and the layer has none to train."""
    ranks, batch, sequence = 2, 2, 4
    linear = nn.Linear(6, 3, bias=False, rng=np.random.default_rng(7)).to(np.float64)
    x = np.random.default_rng(8).standard_normal((batch, sequence, 6))
    weight = linear.weight.data.copy()  # (out, in), read before any rank cuts it

    def forward(comm):
        row = RowParallelLinear(linear, comm, sequence_parallel=sequence_parallel)
        mine = x[..., comm.rank * 3 : (comm.rank + 1) * 3]  # this rank's input features
        return row(Tensor(mine)).data, row.bias, [name for name, _ in row.named_parameters()]

    whole = np.einsum("bsi,oi->bso", x, weight)
    for rank, (y, bias, names) in enumerate(dist.simulate(ranks, forward)):
        expected = whole[:, rank * 2 : (rank + 1) * 2] if sequence_parallel else whole
        np.testing.assert_allclose(y, expected, rtol=1e-12, atol=1e-15)
        assert bias is None and names == ["weight"]
