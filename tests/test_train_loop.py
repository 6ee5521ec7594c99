"""The training loop's own decisions, run in-process (mutation testing sees these, not the
subprocess and mpirun runs): the resumed schedule's length and metrics file, the learning rate,
the thread count."""

import json
import re

import numpy as np
import pytest

from minimp import backend
from minimp.optim import lr_scheduler as lr_schedule
from minimp import distributed as dist
from minimp.distributed.simulated import SimulatedCommunicator
from minimp.tensor import Tensor
from minimp.checkpoints.errors import AgreedError
from minimp.train import TrainConfig, train
from minimp.train import threads as threads_rule
from minimp.train.loop import Run
from minimp.train.threads import GRAIN

TINY = dict(
    hidden=16, layers=1, batch_size=32, lr=0.01, lr_schedule="cosine", warmup=1, min_lr=1e-4
)


def quiet_train(**overrides):
    config = TrainConfig(log_every=1000, **overrides)
    config.validate()
    return train(config, log=lambda line: None)


def lrs(result):
    return [r["lr"] for r in result["history"]]


@pytest.fixture(scope="module")
def checkpoint_of_6_steps(tmp_path_factory):
    """Saved after step 6 of a 6-step run: its schedule decays over 6 steps (the default)."""
    path = tmp_path_factory.mktemp("loop") / "six.npz"
    quiet_train(steps=6, save=str(path), **TINY)
    return str(path)


def test_a_resume_says_so_and_continues_the_metrics_file(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    quiet_train(steps=3, save=str(tmp_path / "three.npz"), metrics=str(metrics), **TINY)
    lines = []
    config = TrainConfig(
        steps=5, resume=str(tmp_path / "three.npz"), metrics=str(metrics), log_every=1000, **TINY
    )
    config.validate()
    train(config, log=lines.append)
    assert lines[0] == f"resumed from {tmp_path / 'three.npz'} after step 3"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2, 3, 4, 5, None]  # the summary row last


def test_a_fresh_run_rewrites_the_metrics_file(tmp_path):
    """Whatever the file held, even a row of step 0 (which a resume after step 0 would keep)."""
    metrics = tmp_path / "metrics.jsonl"
    quiet_train(steps=3, metrics=str(metrics), **TINY)
    metrics.write_text('{"step": 0}\n' + metrics.read_text())
    quiet_train(steps=2, metrics=str(metrics), **TINY)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2, None]


def test_a_constant_schedule_keeps_the_learning_rate():
    result = quiet_train(steps=3, **{**TINY, "lr_schedule": "constant"})
    assert lrs(result) == [0.01] * 3


def test_the_cosine_schedule_warms_up_then_decays():
    result = quiet_train(steps=4, **TINY)
    assert lrs(result) == [lr_schedule.warmup_cosine(s, 0.01, 1e-4, 1, 4) for s in range(1, 5)]


def test_a_skipped_step_still_moves_the_learning_rate_schedule():
    """The rate is the schedule's at the step's number, skipped or not (as a PyTorch scheduler
    stepped every iteration): counting optimizer steps would leave every step after an overflow
    one behind, which a resume test cannot see (both of its runs would lag alike)."""
    result = quiet_train(steps=4, inject_overflow="2:0", **TINY)
    assert [row["skipped"] for row in result["history"]] == [False, True, False, False]
    assert lrs(result) == [lr_schedule.warmup_cosine(s, 0.01, 1e-4, 1, 4) for s in range(1, 5)]
    assert lrs(result)[2] != lrs(result)[1]  # the step after the skip has its own rate


@pytest.mark.parametrize(
    "threads, cores, grain, expected",
    [(0, 3, 1, 1), (0, 1, 1, 1), (0, 8, 1, 4), (3, 8, 1, 3), (0, 8, GRAIN, 1), (3, 8, GRAIN, 3)],
)
def test_each_rank_takes_at_most_its_share_of_the_cores_unless_threads_is_given(
    monkeypatch, threads, cores, grain, expected
):
    """Two ranks on this node (pretended): 3 cores give each 1 thread, 8 give each 4, where the
    grain is 1 multiply-add (every product asks for all it may have); with the real grain this
    tiny model's products ask for 1 (minimp/train/threads.py)."""
    asked = []
    monkeypatch.setattr(threads_rule, "GRAIN", grain)
    monkeypatch.setattr(backend, "available_cores", lambda: cores)
    monkeypatch.setattr(SimulatedCommunicator, "ranks_on_this_node", lambda self: 2)
    real = backend.limit_cpu_threads
    monkeypatch.setattr(backend, "limit_cpu_threads", lambda n: asked.append(n) or real(n))
    config = TrainConfig(steps=1, threads=threads, log_every=1000, **TINY)
    config.validate()
    dist.simulate(1, lambda comm: train(config, log=lambda line: None, comm=comm))
    assert asked == [expected] and type(asked[0]) is int


