"""The mixture of experts through the training command: --dp 2 and micro-batches end at the
one-process weights, the logged loss stays the cross-entropy, the metrics, 16-bit runs, refusals."""

import subprocess

import numpy as np
import pytest
from conftest import PYTHON

from minimp import distributed as dist
from minimp import export, sample
from minimp.checkpoints.errors import ConfigError
from minimp.models.moe import MoE
from minimp.tensor import Tensor
from minimp.train import TrainConfig, train
from minimp.train.loop import Run
from minimp.train.cli import parse_config
from minimp.parallel.expert import (DispatchCounts, dispatch_bytes, held_parameters,
                                   memory_by_kind)
from minimp.train.sizes import parameter_count
from minimp.train.tasks import ShakespeareTask

TINY = dict(dataset="shakespeare", layers=2, hidden=16, heads=2, context=8, batch_size=4, steps=3,
            warmup=1, precision="fp32", eval_every=0, log_every=1000, experts=4, top_k=2)


def simulated(world_size, **overrides):
    """Rank 0's result of a training run on the simulated world."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)
    return dist.simulate(world_size, lambda comm: train(config, lambda line: None, comm=comm),
                         eager_limit=0)[0]


def rows(result):
    return [row for row in result["history"] if "step" in row]


@pytest.mark.parametrize("capacity_factor", [
    pytest.param(0.0, id="dropless"),
    # (slow: the default tier drops pairs in the --pp and --recompute test, at capacity 1.0)
    pytest.param(1.0, id="capacity 1.0", marks=pytest.mark.slow)])
def test_dp_2_and_micro_batches_end_at_the_one_process_weights(capacity_factor):
    """A routing group is one sample, so every layout routes (and drops) as one process does.

    SGD (lr 0.5, momentum 0.9), not Adam: Adam divides by sqrt(v), so an expert weight whose
    gradient cancels to ~1e-8 (a few tokens reached it) moves by ~lr whatever its last bits,
    and the summation order a layout changes then decides them (measured: 3-30x the tolerance
    after 3 steps, while float64 gradients agree to 5e-16). SGD keeps the comparison about the
    gradients. (It caught an expert no token reached on one replica: no gradient there.)"""
    sgd = dict(optimizer="sgd", lr=0.5, capacity_factor=capacity_factor)
    one = simulated(1, **sgd)
    for layout in (dict(dp=2), dict(micro_batches=2)):
        other = simulated(layout.get("dp", 1), **sgd, **layout)
        for name, array in one["master_weights"].items():  # rtol 1e-5, atol 1e-7
            np.testing.assert_allclose(other["master_weights"][name], array, rtol=1e-5,
                                       atol=1e-7, err_msg=f"{layout} {name}")
        for first, second in zip(rows(one), rows(other)):
            assert first["expert_load_by_block"] == second["expert_load_by_block"]
            assert first["dropped_tokens"] == second["dropped_tokens"]
            assert np.isclose(first["aux_loss"], second["aux_loss"], rtol=1e-6)
    dropped = [row["dropped_tokens"] for row in rows(one)]
    assert (max(dropped) > 0) == bool(capacity_factor)


# The small fp32 MoE GPT, with SGD for the reason above.
# The small fp32 MoE GPT (slow tier), and TINY (4 samples: one per rank at --dp 4) for the
# default tier's --dp 4 --ep 2: both expert groups, the 1/dp of the expert gradients.
EP_SIZES = {"issue": dict(TINY, hidden=32, heads=4, context=16, batch_size=8),
            "tiny": dict(TINY)}
EP_LAYOUTS = [dict(dp=2, ep=2), dict(dp=4, ep=4), dict(dp=4, ep=2)]


@pytest.fixture(scope="module")
def one_process_ep():
    """One process's run of a size and capacity factor, each run once, shared by the layouts."""
    runs: dict[tuple[str, float], dict] = {}

    def run(size, capacity_factor):
        if (size, capacity_factor) not in runs:
            runs[size, capacity_factor] = simulated(1, **EP_SIZES[size], optimizer="sgd", lr=0.5,
                                                    capacity_factor=capacity_factor)
        return runs[size, capacity_factor]

    return run


