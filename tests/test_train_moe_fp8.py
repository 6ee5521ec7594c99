"""The mixture of experts in fp8: the router stays float32, an expert no row reached keeps a finite
scale by the recipe's rule for amax 0, and delayed scaling with --dp and --ep routes as one process,
ends at its weights and keeps its scales on every rank, experts included."""

import numpy as np
import pytest
import test_train_moe

from minimp import backend, nn
from minimp import distributed as dist
from minimp.models.moe import MoE
from minimp.parallel.expert import dispatch_bytes
from minimp.precision import DelayedScaling, Float8CurrentScaling, update_scales
from minimp.tensor import Tensor
from minimp.train import TrainConfig
from minimp.train.loop import Run

TINY = dict(test_train_moe.TINY, precision="fp8", optimizer="sgd", lr=0.5)  # SGD: test_train_moe


def run_steps(world_size, **overrides):
    """Every rank's ({name: master} of what it holds, fp8 state arrays, metrics rows) after the
    run's steps, on the simulated world."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        for step in range(run.start_step + 1, config.steps + 1):
            run.step(step)
        masters = {name: master.copy()
                   for name, master in zip(run.names, run.optimizer.master_weights)}
        state = run.fp8.state_arrays() if run.fp8 is not None else {}  # {} in bf16
        return masters, state, [row for row in run.history.records if "step" in row]

    with backend.limit_cpu_threads(1):
        return dist.simulate(world_size, body, eager_limit=0)


@pytest.fixture
def float32_activations(monkeypatch):
    """fp8 runs keep bf16 activations, and bf16 alone parts --dp 2 from one process by 2,500x
    the tolerance after 3 steps (each replica rounds its partial weight gradients to bf16 before
    the all-reduce sums them; measured on this model with --precision bf16). float32 activations
    leave what these tests are about: the fp8 products, their scales and the amaxes' agreement."""
    monkeypatch.setattr(TrainConfig, "activation_dtype", lambda self: np.dtype(np.float32))