def test_simulated_ranks_share_one_process_so_each_takes_every_core(monkeypatch):
    """The simulated ranks are threads of this one process (one BLAS thread pool): they count as
    one rank on this node, so on 8 cores each may have 8 threads, not 8 / 2 (a grain of 1
    multiply-add: every product asks for all it may have)."""
    asked = []
    monkeypatch.setattr(threads_rule, "GRAIN", 1)
    monkeypatch.setattr(backend, "available_cores", lambda: 8)
    real = backend.limit_cpu_threads
    monkeypatch.setattr(backend, "limit_cpu_threads", lambda n: asked.append(n) or real(n))
    config = TrainConfig(steps=1, threads=0, log_every=1000, **TINY)
    config.validate(2)
    dist.simulate(2, lambda comm: train(config, log=lambda line: None, comm=comm))
    assert asked == [8, 8]


def test_a_resume_without_lr_decay_steps_continues_the_checkpoints_schedule(
    checkpoint_of_6_steps,
):
    """--steps 10 would decay over 10 steps; the checkpoint's 6 win (steps 7..10 sit at the
    floor min_lr only because the schedule is the checkpoint's)."""
    resumed = quiet_train(steps=10, resume=checkpoint_of_6_steps, **TINY)
    expected = [lr_schedule.warmup_cosine(s, 0.01, 1e-4, 1, 6) for s in range(7, 11)]
    assert lrs(resumed) == expected
    assert lrs(resumed)[1:] == [1e-4] * 3


def test_a_resume_with_lr_decay_steps_uses_the_given_length(checkpoint_of_6_steps):
    resumed = quiet_train(steps=10, resume=checkpoint_of_6_steps, lr_decay_steps=12, **TINY)
    expected = [lr_schedule.warmup_cosine(s, 0.01, 1e-4, 1, 12) for s in range(7, 11)]
    assert lrs(resumed) == expected
    assert min(lrs(resumed)) > 1e-4


def one_rank():
    return dist.simulate(1, lambda comm: comm)[0]


def test_a_step_s_gradient_is_the_batch_mean_loss_s_whatever_the_micro_batches():
    """fp32 SGD (no momentum, no decay): w moves by exactly -lr x dL/dw of the batch's mean loss,
    with 1 or 4 micro-batches (each carries 1/M of it)."""
    for micro_batches in (1, 4):
        config = TrainConfig(
            hidden=16, layers=1, batch_size=32, optimizer="sgd", precision="fp32", lr=0.5,
            micro_batches=micro_batches, log_every=1000,
        )  # fmt: skip
        config.validate()
        run = Run(config, one_rank(), log=lambda line: None)
        inputs, targets = run.task.global_batch(1)
        run.runner.loss_fn(run.model(Tensor(inputs)), targets).backward()
        masters, parameters = run.optimizer.master_weights, run.model.parameters()
        expected = [m - 0.5 * p.grad for m, p in zip(masters, parameters)]
        for p in run.model.parameters():
            p.grad = None
        run.step(1)
        for master, want in zip(run.optimizer.master_weights, expected):
            np.testing.assert_allclose(master, want, rtol=1e-5, atol=1e-7)


def test_the_flags_a_resume_must_repeat_are_named_as_on_the_command_line():
    run = Run(TrainConfig(steps=1, **TINY), one_rank(), log=lambda line: None)
    assert run.resume_flags == {
        "--dataset": "digits", "--layers": 1, "--hidden": 16, "--seed": 0, "--batch-size": 32,
        "--optimizer": "adam",
    }  # fmt: skip
    fp8 = TrainConfig(steps=1, precision="fp8", **TINY)
    fp8.validate()
    flags = Run(fp8, one_rank(), log=lambda line: None).resume_flags
    fp8_flags = ["--fp8-recipe", "--fp8-amax-history", "--fp8-margin"]
    assert list(flags)[-4:] == ["--optimizer", *fp8_flags]
    assert len(flags) == 9 and flags["--fp8-recipe"] == fp8.fp8_recipe


def test_the_device_is_chosen_with_this_rank_s_place_on_its_node(monkeypatch):
    chosen = []
    choose = lambda name, local_rank: chosen.append((name, local_rank))  # noqa: E731
    monkeypatch.setattr(backend, "use_device", choose)
    monkeypatch.setattr(SimulatedCommunicator, "node_rank_and_size", lambda self: (self.rank, 2))
    config = TrainConfig(steps=1, device="cpu", **TINY)
    config.validate(2)
    dist.simulate(2, lambda comm: Run(config, comm, log=lambda line: None) and None)
    assert sorted(chosen) == [("cpu", 0), ("cpu", 1)]


def test_the_trainer_says_exactly_why_a_scale_stuck_at_its_minimum_is_bad():
    lines = []
    config = TrainConfig(steps=20, lr=1e4, hidden=16, layers=2, log_every=1000)
    config.validate()
    with pytest.raises(AgreedError, match="the run ended at step 20 with loss nan"):
        train(config, log=lines.append)
    warned = [line for line in lines if "minimum loss scale" in line]
    assert len(warned) == 1 and warned[0] == (  # once, not again every step that stays stuck
        f"{warned[0].split(':')[0]}: gradients overflow at the minimum loss scale 1; training is "
        "diverging in fp16 (lower --lr, clip with --max-grad-norm, or use bf16); the steps "
        "skipped after this one at that scale are counted, not printed"
    )
    stuck = int(re.fullmatch(r"step (\d+)", warned[0].split(":")[0]).group(1))
    assert stuck < 19  # so steps stayed stuck after it, and none of them printed a line
    assert not [line for line in lines if re.match(rf"step ({stuck + 1}|{stuck + 2}):", line)]
