"""Each block-scaled recipe trains nanoGPT's CPU GPT for 200 steps as well as bf16 does (slow):
issue 41's bounds (1% for the fp8 recipes, 3% for NVFP4), at 200 steps instead of the docs run's
2,000 (docs/fp8.md)."""

from functools import cache

import pytest

from minimp import backend
from minimp import distributed as dist
from minimp.train import TrainConfig
from minimp.train.loop import Run

STEPS = 200


@cache
def val_loss(precision: str, seed: int = 0, fp8_recipe: str | None = None) -> float:
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
@pytest.mark.parametrize("precision, recipe, bound", [
    ("fp8", "rowwise", 0.01), ("fp8", "blockwise", 0.01), ("fp8", "mxfp8", 0.01),
    ("nvfp4", None, 0.03)])
def test_a_recipe_ends_within_its_bound_of_bf16_after_200_steps(precision, recipe, bound):
    """Within the bound of bf16 on the same seed (the same data, the same initial weights).
    Measured here: bf16 2.4170; rowwise +0.05%, blockwise -0.00%, mxfp8 +0.06%, nvfp4 +0.18%.
    The docs run's other arm, twice bf16's seed spread, is no test at 200 steps: two bf16 seeds
    ended 0.040 apart here, wider than what an unscaled fp8 run loses (+2.39%, the last test)."""
    bf16, loss = val_loss("bf16"), val_loss(precision, 0, recipe)
    print(f"{recipe or precision}: {loss:.4f}, bf16 {bf16:.4f}, {(loss - bf16) / bf16:+.2%}")
    assert abs(loss - bf16) <= bound * bf16


@pytest.mark.slow
def test_the_fp8_bound_fails_an_unscaled_fp8_run():
    """--fp8-recipe none: every output gradient below E5M2's smallest step flushed to zero."""
    bf16, loss = val_loss("bf16"), val_loss("fp8", 0, "none")
    print(f"none: {loss:.4f}, bf16 {bf16:.4f}, {(loss - bf16) / bf16:+.2%}")
    assert abs(loss - bf16) > 0.01 * bf16
