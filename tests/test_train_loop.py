"""The training loop's own decisions, run in-process (mutation testing sees these, not the
subprocess and mpirun runs): the resumed schedule's length, ..."""

import pytest

from minimp import lr_schedule
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