def ep_case(size, layout, capacity_factor):
    kind = "capacity 1.0" if capacity_factor else "dropless"
    name = f"{size} dp {layout['dp']} ep {layout['ep']} {kind}"
    return pytest.param(size, layout, capacity_factor, id=name,
                        marks=() if size == "tiny" else pytest.mark.slow)


EP_CASES = [ep_case("issue", layout, factor) for layout in EP_LAYOUTS for factor in (0.0, 1.0)]
EP_CASES += [ep_case("tiny", dict(dp=4, ep=2), 0.0)]


@pytest.mark.parametrize("size, layout, capacity_factor", EP_CASES)
def test_ep_routes_as_one_process_and_ends_at_its_weights(one_process_ep, size, layout,
                                                          capacity_factor):
    """Routing first (every step's load and drops: each rank routes its own samples, per sample),
    then the weights after 3 steps; every step's expert_parallel bytes == dispatch_bytes of the
    rank's rows (parallel/expert/dispatch.py), one dispatch per block; every rank's memory by kind
    == memory_by_kind (parallel/expert/layout.py)."""
    one, sizes = one_process_ep(size, capacity_factor), EP_SIZES[size]
    other = simulated(layout["dp"], **sizes, **layout, optimizer="sgd", lr=0.5,
                      capacity_factor=capacity_factor)
    for first, second in zip(rows(one), rows(other), strict=True):
        assert first["expert_load_by_block"] == second["expert_load_by_block"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
        assert np.isclose(first["aux_loss"], second["aux_loss"], rtol=1e-6)
    assert (max(row["dropped_tokens"] for row in rows(one)) > 0) == bool(capacity_factor)
    for name, array in one["master_weights"].items():  # rtol 1e-5, atol 1e-7
        np.testing.assert_allclose(other["master_weights"][name], array, rtol=1e-5, atol=1e-7,
                                   err_msg=f"{layout} {name}")
    ep, width, experts, layers = layout["ep"], sizes["hidden"], sizes["experts"], sizes["layers"]
    for row in rows(other):
        assert row["expert_dispatches"] == layers
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            experts, ep, width * 4)  # float32 rows of C
    config = TrainConfig(**sizes)
    model = ShakespeareTask(config, np.float32).build_model(np.random.default_rng(0))
    per_expert = sum(p.size for p in model.layers[1].mlp.experts[0].parameters())
    total = sum(p.size for p in model.parameters())
    dense = total - layers * experts * per_expert
    held = held_parameters(dense, per_expert, experts, layers, ep)
    for rank, kinds in enumerate(other["model_state_by_kind"]):
        expected = memory_by_kind([dense], [held - dense], layout["dp"], ep, rank, compute_bytes=4,
                                  slots=1)
        assert kinds == expected


@pytest.mark.slow
def test_an_ep_checkpoint_is_the_one_process_format_both_ways(tmp_path):
    """--dp 2 --ep 2 gathers every expert into its checkpoint, and reads one process's: each
    resumes where the other would have gone (SGD's momentum slots included)."""
    sgd, ep = dict(optimizer="sgd", lr=0.5), dict(dp=2, ep=2)
    one_path, ep_path = str(tmp_path / "one.npz"), str(tmp_path / "ep.npz")
    simulated(1, **sgd, steps=1, save=one_path)
    simulated(2, **sgd, **ep, steps=1, save=ep_path)
    reference = simulated(1, **sgd, resume=one_path)["master_weights"]
    for world, layout, path in ((2, ep, one_path), (1, {}, ep_path)):
        resumed = simulated(world, **sgd, **layout, resume=path)["master_weights"]
        assert resumed.keys() == reference.keys()
        for name, array in reference.items():
            np.testing.assert_allclose(resumed[name], array, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_fp16_skips_agree_on_every_rank_with_ep_and_the_rows_travel_in_fp16():
    """An overflow injected on rank 1 at step 2 skips that step on both ranks (one decision for
    the job); the dispatched rows are float16, 2 bytes an element."""
    config = TrainConfig(**{**TINY, "precision": "fp16", "dp": 2, "ep": 2,
                            "inject_overflow": "2:1"})
    config.validate(2)
    results = dist.simulate(2, lambda comm: train(config, lambda line: None, comm=comm),
                            eager_limit=0)
    skipped = [[row["skipped"] for row in rows(result)] for result in results]
    assert skipped[0] == skipped[1] and skipped[0][1]
    for row in rows(results[0]):
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            TINY["experts"], 2, TINY["hidden"] * 2)


