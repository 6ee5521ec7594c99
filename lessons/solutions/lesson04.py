"""Reference solutions to lesson 4's exercises (loss scaling). Try them yourself first."""

import math

import numpy as np


def scale_window(gradients):
    """The powers of two S that keep every non-zero gradient non-zero and finite in float16.

    Lowest: the smallest |g| times S must exceed 2^-25 (2^-25 itself is a tie between 0 and
    2^-24 and rounds to 0). Highest: the largest |g| times S must stay below 65520 (everything
    from 65504 up to there rounds down to 65504; 65520 is a tie that rounds to inf).
    """
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    smallest, largest = magnitudes.min(), magnitudes.max()
    lowest = math.floor(math.log2(2.0**-25 / smallest)) + 1  # smallest * 2^lowest > 2^-25
    highest = math.ceil(math.log2(65520 / largest)) - 1  # largest * 2^highest < 65520
    return 2.0**lowest, 2.0**highest


class DynamicLossScaler:
    """torch.amp.GradScaler's rule, plus Megatron-LM's hysteresis (hysteresis=1: none)."""

    def __init__(self, init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000, hysteresis=1):
        self.loss_scale = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval, self.hysteresis = growth_interval, hysteresis
        self.clean_steps = 0  # clean steps since the scale last changed or overflowed
        self.tolerated = hysteresis  # overflows still allowed before backing off

    def scale(self, loss):
        return loss * self.loss_scale

    def update(self, found_inf):
        if found_inf:
            self.clean_steps = 0
            self.tolerated -= 1
            if self.tolerated <= 0:
                self.loss_scale *= self.backoff_factor
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            self.loss_scale *= self.growth_factor
            self.clean_steps = 0
            self.tolerated = self.hysteresis  # the allowance refills only when the scale grows
