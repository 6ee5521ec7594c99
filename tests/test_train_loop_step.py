"""One step of the training loop, in-process (mutation testing sees these, not the subprocess
runs): what dropout is told, clipping, evaluations, periodic saves, injected faults, divergence,
and the step's time accounts."""

import re

import numpy as np
import pytest
from test_train_gpt import TINY as GPT

from minimp import distributed as dist
from minimp import nn
from minimp.train import TrainConfig, train
from minimp.checkpoints.errors import AgreedError
from minimp.train.loop import Run

MLP = dict(hidden=16, layers=1, batch_size=32, log_every=1000)


def run(world_size=1, log=None, **overrides):
    config = TrainConfig(**{**MLP, **overrides})
    config.validate(world_size)
    lines = [] if log is None else log
    body = lambda comm: train(config, log=lines.append, comm=comm)  # noqa: E731
    return dist.simulate(world_size, body)[0]


def test_dropout_learns_each_micro_batch_s_step_and_global_rows(monkeypatch):
    told = []
    real = nn.set_dropout_state
    monkeypatch.setattr(
        nn, "set_dropout_state", lambda layer, *state: told.append(state) or real(layer, *state)
    )
    run(**{**GPT, "dropout": 0.1, "steps": 2, "micro_batches": 2, "seed": 5})
    rows = {(seed, step, tuple(r)) for seed, step, r in told}
    halves = (tuple(range(4)), tuple(range(4, 8)))  # batch 8 in two micro-batches
    assert rows == {(5, step, half) for step in (1, 2) for half in halves}


def sgd_step_sizes(max_grad_norm):
    """The largest change of any master in one fp32 SGD step at lr 0.5."""
    config = TrainConfig(**{**MLP, "optimizer": "sgd", "precision": "fp32", "lr": 0.5})
    config.max_grad_norm = max_grad_norm
    config.validate()
    training = Run(config, dist.simulate(1, lambda comm: comm)[0], log=lambda line: None)
    before = [master.copy() for master in training.optimizer.master_weights]
    training.step(1)
    after = training.optimizer.master_weights
    return max(np.abs(a - b).max() for a, b in zip(after, before))


def test_clipping_bounds_the_step_of_plain_sgd():
    """One SGD step moves each weight by lr x its clipped gradient: at most lr x max norm."""
    assert 0 < sgd_step_sizes(1e-6) <= 0.5 * 1e-6 * (1 + 1e-5)
    assert sgd_step_sizes(0.0) > 1e-3  # 0: no clipping


def test_evaluations_come_every_eval_every_steps_over_eval_batches():
    flags = {**GPT, "steps": 4, "eval_every": 2, "log_every": 1000}
    one, two = run(eval_batches=1, **flags), run(eval_batches=2, **flags)
    for result in (one, two):
        history = result["history"]
        assert ["val_loss" in r for r in history] == [False, True, False, True]
        assert ["eval_seconds" in r for r in history] == [False, True, False, True]
        assert all(0 < r["eval_seconds"] < 60 for r in history if "eval_seconds" in r)
    assert [r["loss"] for r in one["history"]] == [r["loss"] for r in two["history"]]
    assert one["history"][1]["val_loss"] != two["history"][1]["val_loss"]  # 1 batch, not 2


def test_save_every_saves_on_its_multiples_before_the_last_step(tmp_path):
    lines = []
    path = tmp_path / "run.npz"
    run(log=lines, steps=5, save=str(path), save_every=2)
    saved = [line for line in lines if line.startswith("saved checkpoint")]
    assert saved == [f"saved checkpoint {path} after step {s}" for s in (2, 4, 5)]
    lines.clear()
    run(log=lines, steps=4, save=str(path), save_every=2)
    saved = [line for line in lines if line.startswith("saved checkpoint")]
    assert saved == [f"saved checkpoint {path} after step {s}" for s in (2, 4)]  # 4 once


def test_an_injected_fault_stops_the_run_at_its_step():
    said = r"^injected fault at step 2 on rank 0 \(--inject-fault\)$"
    with pytest.raises(RuntimeError, match=said):
        run(steps=3, inject_fault="2:0")


def test_a_run_whose_steps_all_overflow_stops_after_max_consecutive_skips():
    message = (
        "the last 3 steps (to step {}) were all skipped: their gradients overflowed every time, "
        "the loss scale is now {:g}."
    )
    with pytest.raises(AgreedError) as stopped:
        run(steps=30, lr=1e4, layers=2, max_consecutive_skips=3)
    said = str(stopped.value.error)
    step, scale = re.match(r"the last 3 steps \(to step (\d+)\).* is now (\S+)\.", said).groups()
    assert said.startswith(message.format(int(step), float(scale)))
    assert int(step) > 3 and float(scale) < 65536


@pytest.mark.parametrize(
    "layout",
    [
        dict(), dict(dp=2), dict(pp=2, micro_batches=2), dict(dp=2, straggler_barrier=True),
        dict(dp=2, zero=1, micro_batches=2), dict(dp=2, zero=2, micro_batches=2),
    ],
    ids=str,
)
def test_the_step_s_seconds_split_into_non_negative_parts(layout):
    """The straggler barrier's wait is its own part, only with --straggler-barrier."""
    world_size = layout.get("dp", 1) * layout.get("pp", 1)
    for record in run(world_size, steps=3, layers=2, **layout)["history"]:
        total = record["communication_seconds"]
        assert record["compute_seconds"] > 0 and total >= 0
        assert 0 <= record["exposed_communication_seconds"] <= total + 1e-9
        waited = record.get("straggler_seconds")
        assert (waited is not None) == ("straggler_barrier" in layout)
        assert waited is None or 0 <= waited < 60


def test_the_fp8_collectives_and_the_replica_check_count_as_the_step_s_communication():
    """The Stopwatch hears every timed call of a step by name (what --timeline would record)."""
    config = TrainConfig(**{**MLP, "layers": 2, "precision": "fp8", "check_replicas": 1})
    config.validate()
    training = Run(config, dist.simulate(1, lambda comm: comm)[0], log=lambda line: None)
    heard = []
    training.meter.stopwatch.listener = lambda name, start, end: heard.append(name)
    training.step(1)
    assert heard == [
        "finalize_backward", "any_rank", "reduce", "any_rank", "fp8_statistics", "fp8_amax",
        "check_replicas", "mean_loss",
    ]  # fmt: skip
