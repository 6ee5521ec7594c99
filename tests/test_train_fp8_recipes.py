"""Each block-scaled fp8 recipe trains nanoGPT's CPU GPT for 200 steps as well as bf16 does (slow):
issue 41's criterion, at 200 steps instead of the docs run's 2,000 (docs/fp8.md)."""

from functools import cache

import pytest

from minimp import backend
from minimp import distributed as dist
from minimp.train import TrainConfig
from minimp.train.loop import Run

STEPS = 200


@cache
def val_loss(precision: str, seed: int, fp8_recipe: str | None = None) -> float:
    """The validation loss (20 random batches) after 200 steps of the shakespeare defaults."""
    config = TrainConfig(dataset="shakespeare", precision=precision, fp8_recipe=fp8_recipe,
                         seed=seed, steps=STEPS, eval_every=STEPS, threads=1)
    config.validate(1)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        for step in range(1, STEPS + 1):
            run.step(step)
        return run.history.records[-1]["val_loss"]

    with backend.limit_cpu_threads(1):
        (loss,) = dist.simulate(1, body)
    return loss


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["rowwise", "blockwise", "mxfp8"])
def test_a_recipe_ends_within_1_percent_of_bf16_after_200_steps(recipe):
    """Within 1% of bf16 on the same seed (the same data, the same initial weights). The docs
    run's other arm, twice bf16's seed spread, is no test at 200 steps: two bf16 seeds ended
    0.040 apart here (2.417 and 2.457), wider than an unscaled fp8 run's loss (+0.058), which
    the 1% bound fails (the last test)."""
    bf16, loss = val_loss("bf16", 0), val_loss("fp8", 0, recipe)
    print(f"{recipe}: {loss:.4f}, bf16 {bf16:.4f}")
    assert abs(loss - bf16) <= 0.01 * bf16


@pytest.mark.slow
def test_the_bound_fails_an_unscaled_fp8_run():
    """--fp8-recipe none: every output gradient below E5M2's smallest step flushed to zero."""
    bf16, loss = val_loss("bf16", 0), val_loss("fp8", 0, "none")
    print(f"none: {loss:.4f}, bf16 {bf16:.4f}")
    assert abs(loss - bf16) > 0.01 * bf16
