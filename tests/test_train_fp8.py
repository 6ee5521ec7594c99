"""--precision fp8 through the training command: replicas stay bit-identical because they agree on
the amax, each pipeline stage owns its layers' scaling state, resume is bit-identical, evaluation
changes nothing, the metrics and the plot show the scales, bad flags are one line."""

import json
import subprocess

import numpy as np
import pytest
import test_train_gpt
from conftest import PYTHON

from minimp import backend, nn
from minimp import distributed as dist
from minimp.parallel import amax
from minimp.train import TrainConfig
from minimp.train.cli import parse_config
from minimp.checkpoints.errors import AgreedError, ConfigError
from minimp.train.loop import Run
from minimp.train.sizes import fp8_history_bytes

TINY = {**test_train_gpt.TINY, "steps": 6, "precision": "fp8"}  # 2 blocks of width 32


def run_steps(world_size, **overrides):
    """Every rank's (masters, fp8 state arrays, metrics rows) after the run's steps, on the
    simulated world (every send waits for its receive)."""
    config = TrainConfig(**{**TINY, **overrides})
    config.validate(world_size)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        for step in range(run.start_step + 1, config.steps + 1):
            run.step(step)
        masters = [master.copy() for master in run.optimizer.master_weights]
        state = run.fp8.state_arrays() if run.fp8 is not None else {}
        return masters, state, run.history.records

    with backend.limit_cpu_threads(1):  # as train() limits them: tiny products, no contention
        return dist.simulate(world_size, body, eager_limit=0)


def same_bytes(first, second):
    """The same arrays, byte for byte."""
    pairs = zip(first, second)
    return len(first) == len(second) and all(a.tobytes() == b.tobytes() for a, b in pairs)


@pytest.mark.parametrize("layout", [dict(dp=2), dict(dp=2, pp=2, micro_batches=2)], ids=str)
def test_replicas_stay_bit_identical_scaling_state_included(layout):
    ranks = layout["dp"] * layout.get("pp", 1)
    results = run_steps(ranks, check_replicas=2, **layout)  # the check raises on any drift
    dp = layout["dp"]
    for rank in range(ranks):  # rank r is replica r % dp of stage r // dp (parallel/topology.py)
        masters, state, _ = results[rank]
        first_masters, first_state, _ = results[rank - rank % dp]  # replica 0 of its stage
        assert same_bytes(masters, first_masters)
        assert state.keys() == first_state.keys() and same_bytes(
            list(state.values()), [first_state[key] for key in state]
        )


def test_without_the_amax_agreement_the_replicas_scaling_state_drifts(monkeypatch):
    """The agreement is what keeps the replicas' scales equal: each replica's own amaxes differ
    (its shard of the batch), so without it the states part after the first step."""
    monkeypatch.setattr(amax.AmaxReduction, "__call__", lambda self, amaxes: amaxes)
    (_, first, _), (_, second, _) = run_steps(2, dp=2, steps=2)
    differing = [key for key in first if first[key].tobytes() != second[key].tobytes()]
    assert any(key.endswith("input/scale") for key in differing)


def test_each_stage_owns_the_state_of_its_own_layers():
    """--pp 2 cuts the GPT as [embeddings, block 1] + [block 2, head]: each stage saves the
    quantizers of its own block only."""
    (_, first, _), (_, second, _) = run_steps(2, pp=2, micro_batches=2, steps=1)
    assert first and all(key.startswith("fp8/1.") for key in first)
    assert second and all(key.startswith("fp8/2.") for key in second)


