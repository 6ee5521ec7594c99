"""ZeRO's sharding arithmetic without ranks: units, chunks and pieces (uneven sizes, more ranks than
elements), the units a model is cut into, and the formulas' paper numbers."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp import distributed as dist
from minimp import nn
from minimp.models import GPT, GPTConfig
from minimp.parallel import Topology, Unit, ZeroLayout
from minimp.parallel.pipeline.tied import tied_indices
from minimp.parallel.zero.formulas import (
    memory_formula, paper_per_parameter, peak_formula, per_parameter,
)  # fmt: skip
from minimp.parallel.zero.layout import plan_units
from minimp.train import TrainConfig
from minimp.train.build import build_stage
from minimp.train.tasks import TASKS
from minimp.train.sizes import zero_unit_sizes


def test_the_docstring_example():
    """[W (3 x 2), b (3)] over 2 ranks: chunks [0, 5) and [5, 9)."""
    unit = Unit(indices=(0, 1), sizes=(6, 3))
    assert [(p.index, p.start, p.stop, p.offset) for p in unit.pieces(0, 2)] == [(0, 0, 5, 0)]
    assert [(p.index, p.start, p.stop, p.offset) for p in unit.pieces(1, 2)] == [
        (0, 5, 6, 0),
        (1, 0, 3, 1),
    ]


def test_more_ranks_than_elements_leaves_the_last_ranks_empty():
    layout = [ZeroLayout([Unit((0,), (3,))], rank, 5) for rank in range(5)]
    assert [one.shard_size() for one in layout] == [1, 1, 1, 0, 0]
    assert [len(one.pieces[0]) for one in layout] == [1, 1, 1, 0, 0]


def test_shard_size_of_another_rank_counts_that_rank_s_chunks():
    layout = ZeroLayout([Unit((0,), (5,)), Unit((1,), (7,))], rank=0, world_size=3)
    # 5 = 2 + 2 + 1 and 7 = 3 + 2 + 2: the first length % 3 chunks get one extra element
    assert [layout.shard_size(rank) for rank in range(3)] == [2 + 3, 2 + 2, 1 + 2]
    assert layout.shard_size() == layout.shard_size(0)  # its own by default


@pytest.mark.parametrize("compute_bytes", [2, 4])
def test_masters_by_stage_vanish_only_where_the_compute_copy_is_float32_and_whole(compute_bytes):
    """Units of 4 and 6 elements over 2 ranks: P = 10, S_r = 2 + 3 = 5. In float32 the compute
    copy is the master in stage 0 (both whole) and in stage 3 (both the shard)."""
    masters = [
        memory_formula(stage, unit_sizes=[4, 6], rank=1, world_size=2,
                       compute_bytes=compute_bytes, wire_bytes=4, slots=2)["masters"]
        for stage in range(4)
    ]  # fmt: skip
    assert masters == ([0, 20, 20, 0] if compute_bytes == 4 else [40, 20, 20, 20])


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_stage_with_no_units_holds_and_peaks_at_nothing(stage):
    held = memory_formula(stage, unit_sizes=[], rank=0, world_size=2, compute_bytes=2,
                          wire_bytes=4, slots=2)  # fmt: skip
    assert held == dict.fromkeys(held, 0)
    assert len(held) == 7
    assert peak_formula(stage, unit_sizes=[], compute_bytes=2) == 0


@given(
    sizes=st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=4), min_size=1, max_size=4),
    world_size=st.integers(1, 9),
)
def test_the_ranks_pieces_cover_every_parameter_once(sizes, world_size):
    """Uneven sizes, units smaller than the world: every element of every parameter lies in
    exactly one rank's piece, at the place the chunk bounds say."""
    units, index = [], 0
    for unit_sizes in sizes:
        units.append(Unit(tuple(range(index, index + len(unit_sizes))), tuple(unit_sizes)))
        index += len(unit_sizes)
    flat_sizes = [size for unit_sizes in sizes for size in unit_sizes]
    covered = [np.zeros(size, int) for size in flat_sizes]
    for rank in range(world_size):
        layout = ZeroLayout(units, rank, world_size)
        for u, pieces in enumerate(layout.pieces):
            assert sum(piece.size for piece in pieces) == layout.chunk_size(u)
            offset = 0
            for piece in pieces:
                assert piece.offset == offset and piece.size > 0
                covered[piece.index][piece.start : piece.stop] += 1
                offset += piece.size
    assert all((count == 1).all() for count in covered)
    sizes_of = [ZeroLayout(units, r, world_size).shard_size() for r in range(world_size)]
    assert sum(sizes_of) == sum(flat_sizes) and max(sizes_of) - min(sizes_of) <= len(units)


