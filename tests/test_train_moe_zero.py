"""ZeRO 1-3 with the mixture of experts, on the simulated world: with --dp (the experts sharded over
the replicas) and with --ep (the dense parameters over the replicas, the experts over the dp/ep
replicas holding the same ones), every layout routes as one process (asserted first), ends at its
weights after 3 steps, holds memory_by_kind and sends zero_bytes_sent
(minimp/parallel/expert/layout.py) every step; fp16's skip is one decision for the job; a
--dp 4 --ep 2 --zero 3 checkpoint is the one-process format both ways; fp8 composes."""

import numpy as np
import pytest
from test_train_moe import TINY, rows, simulated

from minimp import distributed as dist
from minimp.parallel.expert import memory_by_kind, zero_bytes_sent
from minimp.train import TrainConfig, train
from minimp.train.sizes import expert_unit_sizes, zero_unit_sizes
from minimp.train.tasks import ShakespeareTask

SGD = dict(optimizer="sgd", lr=0.5)  # not Adam: tests/test_train_moe.py says why


@pytest.fixture(scope="module")
def one_process():
    return simulated(1, **SGD)


def units(ep, sizes=TINY):
    """(dense units, expert units, readers of each dense unit) of a GPT (TINY by default) on one
    rank: zero_unit_sizes's [wte, wpe, block, block, ln_f] with each block's E experts taken out,
    and E/ep experts a unit per block; the head reads wte too. Without --ep the experts travel
    with the replicas: one list, each block's experts right after its dense unit."""
    config = TrainConfig(**{**TINY, **sizes})
    model = ShakespeareTask(config, np.float32).build_model(np.random.default_rng(0))
    per_expert = sum(p.size for p in model.layers[1].mlp.experts[0].parameters())
    experts, layers = config.experts, config.layers
    wte, wpe, *blocks, ln_f = zero_unit_sizes(config)[0]
    assert len(blocks) == layers
    dense = [wte, wpe, *(block - experts * per_expert for block in blocks), ln_f]
    held = [experts // ep * per_expert] * layers
    if ep > 1:  # what the pre-run memory check sizes (train/sizes.py) is the trainer's too
        split = TrainConfig(**{**TINY, **sizes, "ep": ep, "dp": ep})
        assert (zero_unit_sizes(split, experts_apart=True)[0], expert_unit_sizes(split)[0]) == (
            dense, held)
        return dense, held, [2] + [1] * (len(dense) - 1)
    mixed = [wte, wpe, *(size for block, own in zip(dense[2:-1], held) for size in (block, own)),
             ln_f]
    return mixed, [], [2] + [1] * (len(mixed) - 1)


def assert_as_one_process(one, other):
    """Routing first (every step's load and drops), then the weights after 3 steps."""
    for first, second in zip(rows(one), rows(other), strict=True):
        assert first["expert_load_by_block"] == second["expert_load_by_block"]
        assert first["dropped_tokens"] == second["dropped_tokens"]
    assert other["master_weights"].keys() == one["master_weights"].keys()
    for name, array in one["master_weights"].items():  # rtol 1e-5, atol 1e-7
        np.testing.assert_allclose(other["master_weights"][name], array, rtol=1e-5, atol=1e-7,
                                   err_msg=name)


def run_all_ranks(world_size, **overrides):
    """Every rank's result of a training run on the simulated world."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)
    return dist.simulate(world_size, lambda comm: train(config, lambda line: None, comm=comm),
                         eager_limit=0)


def layout_case(zero, dp, ep=1, slow=True, **flags):
    name = f"zero {zero} dp {dp}" + (f" ep {ep}" if ep > 1 else "")
    name += "".join(f" {key}={value}" for key, value in flags.items())
    return pytest.param(dict(zero=zero, dp=dp, ep=ep, **flags), id=name,
                        marks=pytest.mark.slow if slow else ())


LAYOUTS = [
    layout_case(1, 4, 2, slow=False),  # both groups of two: dense over 4, experts over 2
    layout_case(1, 2),  # every rank holds every expert: the experts sharded over the replicas
    layout_case(2, 2, micro_batches=2, overlap=False),  # (the experts' units wait for backward)
    layout_case(1, 2, 2),  # the issue's: ep = dp, the experts' group is the rank alone
    layout_case(2, 4, 2),
    layout_case(2, 4, 2, overlap=False),
    layout_case(3, 4, 2),
    layout_case(3, 2, 2),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_zero_with_experts_routes_and_ends_as_one_process_with_the_formulas_bytes_and_memory(
        one_process, layout):
    """Every rank: memory by kind == memory_by_kind, every step's bytes by collective and by
    group (data_parallel, expert_data_parallel) == zero_bytes_sent."""
    results = run_all_ranks(layout["dp"], **SGD, **layout)
    assert_as_one_process(one_process, results[0])
    zero, dp, ep = layout["zero"], layout["dp"], layout["ep"]
    dense, experts, readers = units(ep)
    for rank, result in enumerate(results):
        expected = memory_by_kind(dense, experts, dp, ep, rank, compute_bytes=4, slots=1,
                                  zero=zero)
        assert result["model_state_by_kind"][rank] == expected, rank
        sent = zero_bytes_sent(zero, dense, experts, dp, ep, rank, compute_bytes=4,
                               micro_batches=layout.get("micro_batches", 1), wire_bytes=4,
                               readers=readers)
        expert_sent = sum(count for name, count in sent.items() if name.startswith("expert_"))
        for row in rows(result):
            measured = row["bytes_by_collective"]
            assert {name: measured.get(name, 0) for name in sent} == sent, (rank, row["step"])
            assert row["bytes_by_group"]["data_parallel"] == sum(sent.values()) - expert_sent
            assert row["bytes_by_group"].get("expert_data_parallel", 0) == expert_sent
        assert (expert_sent > 0) == (1 < ep < dp)


COMPOSED = [dict(dp=2, pp=2, zero=1), dict(dp=2, pp=2, ep=2, zero=0),
            dict(dp=2, pp=2, ep=2, zero=3), dict(dp=2, ep=2, zero=3, recompute=True)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", COMPOSED, ids=[str(layout) for layout in COMPOSED])
def test_zero_with_experts_composes_with_the_pipeline_and_recomputation(one_process, layout):
    """Each stage's units over its own replicas (and expert group); stage 3 gathers a block's
    units again when --recompute reruns its forward. Every rank's memory by kind ==
    memory_by_kind of its stage's units, as the pre-run check sizes them (train/sizes.py)."""
    dp, ep = layout["dp"], layout.get("ep", 1)
    results = run_all_ranks(dp * layout.get("pp", 1), **SGD, **layout)
    assert_as_one_process(one_process, results[0])
    config = TrainConfig(**{**TINY, **layout})
    dense, experts = zero_unit_sizes(config, experts_apart=True), expert_unit_sizes(config)
    for rank, result in enumerate(results):  # rank = stage x dp + replica (tp = 1)
        stage, replica = divmod(rank, dp)
        expected = memory_by_kind(dense[stage], experts[stage], dp, ep, replica, compute_bytes=4,
                                  slots=1, zero=layout["zero"])
        assert result["model_state_by_kind"][rank] == expected, rank


@pytest.mark.slow
def test_an_fp16_overflow_on_one_rank_skips_the_step_on_every_rank():
    """--dp 4 --ep 2 --zero 2: rank 3's gradients alone turn non-finite at step 2 (an expert's
    copy is in only half the replicas' hands); every rank skips it and halves the scale."""
    results = run_all_ranks(4, precision="fp16", dp=4, ep=2, zero=2, inject_overflow="2:3")
    for result in results:
        assert [row["skipped"] for row in rows(result)] == [False, True, False]
        assert ([row["loss_scale"] for row in rows(result)]
                == [row["loss_scale"] for row in rows(results[0])])


@pytest.mark.slow
def test_a_zero_3_ep_checkpoint_is_the_one_process_format_both_ways(tmp_path):
    """--dp 4 --ep 2 --zero 3 stitches every expert into its checkpoint (each expert group, then
    replica 0's ep group), and reads one process's: each resumes where the other would have
    gone (SGD's momentum slots included)."""
    layout = dict(dp=4, ep=2, zero=3)
    one_path, sharded_path = str(tmp_path / "one.npz"), str(tmp_path / "sharded.npz")
    simulated(1, **SGD, steps=1, save=one_path)
    simulated(4, **SGD, **layout, steps=1, save=sharded_path)
    reference = simulated(1, **SGD, resume=one_path)["master_weights"]
    with np.load(one_path) as whole, np.load(sharded_path) as sharded:
        assert sorted(sharded.files) == sorted(whole.files)
    for world, flags, path in ((4, layout, one_path), (1, {}, sharded_path)):
        resumed = simulated(world, **SGD, **flags, resume=path)["master_weights"]
        assert resumed.keys() == reference.keys()
        for name, array in reference.items():
            np.testing.assert_allclose(resumed[name], array, rtol=1e-5, atol=1e-7, err_msg=name)


@pytest.mark.slow
def test_delayed_fp8_with_zero_3_and_ep_ends_as_one_process(monkeypatch):
    """fp8 (delayed) composes: --dp 4 --ep 2 --zero 3 routes as one process and ends at its
    weights, with float32 activations (tests/test_train_moe_fp8.py says why: bf16 activations
    alone part replicas from one process)."""
    monkeypatch.setattr(TrainConfig, "activation_dtype", lambda self: np.dtype(np.float32))
    fp8 = dict(SGD, precision="fp8")
    assert_as_one_process(simulated(1, **fp8), simulated(4, **fp8, dp=4, ep=2, zero=3))