@pytest.fixture(scope="module")
def one_process_delayed():
    """One process's delayed-scaling run with float32 activations (run once for the layouts)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(TrainConfig, "activation_dtype", lambda self: np.dtype(np.float32))
        return run_steps(1)[0]


LAYOUTS = [pytest.param(dict(dp=2, ep=2), id="dp 2 ep 2"),
           pytest.param(dict(dp=2), id="dp 2", marks=pytest.mark.slow),
           pytest.param(dict(dp=4, ep=2), id="dp 4 ep 2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_delayed_fp8_routes_as_one_process_and_ends_at_its_weights_and_scales(
        float32_activations, one_process_delayed, layout):
    """Routing first, then the weights after 3 steps, then every rank's fp8 state: every rank
    keeps every Linear's, experts it does not hold included (their amaxes agree over the stage,
    where non-holders record 0), equal to one process's; output gradients' amaxes dp times one
    process's and their scales 1/dp times (each replica's loss is the mean over its own rows)."""
    one_masters, one_state, one_rows = one_process_delayed
    dp = layout["dp"]
    results = run_steps(dp, **layout)
    for masters, state, records in results:
        for first, second in zip(one_rows, records, strict=True):
            assert first["expert_load_by_block"] == second["expert_load_by_block"]
            assert first["dropped_tokens"] == second["dropped_tokens"]
        for name, array in masters.items():  # rtol 1e-5, atol 1e-7
            np.testing.assert_allclose(array, one_masters[name], rtol=1e-5, atol=1e-7,
                                       err_msg=f"{layout} {name}")
        assert state.keys() == one_state.keys()
        assert not any("router" in key for key in state)  # the router has no fp8 state
        for key, array in state.items():
            factor = dp if ".grad_output/" in key else 1
            expected = one_state[key] * (factor if key.endswith("amax_history") else 1 / factor)
            np.testing.assert_allclose(array, expected, rtol=1e-5, atol=0, err_msg=key)
    held = [{name for name in masters if ".experts." in name} for masters, _, _ in results]
    ep = layout.get("ep", 1)
    assert all(held[rank] != held[(rank + 1) % dp] for rank in range(dp)) == (ep > 1)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["delayed", "current"])
@pytest.mark.parametrize("layout", [dict(dp=2, ep=2), dict(dp=4, ep=2)], ids=str)
def test_bf16_fp8_replicas_agree_and_the_rows_travel_in_bf16(recipe, layout):
    """--precision fp8 as the command runs it (bf16 activations): --check-replicas 1 raises on any
    drift of the dense masters over the replicas, of the experts' over their expert group, or of
    the fp8 state; routing equals one process's at step 1 (the same weights); the dispatched rows
    are the activations, bf16, 2 bytes an element (the experts' Linears quantize on arrival)."""
    one = run_steps(1, fp8_recipe=recipe, steps=1)[0]
    results = run_steps(layout["dp"], **layout, fp8_recipe=recipe, check_replicas=1)
    assert results[0][2][0]["expert_load"] == one[2][0]["expert_load"]
    for row in results[0][2]:
        assert row["bytes_by_group"]["expert_parallel"] == dispatch_bytes(
            row["expert_dispatches"], row["expert_rows_sent"], row["expert_rows_received"],
            TINY["experts"], layout["ep"], TINY["hidden"] * 2)


def starved_moe(recipe):
    """A 4-expert mixture whose router never picks expert 3 (positive inputs: expert 3's logits
    are negative, the others' positive), in fp8, every Linear given an Fp8Meta (the router too)."""
    rng = np.random.default_rng(0)
    moe = MoE(width=8, experts=4, top_k=2, capacity_factor=0.0, hidden=16, bias=True,
              dropout=nn.Dropout(0.0), rng=rng).to(np.float32)
    moe.router.weight.data[:3], moe.router.weight.data[3] = 0.1, -0.1
    nn.enable_fp8(moe, recipe)
    x = Tensor(np.abs(rng.standard_normal((2, 5, 8))).astype(np.float32), requires_grad=True)
    return moe, x


def step(moe, x):
    """One forward and backward, then every quantizer's next scale (one process: no reduction)."""
    moe(x).sum().backward()
    assert moe.routing is not None and 3 not in moe.routing.experts
    update_scales([quantizer for _, quantizer in nn.fp8_quantizers(moe)])


def test_an_expert_no_row_reached_keeps_its_delayed_scales_and_the_router_stays_float32():
    """Delayed scaling's rule for amax 0, for the input and output gradient of an expert no row
    reached: the scale stays what the history's largest amax gave (here max / 3.5 from an earlier
    step: 128 for E4M3, 16384 for E5M2), and stays when only zeros remain. The router's Linear
    has an Fp8Meta here (enable_fp8 gives every Linear one) and never quantizes through it."""
    moe, x = starved_moe(DelayedScaling(amax_history_len=2))
    metas = [moe.experts[3].c_fc.fp8_meta, moe.experts[3].c_proj.fp8_meta]
    starved = [quantizer for meta in metas for quantizer in (meta.input, meta.grad_output)]
    for quantizer in starved:
        quantizer.amax_history[:] = [3.5, 0.0]
        quantizer.scale = np.float32(quantizer.fmt.max) / np.float32(3.5)  # 128 or 16384
    for expected_history in ([0.0, 3.5], [0.0, 0.0]):
        step(moe, x)
        for quantizer in starved:
            assert quantizer.count == 0 and quantizer.amax_history.tolist() == expected_history
            assert quantizer.scale == np.float32(quantizer.fmt.max) / np.float32(3.5)
    weight = moe.experts[3].c_fc.fp8_meta.weight  # the weights are there, rows or not
    assert weight.amax_history[0] > 0 and np.isfinite(weight.scale)
    router = moe.router.fp8_meta
    assert router is not None and all(q.count == 0 and q.scale == 1 for _, q in
                                      router.quantizers())
    assert moe.router_logits is not None and moe.router_logits.dtype == np.float32
    assert moe.experts[0].c_fc.fp8_meta.input.scale != 1  # the others did quantize


def test_an_expert_no_row_reached_gets_current_scalings_scale_1():
    """Current scaling's rule for amax 0 (TE's): scale 1, finite, for the empty tensor."""
    moe, x = starved_moe(Float8CurrentScaling())
    step(moe, x)
    for linear in (moe.experts[3].c_fc, moe.experts[3].c_proj):
        for quantizer in (linear.fp8_meta.input, linear.fp8_meta.grad_output):
            assert quantizer.scale == np.float32(1.0) and quantizer.count == 0
    assert moe.experts[0].c_fc.fp8_meta.input.scale != 1


@pytest.mark.slow
def test_an_ep_fp8_run_resumes_bit_identical(tmp_path):
    """Replica 0 writes every expert's scaling state (every rank keeps it), and every rank of
    --dp 2 --ep 2 resumes from it: the masters, the fp8 state and the rows as if never stopped."""
    path, layout = str(tmp_path / "half.npz"), dict(dp=2, ep=2, steps=4, lr_decay_steps=4)
    straight = run_steps(2, **layout, save=path, save_every=2)
    resumed = run_steps(2, **layout, resume=path)
    with np.load(path) as checkpoint:
        assert any(".experts.3." in name for name in checkpoint.files if name.startswith("fp8/"))
    for (masters, state, rows), (masters_0, state_0, rows_0) in zip(resumed, straight):
        assert [(r["loss"], r["fp8"]) for r in rows] == [(r["loss"], r["fp8"]) for r in rows_0[2:]]
        assert all(masters[name].tobytes() == masters_0[name].tobytes() for name in masters_0)
        assert state.keys() == state_0.keys()
        assert all(state[key].tobytes() == state_0[key].tobytes() for key in state_0)
