"""Pipeline parallelism on the simulated world: stage splitting, and training that equals
one process for every schedule (gpipe, 1f1b, interleaved, zb-h1), any number of micro-batches
(also fewer than stages), and the dp x pp grid; schedules the sizes cannot run are refused."""

import itertools
import re

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp import distributed as dist
from minimp import nn
from minimp.parallel.pipeline.split import PipelineError, split_stages, stage_parameters
from minimp.train import TrainConfig, build_model, train
from minimp.checkpoints.errors import ConfigError
from minimp.train.loop import Run


def test_stages_are_balanced_by_parameter_count_and_keep_relus_with_their_linear():
    model = build_model(64, 10, 128, 4, np.random.default_rng(0))
    assert split_stages(model.layers, 4) == [(0, 2), (2, 4), (4, 6), (6, 9)]
    assert split_stages(model.layers, 1) == [(0, 9)]
    for start, stop in split_stages(model.layers, 5):
        assert isinstance(model.layers[start], nn.Linear)


def test_the_most_expensive_stage_is_as_cheap_as_possible():
    layers = [nn.Linear(n, 1, bias=False) for n in (5, 1, 1, 1, 5)]
    assert split_stages(layers, 3) == [(0, 1), (1, 4), (4, 5)]


def test_more_stages_than_weighted_layers_is_an_error():
    with pytest.raises(
        PipelineError, match="--pp 6 needs at least 6 layers with weights, the model has 5"
    ):
        split_stages(build_model(64, 10, 16, 4, np.random.default_rng(0)).layers, 6)


def run(world_size, eager_limit=0, **overrides):
    """Train on the simulated world; eager_limit=0 makes every send wait for its receiver, the
    strictest MPI behaviour, so a schedule that could deadlock on real MPI raises DeadlockError."""
    settings = dict(hidden=32, layers=3, batch_size=32, steps=20, precision="fp32", log_every=1000)
    config = TrainConfig(**{**settings, **overrides})
    config.validate(world_size)
    return dist.simulate(
        world_size,
        lambda comm: train(config, log=lambda line: None, comm=comm),
        eager_limit=eager_limit,
    )[0]


@pytest.fixture(scope="module")
def one_process():
    return run(1)["master_weights"]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("micro_batches", [1, 2, 4, 8])
def test_pipeline_training_equals_one_process(one_process, schedule, stages, micro_batches):
    result = run(stages, pp=stages, schedule=schedule, micro_batches=micro_batches)
    assert set(result["master_weights"]) == set(one_process)
    for name, array in result["master_weights"].items():
        np.testing.assert_allclose(array, one_process[name], rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.parametrize(
    "stages, micro_batches, flags",
    [
        (2, 2, dict(schedule="interleaved", virtual_stages=2)),
        (2, 4, dict(schedule="interleaved", virtual_stages=2)),
        (2, 2, dict(schedule="interleaved", virtual_stages=1)),
        (2, 1, dict(schedule="zb-h1")),
        (2, 4, dict(schedule="zb-h1")),
        (4, 8, dict(schedule="zb-h1")),
        (4, 2, dict(schedule="zb-h1")),
    ],
    ids=str,
)
def test_interleaved_and_zero_bubble_training_equals_one_process(
    one_process, stages, micro_batches, flags
):
    """Buffered sends on a world whose sends would otherwise all wait for their receives."""
    result = run(stages, pp=stages, micro_batches=micro_batches, **flags)
    for name, array in result["master_weights"].items():
        np.testing.assert_allclose(array, one_process[name], rtol=1e-5, atol=1e-7, err_msg=name)


BAD_SCHEDULES = [
    (2, dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=3, batch_size=30),
     "--micro-batches 3 is not a multiple of 2"),
    (2, dict(pp=2, schedule="interleaved", virtual_stages=3, micro_batches=2),
     "--pp 2 x --virtual-stages 3 needs 6 layers with weights, the model has 4"),
    (2, dict(pp=2, schedule="interleaved", virtual_stages=2, micro_batches=8192,
             batch_size=8192 * 2, layers=3), "more message tags than MPI guarantees"),
    (2, dict(pp=2, schedule="1f1b", virtual_stages=2), "needs --schedule interleaved"),
    (2, dict(pp=2, schedule="zb-h1", recompute=True), "cannot be split into B and W"),
]  # fmt: skip


@pytest.mark.parametrize("world_size, flags, message", BAD_SCHEDULES, ids=lambda x: str(x)[:40])
def test_a_schedule_the_sizes_cannot_run_is_refused_before_any_work(world_size, flags, message):
    config = TrainConfig(**{**dict(hidden=32, layers=3, batch_size=32), **flags})
    with pytest.raises(ConfigError, match=re.escape(message)):
        config.validate(world_size)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_data_and_pipeline_parallel_grid_equals_one_process(one_process, schedule):
    result = run(4, dp=2, pp=2, schedule=schedule, micro_batches=2)
    for name, array in result["master_weights"].items():
        np.testing.assert_allclose(array, one_process[name], rtol=1e-5, atol=1e-7, err_msg=name)


def test_an_overflow_on_the_last_stage_makes_every_stage_skip():
    result = run(4, pp=4, precision="fp16", steps=6, inject_overflow="3:3")
    assert [r["skipped"] for r in result["history"]] == [False, False, True, False, False, False]