# --pp (every schedule, with the micro-batches each needs), --recompute, and both with --ep. The
# auxiliary losses weigh more than by default (and the z-loss joins) so that their gradient
# moves the weights beyond the tolerance (asserted: a run without them ends elsewhere); capacity
# 1.0, so the drops each stage counts are summed too.
AUX = dict(optimizer="sgd", lr=0.5, aux_loss_coef=0.1, router_z_loss_coef=0.01,
           capacity_factor=1.0)
PP_LAYOUTS = [
    ("tiny", dict(pp=2, micro_batches=2)),  # 1f1b, the default schedule (default tier)
    ("tiny", dict(pp=2, micro_batches=2, schedule="gpipe")),
    ("tiny", dict(pp=2, micro_batches=2, schedule="interleaved", virtual_stages=2)),
    ("tiny", dict(pp=2, micro_batches=4, schedule="zb-h1")),  # the router's gradient in W
    ("tiny", dict(pp=4, micro_batches=4)),  # embeddings, block, block, head: two without one
    ("issue", dict(dp=2, pp=2, ep=2)),  # the issue's
    ("issue", dict(dp=2, pp=2, ep=2, micro_batches=2, schedule="interleaved", virtual_stages=2)),
    ("tiny", dict(recompute=True)),
    ("tiny", dict(recompute=True, pp=2, micro_batches=2)),
    ("issue", dict(recompute=True, dp=2, ep=2, eval_every=1, eval_batches=1)),  # + evaluations
]


def simulated_ranks(world_size, **overrides):
    """Every rank's result of a training run on the simulated world."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)
    return dist.simulate(world_size, lambda comm: train(config, lambda line: None, comm=comm),
                         eager_limit=0)


@pytest.fixture(scope="module")
def one_process_aux():
    """One process's run of a size, with and without the auxiliary losses, each run once."""
    runs: dict[tuple[str, bool], dict] = {}

    def run(size, aux=True):
        if (size, aux) not in runs:
            losses = {} if aux else dict(aux_loss_coef=0.0, router_z_loss_coef=0.0)
            runs[size, aux] = simulated(1, **{**EP_SIZES[size], **AUX, **losses})
        return runs[size, aux]

    return run


def pp_case(size, layout):
    default = layout == dict(pp=2, micro_batches=2)
    name = " ".join(f"{k} {v}" for k, v in layout.items() if not k.startswith("eval"))
    return pytest.param(size, layout, id=name,
                        marks=() if default else pytest.mark.slow)