@pytest.mark.parametrize("layout", [dict(), dict(pp=2, micro_batches=2)], ids=str)
def test_resuming_an_fp8_run_is_bit_identical(tmp_path, layout):
    ranks, path = layout.get("pp", 1), str(tmp_path / "half.npz")
    straight = run_steps(ranks, steps=8, lr_decay_steps=8, save=path, save_every=4, **layout)
    resumed = run_steps(ranks, steps=8, lr_decay_steps=8, resume=path, **layout)
    with np.load(path) as checkpoint:
        assert any(name.startswith("fp8/") for name in checkpoint.files)
    for (masters, state, rows), (masters_0, state_0, rows_0) in zip(resumed, straight):
        assert [(r["loss"], r["fp8"]) for r in rows] == [(r["loss"], r["fp8"]) for r in rows_0[4:]]
        assert same_bytes(masters, masters_0)
        assert same_bytes(list(state.values()), [state_0[key] for key in state])


def test_a_checkpoint_resumes_only_with_the_same_fp8_settings(tmp_path):
    path = str(tmp_path / "fp8.npz")
    run_steps(1, steps=2, save=path, save_every=1)
    with pytest.raises(AgreedError, match="trained with --fp8-amax-history 16, this run has"):
        run_steps(1, steps=3, resume=path, fp8_amax_history=4)
    bf16 = str(tmp_path / "bf16.npz")  # a bf16 checkpoint continues in fp8, its scales from 1
    run_steps(1, steps=2, precision="bf16", save=bf16, save_every=1)
    (_, _, rows), = run_steps(1, steps=3, resume=bf16)
    assert [r["step"] for r in rows] == [2, 3]
    assert {value["scale"] for value in rows[0]["fp8"].values()} == {1.0}


def test_a_skipped_step_still_records_its_amaxes():
    """Delayed scaling's history rolls every step, skipped or not (Transformer Engine records the
    forward's amaxes every iteration): a skipped step's forward ran at the same scales, and its
    amaxes say what the tensors held. Its metrics row shows the scales like any other."""
    (_, state, rows), = run_steps(1, steps=3, inject_overflow="2:0")
    assert [row["skipped"] for row in rows] == [False, True, False]
    assert all("fp8" in row for row in rows)
    histories = {name: array for name, array in state.items() if name.endswith("amax_history")}
    assert histories and all((history[:3] > 0).all() and not history[3:].any()
                             for history in histories.values())


def test_evaluating_during_training_changes_no_scale():
    (_, _, without), = run_steps(1)
    (_, _, evaluated), = run_steps(1, eval_every=2, eval_batches=1)
    assert [r["loss"] for r in evaluated] == [r["loss"] for r in without]
    assert [r["fp8"] for r in evaluated] == [r["fp8"] for r in without]
    assert "val_loss" in evaluated[1]


def test_the_metrics_rows_and_the_plot_show_the_watched_tensors_scales():
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'lessons' extra)")
    from minimp.train.plot import history_figure

    (_, _, rows), = run_steps(1, fp8_recipe="none")
    watched = list(rows[0]["fp8"])
    assert watched == [
        f"{layer}.{tensor}"
        for layer in ("1.attn.c_attn", "2.mlp.c_proj")
        for tensor in ("input", "weight", "grad_output")
    ]
    assert all(v["scale"] == 1.0 for row in rows for v in row["fp8"].values())
    assert rows[0]["fp8"]["1.attn.c_attn.grad_output"]["underflow"] > 0.3  # unscaled: lost
    assert json.loads(json.dumps(rows[-1])) == rows[-1]  # a metrics row is plain JSON
    figure = history_figure(rows, units_per_step=128, unit="tokens")
    assert figure.axes[-2].get_ylabel() == "fp8 scale"  # the last panel (its twin comes after)
    assert [line.get_label() for line in figure.axes[-2].get_lines()] == watched
    bf16 = history_figure([{k: v for k, v in r.items() if k != "fp8"} for r in rows], 128)
    assert "fp8 scale" not in [axis.get_ylabel() for axis in bf16.axes]


