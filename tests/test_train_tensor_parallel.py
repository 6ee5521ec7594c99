"""--tp and --sequence-parallel through the training loop, in the simulated world: the grid, bytes
per group against the formulas, the loss and the clipped norm counted once, fp8's amax agreement,
the copies checked equal, checkpoints to one process and back, the timeline, refused flags."""

import numpy as np
import pytest

from minimp import backend
from minimp import distributed as dist
from minimp.parallel import Topology, amax
from minimp.parallel.replicas import ReplicaMismatchError
from minimp.measure.tensor_parallel_accounts import (
    gpt_tensor_parallel_bytes,
    mlp_tensor_parallel_bytes,
    pipeline_bytes,
)
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.zero.formulas import bytes_sent_formula
from minimp.train import TrainConfig
from minimp.checkpoints.errors import ConfigError
from minimp.train.loop import train
from minimp.train.sizes import rank_layer_counts, stage_bounds

GPT = dict(
    dataset="shakespeare", layers=2, hidden=32, heads=4, context=16, batch_size=8, steps=3,
    eval_every=0, log_every=1000, dropout=0.1, precision="fp32",
)  # fmt: skip
MLP = dict(hidden=32, layers=2, batch_size=32, steps=3, log_every=1000, precision="fp32")


def run(world_size, **flags):
    """Every rank's train() result on the simulated world."""
    config = TrainConfig(**flags)
    config.validate(world_size)
    with backend.limit_cpu_threads(1):
        return dist.simulate(world_size, lambda comm: train(config, lambda line: None, comm))


def test_the_grid_puts_tensor_parallel_ranks_next_to_each_other():
    def places(comm):
        topology = Topology(comm, dp=2, pp=2, tp=2)
        groups = [topology.tp_group, topology.dp_group, topology.pp_group, topology.mp_group]
        members = []  # the world ranks of each group, in the group's order
        for group in groups:
            table = np.zeros(group.size)
            table[group.rank] = comm.rank
            members.append([int(r) for r in group.allreduce_scalars(table, "sum")])
        return (topology.stage, topology.dp_rank, topology.tp_rank), members, topology.describe()

    results = dist.simulate(8, places)
    assert [place for place, _, _ in results][:4] == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1)]
    _, (tp, dp, pp, mp), text = results[5]  # stage 1, replica 0, shard 1
    assert (tp, dp, pp, mp) == ([4, 5], [5, 7], [1, 5], [0, 1, 4, 5])
    assert "  rank 5: stage 1, replica 0, shard 1" in text.splitlines()


def _gpt_formula(config, blocks, first, last):
    rows = config["batch_size"] // config.get("dp", 1) // config.get("micro_batches", 1)
    return gpt_tensor_parallel_bytes(
        blocks=blocks, rows=rows, context=config["context"], width=config["hidden"],
        tp=config["tp"], micro_batches=config.get("micro_batches", 1), compute_bytes=4,
        sequence_parallel=config.get("sequence_parallel", False), first_stage=first,
        last_stage=last, recompute=config.get("recompute", False),
    )  # fmt: skip


GPT_LAYOUTS = [
    (2, dict(tp=2)),
    (2, dict(tp=2, sequence_parallel=True)),
    (2, dict(tp=2, sequence_parallel=True, recompute=True)),
    (4, dict(tp=4, micro_batches=2)),
    (4, dict(tp=2, pp=2, micro_batches=2, sequence_parallel=True)),
]


@pytest.mark.parametrize("world_size, layout", GPT_LAYOUTS, ids=str)
def test_gpt_bytes_per_group_equal_the_formulas(world_size, layout):
    config = {**GPT, **layout}
    results = run(world_size, **config)
    bounds = stage_bounds(TrainConfig(**config))
    tp, pp = layout["tp"], layout.get("pp", 1)
    for rank, result in enumerate(results):
        stage = rank // tp  # --dp 1
        start, stop = bounds[stage]
        blocks = sum(1 <= i <= GPT["layers"] for i in range(start, stop))
        first, last = stage == 0, stage == pp - 1
        expected = _gpt_formula(config, blocks, first, last)
        rows = config["batch_size"] // config.get("micro_batches", 1)
        activation = rows * GPT["context"] * GPT["hidden"] * 4
        if layout.get("sequence_parallel"):
            activation //= tp  # a rank sends its slice of the sequence to the next stage
        sent = pipeline_bytes(
            activation=activation, micro_batches=config.get("micro_batches", 1),
            first_stage=first, last_stage=last,
        )  # fmt: skip
        for record in result["history"]:
            assert record["bytes_by_group"]["tensor_parallel"] == expected
            assert record["bytes_by_group"]["pipeline"] == sent