@pytest.mark.parametrize("size, layout", [pp_case(*case) for case in PP_LAYOUTS])
def test_pp_and_recompute_route_as_one_process_and_end_at_its_weights(one_process_aux, size,
                                                                      layout):
    """Each mixture attaches its auxiliary losses to its own output's graph (models/moe.py), so
    their gradient flows on every stage, in every schedule's order and through the recomputed
    forward. Routing first: rank 0's row equals one process's (each stage counts its blocks, the
    meter sums the job); then the weights after 3 steps, which the run without the auxiliary
    losses misses (so this test sees a lost aux gradient); with --ep every rank's bytes equal
    dispatch_bytes, the forwards without a graph (--recompute's first) counted apart, and the
    evaluations between steps (without a graph too) in neither."""
    one, sizes = one_process_aux(size), EP_SIZES[size]
    world = layout.get("dp", 1) * layout.get("pp", 1)
    ranks = simulated_ranks(world, **{**sizes, **AUX, **layout})
    for first, second in zip(rows(one), rows(ranks[0]), strict=True):
        assert first["expert_load_by_block"] == second["expert_load_by_block"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
        assert np.isclose(first["aux_loss"], second["aux_loss"], rtol=1e-6)
    assert max(row["dropped_tokens"] for row in rows(one)) > 0
    without = one_process_aux(size, aux=False)["master_weights"]
    assert any(not np.allclose(without[name], array, rtol=1e-5, atol=1e-7)
               for name, array in one["master_weights"].items())
    for name, array in one["master_weights"].items():  # rtol 1e-5, atol 1e-7
        np.testing.assert_allclose(ranks[0]["master_weights"][name], array, rtol=1e-5,
                                   atol=1e-7, err_msg=f"{layout} {name}")
    if "ep" not in layout:
        return
    blocks = sizes["layers"] // layout.get("pp", 1)  # the mixtures of a stage
    forwards_without = blocks if layout.get("recompute") else 0
    for result in ranks:
        for row in rows(result):
            assert row["expert_dispatches"] == blocks * layout.get("micro_batches", 1)
            without_graph = DispatchCounts(
                row.get("expert_forward_only_dispatches", 0),
                row.get("expert_forward_only_rows_sent", 0),
                row.get("expert_forward_only_rows_received", 0))
            assert without_graph.calls == forwards_without
            if forwards_without:  # the rerun sends the rows the first forward sent
                assert without_graph.rows_sent == row["expert_rows_sent"]
            assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
                row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
                sizes["experts"], layout["ep"], sizes["hidden"] * 4, without_graph)


def test_the_loop_gives_every_mixture_the_gradient_the_root_gives_the_loss():
    """fp16 (a loss scale S) over 2 micro-batches with --dp 2 --ep 2: each mixture of the trained
    copy (--ep's) reads grad_scale = S / 2, the gradient backward from _scale_loss's root gives
    the loss, which the auxiliary losses then get (models/moe.py's AttachAuxLoss)."""
    config = TrainConfig(**{**TINY, "precision": "fp16", "micro_batches": 2, "dp": 2, "ep": 2})
    config.validate(2)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        run._tell_aux_losses()
        loss = Tensor(np.ones((), np.float32), requires_grad=True)
        run._scale_loss(loss).backward()
        mixtures = [m for m in run.share.trained.modules() if isinstance(m, MoE)]
        assert run.share.trained is not run.model and len(mixtures) == TINY["layers"]
        return float(loss.grad), [m.aux_weights.grad_scale for m in mixtures], run.scaler

    for grad, scales, scaler in dist.simulate(2, body, eager_limit=0):
        assert scaler.loss_scale > 1 and scales == [grad] * 2 == [scaler.loss_scale / 2] * 2


@pytest.mark.slow
def test_fp16_skips_agree_on_every_stage_with_experts():
    """An overflow injected on rank 1 (the last stage) at step 2 skips that step on both stages;
    the other steps train (the aux losses' gradient carries the loss scale: finite weights)."""
    results = simulated_ranks(2, precision="fp16", pp=2, micro_batches=2, inject_overflow="2:1")
    skipped = [[row["skipped"] for row in rows(result)] for result in results]
    assert skipped[0] == skipped[1] == [False, True, False]
    assert all(np.isfinite(array).all() for array in results[0]["master_weights"].values())


@pytest.mark.parametrize("expert_hidden", [0, 24])
def test_the_memory_check_counts_the_experts_parameters(expert_hidden):
    config = TrainConfig(**{**TINY, "expert_hidden": expert_hidden})
    model = ShakespeareTask(config, np.float32).build_model(np.random.default_rng(0))
    assert parameter_count(config) == sum(p.size for p in model.parameters())