def test_timeline_records_every_forward_and_backward(tmp_path):
    from minimp.measure.trace import read_timeline

    path = tmp_path / "timeline.json"
    run(2, pp=2, micro_batches=4, steps=2, timeline=str(path))
    events = read_timeline(str(path))["events"]
    assert len(events) == 2 * 2 * 4 * 2  # steps x stages x micro-batches x (forward, backward)
    assert all(e["end"] >= e["start"] >= 0 for e in events)


def test_pipeline_stages_split_the_parameters():
    """Lesson 9: with --pp 4 each rank holds one stage, and the stages add up to the model."""
    model = build_model(64, 10, 128, 4, np.random.default_rng(0))
    bounds = split_stages(model.layers, 4)
    counts = [sum(p.size for _, p in stage_parameters(model, bounds[stage])) for stage in range(4)]
    assert sum(counts) == sum(p.size for p in model.parameters())
    assert max(counts) < sum(counts) / 2


@given(st.lists(st.integers(1, 50), min_size=1, max_size=8), st.data())
def test_balanced_cuts_find_the_smallest_possible_largest_stage(costs, data):
    """Against brute force over every way to cut: the binary search + greedy pass is optimal."""
    from minimp.parallel.pipeline.split import _balanced_cuts

    parts = data.draw(st.integers(1, len(costs)))
    cuts = _balanced_cuts(costs, parts)
    bounds = [0, *cuts, len(costs)]
    assert len(cuts) == parts - 1 and all(a < b for a, b in zip(bounds, bounds[1:]))

    def largest(points):
        edges = [0, *points, len(costs)]
        return max(sum(costs[a:b]) for a, b in zip(edges, edges[1:]))

    every_way = itertools.combinations(range(1, len(costs)), parts - 1)
    assert largest(cuts) == min(largest(points) for points in every_way)


def stage_accounts(schedule, stages=2, micro_batches=4):
    """Each stage's (micro-batches held at peak, activation bytes at peak, micro-batches left
    over) after one step of a pipeline run."""
    config = TrainConfig(hidden=32, layers=3, batch_size=32, precision="fp32", steps=1)
    config.pp, config.schedule, config.micro_batches = stages, schedule, micro_batches
    config.validate(stages)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        run.step(1)
        stage = run.runner
        return stage.peak_stored, stage.peak_activation_bytes, len(stage._micro_batches)

    return dist.simulate(stages, body)


def test_zb_h1_holds_a_micro_batch_until_its_w_and_no_longer():
    """ZB-H1 keeps 1F1B's first-stage peak on every stage (P = 2 of M = 4 micro-batches, W
    runs `stage` micro-batches late), and forgets each micro-batch once its W has run. Every
    micro-batch of a stage keeps the same bytes: 1F1B's last stage holds one."""
    (held_0, bytes_0, _), (held_1, bytes_1, _) = stage_accounts("1f1b")
    assert (held_0, held_1) == (2, 1)
    zero_bubble = stage_accounts("zb-h1")
    assert zero_bubble == [(2, bytes_0, 0), (2, 2 * bytes_1, 0)]


def tied_state(world_size, **flags):
    """Each stage's TiedGradients as (indices, counts_in_norm), or None."""
    config = TrainConfig(**{**dict(hidden=32, layers=3, batch_size=32, steps=1), **flags})
    config.validate(world_size)

    def body(comm):
        tied = Run(config, comm, log=lambda line: None).sync.tied
        return None if tied is None else (tied.indices, tied.counts_in_norm, tied.comm.size)

    return dist.simulate(world_size, body)


def test_only_the_ends_of_a_gpt_pipeline_share_the_tied_embedding():
    """The token embedding's copies: the first stage's (counted in the norm) and the head's (the
    last of the last stage's 15 parameters); the stages between, an MLP and a single stage have
    none."""
    from test_train_gpt import TINY

    first, middle, last = tied_state(3, **{**TINY, "layers": 2, "pp": 3})
    assert first == ([0], True, 2) and middle is None and last == ([14], False, 2)
    assert tied_state(2, **{**TINY, "pp": 2}) == [([0], True, 2), ([14], False, 2)]
    assert tied_state(1, **TINY) == [None]
    assert tied_state(2, pp=2) == [None, None]


def test_a_weight_gradient_before_its_input_gradient_is_refused():
    from minimp.parallel.pipeline.schedules.actions import BACKWARD_WEIGHT, FORWARD, Action

    config = TrainConfig(hidden=32, layers=3, batch_size=32, steps=1)
    config.validate(1)
    run = Run(config, dist.simulate(1, lambda comm: comm)[0], log=lambda line: None)
    inputs, targets, _ = run._micro_batches(1)
    w0 = Action(BACKWARD_WEIGHT, 0)
    with pytest.raises(RuntimeError) as refused:
        run.runner.run(
            [Action(FORWARD, 0), w0], inputs=inputs, targets=targets,
            scale_loss=run._scale_loss, after_backward=lambda: None,
        )  # fmt: skip
    assert str(refused.value) == f"{w0!r}: W before the micro-batch's B on this chunk"