def test_mlp_and_data_parallel_bytes_equal_the_formulas():
    config = {**MLP, "layers": 4, "tp": 2, "dp": 2}
    results = run(4, **config)
    rows = MLP["batch_size"] // 2
    expected = mlp_tensor_parallel_bytes(
        pairs=[(64, 32), (32, 32)], rows=rows, tp=2, micro_batches=1, compute_bytes=4,
        first_input_is_data=True,
    )  # fmt: skip
    parameters = sum(rank_layer_counts(TrainConfig(**config)))  # one bucket of this rank's
    for rank, result in enumerate(results):
        dp_rank = rank // 2 % 2
        replicas = bytes_sent_formula(
            0, sizes=[parameters], rank=dp_rank, world_size=2, micro_batches=1,
            compute_bytes=4, wire_bytes=4,
        )  # fmt: skip
        for record in result["history"]:
            assert record["bytes_by_group"]["tensor_parallel"] == expected
            assert record["bytes_by_group"]["data_parallel"] == replicas["all_reduce"]


def assert_same_masters(result, reference):
    for name, array in reference["master_weights"].items():
        got = result["master_weights"][name]
        np.testing.assert_allclose(got, array, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.fixture(scope="module")
def one_process_gpt():
    return run(1, **{**GPT, "max_grad_norm": 0.05})[0]


def test_the_loss_and_the_clipped_norm_count_every_copy_once(one_process_gpt):
    """Clipping at 0.05 scales every step: a norm that counted the whole parameters on both
    ranks would clip by another factor."""
    result = run(2, **{**GPT, "max_grad_norm": 0.05, "tp": 2, "sequence_parallel": True})[0]
    losses = [record["loss"] for record in result["history"]]
    expected = [record["loss"] for record in one_process_gpt["history"]]
    np.testing.assert_allclose(losses, expected, rtol=1e-6)
    assert_same_masters(result, one_process_gpt)


def test_counting_the_whole_copies_on_every_rank_would_clip_differently(
    one_process_gpt, monkeypatch
):
    monkeypatch.setattr(TensorParallelGradients, "uncounted", lambda self: set())
    result = run(2, **{**GPT, "max_grad_norm": 0.05, "tp": 2})[0]
    name = "1.attn.c_attn.weight"
    assert not np.allclose(
        result["master_weights"][name], one_process_gpt["master_weights"][name], rtol=1e-5
    )


def _fp8_state(world_size, **flags):
    """Every rank's fp8 scaling state after one step (delayed scaling)."""
    config = TrainConfig(**{**GPT, "precision": "fp8", "steps": 1, **flags})
    config.validate(world_size)

    def body(comm):
        from minimp.train.loop import Run

        run = Run(config, comm, log=lambda line: None)
        run.step(1)
        return run.fp8.state_arrays()

    with backend.limit_cpu_threads(1):
        return dist.simulate(world_size, body)


def test_fp8_scales_are_the_one_process_scales_on_every_shard():
    """A shard's amax is part of the whole tensor's: MAX-reduced over the stage's ranks, the
    weights' scales (computed from the same float32 masters) are one process's, bit for bit."""
    (whole,) = _fp8_state(1)
    shards = _fp8_state(2, tp=2)
    for key in whole:
        if "weight" in key:
            assert all(state[key].tobytes() == whole[key].tobytes() for state in shards), key
    assert all(state.keys() == whole.keys() for state in shards)


def test_without_the_amax_agreement_the_shards_scales_part(monkeypatch):
    monkeypatch.setattr(amax.AmaxReduction, "__call__", lambda self, amaxes: amaxes)
    first, second = _fp8_state(2, tp=2)
    assert first["fp8/1.attn.c_attn.weight/scale"] != second["fp8/1.attn.c_attn.weight/scale"]


def test_check_replicas_catches_whole_copies_that_drifted_apart(monkeypatch):
    run(2, **{**GPT, "tp": 2, "check_replicas": 1})  # the copies agree: nothing raised
    original = TensorParallelGradients.reduce

    def drift(self, gradients, like=()):
        original(self, gradients, like)
        if self.comm.rank == 1:
            gradients[self.replicated[0]] += 1.0  # one copy's gradient changes on one rank

    monkeypatch.setattr(TensorParallelGradients, "reduce", drift)
    with pytest.raises(ReplicaMismatchError, match="tensor-parallel rank"):
        run(2, **{**GPT, "tp": 2, "check_replicas": 1})


def test_a_tp_checkpoint_resumes_on_one_process_and_back(tmp_path, one_process_gpt):
    common = {**GPT, "max_grad_norm": 0.05}
    half, whole = str(tmp_path / "half.npz"), str(tmp_path / "whole.npz")
    run(2, **{**common, "steps": 2}, tp=2, sequence_parallel=True, save=half)
    resumed = run(1, **common, resume=half)[0]
    assert_same_masters(resumed, one_process_gpt)
    run(1, **{**common, "steps": 2}, save=whole)
    resumed = run(4, **common, resume=whole, tp=2, dp=2, zero=2)[0]
    assert_same_masters(resumed, one_process_gpt)


def test_a_checkpoint_array_that_does_not_split_is_refused_naming_it(tmp_path):
    path = tmp_path / "one.npz"
    run(1, **{**GPT, "steps": 1, "save": str(path)})
    with np.load(path) as archive:
        arrays = {name: archive[name] for name in archive.files}
    arrays["master/1.attn.c_attn.weight"] = arrays["master/1.attn.c_attn.weight"][:-1]
    np.savez(path, **arrays)
    message = r"c_attn.weight has shape \(95, 32\), which does not split"
    with pytest.raises(Exception, match=message):
        run(2, **{**GPT, "tp": 2, "resume": str(path)})


def test_the_timeline_names_every_rank_by_its_place_and_draws_shard_0(tmp_path):
    from minimp.measure.trace import read_timeline

    path = tmp_path / "timeline.json"
    run(4, **{**GPT, "steps": 2}, tp=2, pp=2, micro_batches=2, timeline=str(path))
    timeline = read_timeline(str(path))
    assert timeline["replica_0_ranks"] == [0, 2] and timeline["tensor_parallel"] == 2
    assert len(timeline["events"]) == 2 * 2 * 2 * 2  # steps x stages x micro-batches x kinds


REFUSED = [
    ({**GPT, "tp": 3}, 3, "--heads 4 does not divide by 3"),
    (
        {**GPT, "tp": 2, "context": 15, "sequence_parallel": True},
        2,
        "--context 15 does not divide by 2",
    ),
    ({**GPT, "sequence_parallel": True}, 1, "--sequence-parallel splits the sequence over"),
    ({**MLP, "sequence_parallel": True, "tp": 2}, 2, "it needs the GPT (--dataset shakespeare)"),
    ({**MLP, "layers": 3, "tp": 2}, 2, "--layers 3 is odd (use an even --layers)"),
    ({**MLP, "hidden": 33, "tp": 2}, 2, "33 features, which do not divide by 2"),
    ({**MLP, "tp": 2}, 3, "--tp 2 x --pp 1 does not divide the 3 ranks of this job"),
    ({**MLP, "tp": 2, "dp": 1}, 4, "--dp 1 does not match the 4 ranks of this job (use --dp 2"),
    ({**MLP, "tp": 2, "pp": 3}, 6, "--pp 3 needs at least 3 layers with weights, the model has 2"),
    ({**MLP, "tp": 0}, 1, "--tp must be a positive integer"),
    ({**MLP, "sequence_parallel": "yes"}, 1, "--sequence-parallel is a switch"),
]


@pytest.mark.parametrize(
    "flags, world_size, message",
    REFUSED,
    ids=["heads", "context", "sp-without-tp", "sp-mlp", "odd-layers", "hidden", "ranks", "dp",
         "pp-pairs", "tp-0", "sp-yes"],
)  # fmt: skip
def test_tensor_parallel_flags_that_cannot_work_are_refused_before_any_work(
    flags, world_size, message
):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        TrainConfig(**flags).validate(world_size)
