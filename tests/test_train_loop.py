"""The training loop's own decisions, run in-process (mutation testing sees these, not the
subprocess and mpirun runs): the resumed schedule's length and metrics file, the learning rate,
the thread count."""

import json

import pytest

from minimp import backend, lr_schedule
from minimp import distributed as dist
from minimp.distributed.simulated import SimulatedCommunicator
from minimp.train import TrainConfig, train

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
    metrics = tmp_path / "metrics.jsonl"
    quiet_train(steps=3, metrics=str(metrics), **TINY)
    quiet_train(steps=2, metrics=str(metrics), **TINY)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [row.get("step") for row in rows] == [1, 2, None]


def test_a_constant_schedule_keeps_the_learning_rate():
    result = quiet_train(steps=3, **{**TINY, "lr_schedule": "constant"})
    assert lrs(result) == [0.01] * 3


def test_the_cosine_schedule_warms_up_then_decays():
    result = quiet_train(steps=4, **TINY)
    assert lrs(result) == [lr_schedule.warmup_cosine(s, 0.01, 1e-4, 1, 4) for s in range(1, 5)]


@pytest.mark.parametrize(
    "threads, cores, expected", [(0, 3, 1), (0, 1, 1), (0, 8, 4), (3, 8, 3)]
)
def test_each_rank_takes_its_share_of_the_cores_unless_threads_is_given(
    monkeypatch, threads, cores, expected
):
    """Two ranks on this node (pretended): 3 cores give each 1 thread, 8 give each 4."""
    asked = []
    monkeypatch.setattr(backend, "available_cores", lambda: cores)
    monkeypatch.setattr(SimulatedCommunicator, "ranks_on_this_node", lambda self: 2)
    real = backend.limit_cpu_threads
    monkeypatch.setattr(backend, "limit_cpu_threads", lambda n: asked.append(n) or real(n))
    config = TrainConfig(steps=1, threads=threads, log_every=1000, **TINY)
    config.validate()
    dist.simulate(1, lambda comm: train(config, log=lambda line: None, comm=comm))
    assert asked == [expected] and type(asked[0]) is int


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