def test_the_logged_loss_is_the_cross_entropy_and_the_aux_loss_trains_the_router():
    """Step 1 starts from the same weights, so its loss is the same bits with and without the
    auxiliary loss; the weights it reaches differ (the aux gradient reached the router)."""
    with_aux, without = simulated(1), simulated(1, aux_loss_coef=0.0)
    assert rows(with_aux)[0]["loss"] == rows(without)[0]["loss"]
    router = "1.mlp.router.weight"
    moved, kept = with_aux["master_weights"][router], without["master_weights"][router]
    assert not np.allclose(moved, kept, rtol=1e-6)
    row = rows(with_aux)[0]
    # every (token, choice) pair of every layer: 2 layers x 4 samples x 8 tokens x top-2
    assert sum(row["expert_load"]) == 2 * 4 * 8 * 2 and len(row["expert_load"]) == 4
    by_block = np.array(row["expert_load_by_block"])  # (2 blocks, 4 experts)
    assert by_block.shape == (2, 4) and by_block.sum(axis=0).tolist() == row["expert_load"]
    assert by_block.sum(axis=1).tolist() == [4 * 8 * 2] * 2
    assert row["expert_load_imbalance"] == max(load.max() / load.mean() for load in by_block)
    assert row["dropped_tokens"] == 0 and 2 * 0.99 < row["aux_loss"] < 2 * 4  # 2 layers, >= 1


@pytest.mark.parametrize("precision", ["fp16", pytest.param("bf16", marks=pytest.mark.slow)])
def test_16_bit_runs_train_with_a_float32_router(precision):
    result = simulated(1, precision=precision)
    assert all(np.isfinite(row["loss"]) for row in rows(result))


REFUSED = [
    (["--experts", "2", "--top-k", "3"], "--top-k 3 is more than --experts 2"),
    (["--experts", "2", "--top-k", "0"], "--top-k must be a positive integer, got 0"),
    (["--experts", "-1"], "--experts must be 0 or more, got -1"),
    (["--experts", "2", "--capacity-factor", "-1"], "--capacity-factor must be 0 or more"),
    (["--experts", "2", "--aux-loss-coef", "-0.1"], "--aux-loss-coef must be 0 or more"),
    (["--experts", "2", "--router-z-loss-coef", "nan"], "--router-z-loss-coef must be 0 or more"),
    (["--experts", "2", "--tp", "2"], "--experts with --tp 2: not built (minimp does not cut"),
    (["--experts", "2", "--cp", "2"], "--experts with --cp 2: not built (a routing group"),
    (["--dataset", "digits", "--experts", "2"], "--experts applies to the GPT"),
    (["--dp", "8", "--ep", "2"], "--ep 2 needs --experts"),
    (["--experts", "4", "--ep", "0"], "--ep must be a positive integer, got 0"),
    (["--experts", "6", "--dp", "8", "--ep", "3"], "--ep 3 does not divide --dp 8"),
    (["--experts", "6", "--dp", "8", "--ep", "4"], "--experts 6 is not divisible by --ep 4"),
]


@pytest.mark.parametrize("flags, message", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_bad_or_not_yet_composable_expert_flags_are_refused_before_any_work(flags, message):
    config = parse_config(["--dataset", "shakespeare", *flags], quiet=True)
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")) as error:
        config.validate(8)
    assert "\n" not in str(error.value)


def test_the_command_refuses_in_one_line():
    result = subprocess.run([PYTHON, "-m", "minimp.train", "--dataset", "shakespeare",
                             "--experts", "2", "--top-k", "3"], capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "--top-k 3 is more than --experts 2" in result.stderr and not result.stdout


@pytest.mark.slow
def test_a_moe_checkpoint_resumes_and_sample_and_export_refuse_it_in_one_line(tmp_path, capsys):
    path = str(tmp_path / "moe.npz")
    whole = simulated(1, steps=2)
    simulated(1, steps=1, save=path)
    resumed = simulated(1, steps=2, resume=path)
    for name, array in whole["master_weights"].items():
        np.testing.assert_array_equal(resumed["master_weights"][name], array, err_msg=name)
    capsys.readouterr()
    for main, argv in ((sample.main, ["--resume", path]),
                       (export.main, [path, str(tmp_path / "moe.safetensors")])):
        assert main(argv) == 2
        error = capsys.readouterr().err
        assert "a mixture of experts (--experts 4), which this command does not read yet" in error
        assert len(error.strip().splitlines()) == 1
