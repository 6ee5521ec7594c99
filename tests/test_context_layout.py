"""Context-parallel shards: which chunks and positions each rank holds, shard and unshard, and the
causal work per rank (zig-zag balanced, contiguous 2N-1 between the busiest and the idlest)."""

import numpy as np
import pytest

from minimp.parallel.context import ContextLayout

SIZES = [1, 2, 3, 4]


def test_zigzag_pairs_an_early_chunk_with_a_late_one_and_contiguous_cuts_in_order():
    assert [ContextLayout(4).chunk_ids(r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    contiguous = ContextLayout(3, "contiguous")
    assert [contiguous.chunk_ids(r) for r in range(3)] == [(0, 1), (2, 3), (4, 5)]
    assert list(ContextLayout(2).token_indices(1, 8)) == [2, 3, 4, 5]
    assert list(ContextLayout(2).token_indices(0, 8)) == [0, 1, 6, 7]


@pytest.mark.parametrize("kind", ["zigzag", "contiguous"])
@pytest.mark.parametrize("size", SIZES)
def test_the_ranks_positions_partition_the_sequence_and_unshard_undoes_shard(size, kind, rng):
    layout, tokens = ContextLayout(size, kind), 4 * size
    held = np.concatenate([layout.token_indices(r, tokens) for r in range(size)])
    assert sorted(held) == list(range(tokens))
    x = rng.standard_normal((2, tokens, 3))  # (B, T, C)
    shards = [layout.shard(x, r) for r in range(size)]
    assert all(shard.shape == (2, tokens // size, 3) for shard in shards)
    np.testing.assert_array_equal(shards[-1], x[:, layout.token_indices(size - 1, tokens)])
    np.testing.assert_array_equal(layout.unshard(shards), x)


def blocks_by_enumeration(layout, rank):
    """Causal blocks of the 2N-chunk grid rank's query chunks compute, counted one by one."""
    return sum(1.0 if j < i else 0.5
               for i in layout.chunk_ids(rank) for j in range(layout.chunks) if j <= i)


@pytest.mark.parametrize("size", SIZES)
def test_causal_work_is_2n_on_every_zigzag_rank_and_4r_plus_2_contiguous(size):
    zigzag, contiguous = ContextLayout(size), ContextLayout(size, "contiguous")
    for rank in range(size):
        assert zigzag.causal_work(rank) == blocks_by_enumeration(zigzag, rank) == 2 * size
        assert contiguous.causal_work(rank) == blocks_by_enumeration(contiguous, rank)
        assert contiguous.causal_work(rank) == 4 * rank + 2
    for layout in (zigzag, contiguous):  # the whole causal grid: (2N)^2 / 2 blocks
        assert sum(layout.causal_work(r) for r in range(size)) == 2 * size**2
    assert zigzag.work_imbalance() == 1.0
    assert contiguous.work_imbalance() == 2 * size - 1


def test_contiguous_shards_need_n_pieces_not_the_2n_chunk_grid():
    """Ulysses takes T/N contiguous positions a rank: 6 positions over 2 ranks (not 4 chunks)."""
    layout = ContextLayout(2, "contiguous")
    assert [layout.token_indices(r, 6).tolist() for r in range(2)] == [[0, 1, 2], [3, 4, 5]]
    with pytest.raises(ValueError, match="7 positions are not a multiple of 2 .choose a context "
                       "divisible by 2"):
        layout.token_indices(0, 7)
    with pytest.raises(ValueError, match="6 positions are not a multiple of 4"):
        ContextLayout(2).token_indices(0, 6)  # zig-zag still needs the grid


def test_bad_layouts_and_sequences_fail_in_one_line_naming_the_fix():
    with pytest.raises(ValueError, match="12 positions are not a multiple of 8 .choose a context "
                       "divisible by 8"):
        ContextLayout(4).token_indices(0, 12)
    with pytest.raises(ValueError, match="must be one of"):
        ContextLayout(2, "striped")
    with pytest.raises(ValueError, match="at least 1 rank"):
        ContextLayout(0)
    with pytest.raises(ValueError, match="rank 2 is not in a context-parallel group of 2"):
        ContextLayout(2).chunk_ids(2)
