"""Learning-rate schedules as pure functions of the step: constant, and warmup then cosine decay.

A schedule that depends only on (step, its settings) needs no state in a checkpoint beyond those
settings, so a resumed run continues it exactly. The cosine schedule is nanoGPT's (after Loshchilov
& Hutter 2017, "SGDR"): a linear warmup over the first `warmup` steps, a half cosine from `lr` down
to `min_lr` at iteration `decay_steps`, then `min_lr`. Steps are numbered from 1, as everywhere in
minimp; nanoGPT numbers its iterations from 0, so step s here is its iteration s - 1.
"""

import math


def constant(step: int, lr: float) -> float:
    """The same learning rate at every step."""
    return lr


def warmup_cosine(step: int, lr: float, min_lr: float, warmup: int, decay_steps: int) -> float:
    """lr * (i + 1) / (warmup + 1) for iteration i = step - 1 < warmup; then the half cosine
    min_lr + (lr - min_lr) * (1 + cos(pi * progress)) / 2, progress going from 0 at the end of
    warmup to 1 at decay_steps; min_lr after it."""
    iteration = step - 1
    if iteration < warmup:
        return lr * (iteration + 1) / (warmup + 1)
    if iteration > decay_steps:
        return min_lr
    progress = (iteration - warmup) / max(decay_steps - warmup, 1)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)
