"""optim/lr_scheduler.py: the schedules' values at their boundaries, written out as numbers (a test
that compares the trainer's rates with warmup_cosine itself agrees with whatever it computes)."""

import pytest

from minimp.optim.lr_scheduler import constant, warmup_cosine


def test_warm_up_starts_at_lr_over_warmup_plus_one_and_reaches_lr():
    """nanoGPT's warm-up: step 1 already moves (lr / (warmup + 1)), never a step at lr 0."""
    assert [warmup_cosine(s, 1.0, 0.0, 3, 10) for s in range(1, 5)] == [0.25, 0.5, 0.75, 1.0]


def test_the_cosine_is_halfway_halfway_and_min_lr_after_the_decay():
    assert warmup_cosine(1, 1.0, 0.0, 0, 10) == 1.0  # no warm-up: the cosine's top
    assert warmup_cosine(6, 1.0, 0.0, 0, 10) == pytest.approx(0.5)  # iteration 5 of 10
    assert warmup_cosine(11, 1.0, 0.25, 0, 10) == 0.25  # iteration 10: the bottom
    assert warmup_cosine(12, 1.0, 0.25, 0, 10) == 0.25  # past the decay: min_lr


def test_the_constant_schedule_is_the_rate_at_every_step():
    assert [constant(s, 0.3) for s in (1, 2, 1000)] == [0.3, 0.3, 0.3]