BAD_FP8_FLAGS = [
    (["--fp8-amax-history", "0"], "--fp8-amax-history needs --precision fp8"),
    (["--precision", "fp8", "--fp8-amax-history", "0"], "must be a positive integer, got 0"),
    (["--precision", "bf16", "--fp8-recipe", "delayed"], "--fp8-recipe needs --precision fp8"),
    (["--precision", "fp8", "--fp8-recipe", "current", "--fp8-margin", "1"], "delayed only"),
    (["--precision", "fp8", "--fp8-margin", "-1"], "--fp8-margin must lie in 0..64, got -1"),
    (["--precision", "fp8", "--device", "gpu"], "emulated on the CPU"),
]


@pytest.mark.parametrize("flags, message", BAD_FP8_FLAGS, ids=lambda x: str(x))
def test_bad_fp8_flags_are_refused_with_the_flag_and_the_fix(flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        parse_config(flags).validate()


def test_an_unknown_recipe_given_to_the_api_names_the_recipes():
    # the command line's choices refuse it before (the test below); the dataclass checks its own
    with pytest.raises(ConfigError, match="--fp8-recipe must be one of delayed, current, none"):
        TrainConfig(precision="fp8", fp8_recipe="x").validate()


def test_a_bad_fp8_flag_on_the_command_line_is_one_line_and_exit_2():
    result = subprocess.run(
        [PYTHON, "-m", "minimp.train", "--precision", "fp8", "--fp8-recipe", "x"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        "minimp.train: error: argument --fp8-recipe: invalid choice: 'x' (choose from 'delayed', "
        "'current', 'none', 'rowwise', 'blockwise', 'mxfp8', 'mxfp8-round-up') (see --help)"
    ]


def test_fp8_trains_as_well_as_bf16_and_unscaled_fp8_loses_its_gradients():
    """A small GPT, 60 steps on the same seed (docs/benchmarks.md: the measured 400-step runs):
    delayed scaling's validation loss is within 3% of bf16's; with scale 1, most output gradients
    of the first block underflow to zero in E5M2, where delayed scaling loses under 0.1% after
    step 1."""
    small = dict(context=32, batch_size=16, lr=3e-3, steps=60, warmup=10)
    evaluated = dict(eval_every=60, eval_batches=8)
    (_, _, bf16), = run_steps(1, precision="bf16", **small, **evaluated)
    (_, _, delayed), = run_steps(1, **small, **evaluated)
    (_, _, unscaled), = run_steps(1, fp8_recipe="none", **small)
    assert abs(delayed[-1]["val_loss"] - bf16[-1]["val_loss"]) < 0.03 * bf16[-1]["val_loss"]
    first = "1.attn.c_attn.grad_output"
    assert np.mean([r["fp8"][first]["underflow"] for r in unscaled]) > 0.3
    assert max(r["fp8"][first]["underflow"] for r in delayed[1:]) < 0.001


@pytest.mark.parametrize("world_size, overrides", [
    (1, dict(dataset="digits", layers=3, hidden=8, heads=0, context=0)),
    (1, dict()),
    (2, dict(tp=2)),
    (1, dict(experts=4, top_k=2)),
    (2, dict(experts=4, top_k=2, dp=2, ep=2)),
], ids=["mlp", "gpt", "gpt-tp2", "moe", "moe-ep2"])
def test_the_memory_check_counts_every_amax_history_a_rank_builds(world_size, overrides):
    """--fp8-amax-history 1000000000 passed the memory check, which did not count the histories,
    and the run grew until the kernel killed it: the estimate is what the built ranks hold (and
    the one history np.roll copies at a time)."""
    config = TrainConfig(**{**TINY, "fp8_amax_history": 5, **overrides})
    config.validate(world_size)

    def held(comm):
        run = Run(config, comm, log=lambda line: None)
        models = [run.model] + ([run.share.trained] if run.share.trained is not run.model else [])
        quantizers = {id(q): q for model in models for _, q in nn.fp8_quantizers(model)}
        return sum(q.amax_history.nbytes for q in quantizers.values())

    for rank_bytes in dist.simulate(world_size, held):
        assert rank_bytes + 4 * 5 == fp8_history_bytes(config)