def test_a_parameter_two_layers_read_is_a_unit_of_its_own():
    """The GPT's token embedding: layer 0 owns it, the head reads it too."""
    model = GPT(GPTConfig(context=8, layers=2, heads=2, width=16), np.random.default_rng(0))
    params = model.parameters()
    units, reads = plan_units(model.layers, params, tied=set())
    wte = next(u for u, unit in enumerate(units) if unit.indices == (0,))
    assert wte in reads[0] and wte in reads[-1]
    assert sorted(i for unit in units for i in unit.indices) == list(range(len(params)))


def test_units_follow_the_forward_each_layer_s_own_then_the_shared_ones_it_reads_first():
    """A shared parameter is a unit of its own where the forward first reads it: the token
    embedding right after the position embedding (Embeddings' own), not after the head."""
    model = GPT(GPTConfig(context=8, layers=2, heads=2, width=16), np.random.default_rng(0))
    params = model.parameters()
    position = {id(p): index for index, p in enumerate(params)}
    embeddings, *blocks, head = model.layers
    expected = [{position[id(embeddings.wpe.weight)]}, {position[id(embeddings.wte.weight)]}]
    expected += [{position[id(p)] for p in layer.parameters()} for layer in (*blocks, head)]
    units, reads = plan_units(model.layers, params, tied=set())
    assert [set(unit.indices) for unit in units] == expected
    assert reads == [[0, 1], [2], [3], [1, 4]]  # the head reads the token embedding's unit


def test_a_tied_parameter_is_a_unit_of_its_own_right_after_its_layer_s_others():
    """tied: another stage holds a copy (parallel/pipeline/tied.py), so the one layer reading it
    here does not own it: [bias], [weight], then the next layer's unit."""
    layers = [nn.Linear(2, 3), nn.Linear(3, 2)]
    params = [p for layer in layers for p in layer.parameters()]  # weight, bias, weight, bias
    units, reads = plan_units(layers, params, tied={0})
    assert [unit.indices for unit in units] == [(1,), (0,), (2, 3)]
    assert [unit.sizes for unit in units] == [(3,), (6,), (6, 2)]
    assert reads == [[0, 1], [2]]


@pytest.mark.parametrize(
    "flags",
    [
        dict(layers=3, hidden=16),
        dict(layers=3, hidden=16, pp=2),
        dict(dataset="shakespeare", layers=2, hidden=16, heads=2, context=8),
        dict(dataset="shakespeare", layers=2, hidden=16, heads=2, context=8, pp=3),
    ],
    ids=str,
)
def test_validation_knows_the_units_before_the_model_is_built(flags):
    """zero_unit_sizes (from the flags) = the units the trainer's stages are cut into."""
    config = TrainConfig(**flags)

    def units(comm):
        topology = Topology(comm, dp=1, pp=config.pp)
        task = TASKS[config.dataset](config, np.float32)
        stage = build_stage(config, task, topology, np.float32)
        tied = set(tied_indices(stage.names, stage.tied_names))
        cut, _ = plan_units(stage.runner.layers, stage.optimizer.params, tied)
        return sorted(unit.size for unit in cut)

    expected = [sorted(sizes) for sizes in zero_unit_sizes(config)]
    assert dist.simulate(config.pp, units) == expected


def test_the_paper_s_7_5_billion_parameter_example():
    """Section 5.1 / figure 1: 120 GB replicated, 31.4 / 16.6 / 1.9 GB at N = 64."""
    gigabytes = [paper_per_parameter(stage, 64) * 7.5e9 / 1e9 for stage in range(4)]
    assert [round(g, 1) for g in gigabytes] == [120.0, 31.4, 16.6, 1.9]


def test_minimp_s_bytes_per_parameter():
    """fp16 with Adam: 18, 6 + 12/N, 2 + 16/N, 18/N (float32 accumulators instead of the
    paper's fp16 gradients); fp32: the master is the compute copy where nothing is sharded."""
    assert [per_parameter(stage, 4) for stage in range(4)] == [18, 9, 6, 4.5]
    assert [per_parameter(stage, 1, compute_bytes=4) for stage in range(4)] == [16, 20, 20, 16]
