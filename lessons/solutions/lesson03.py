"""Reference solutions to lesson 3's exercises (mixed precision). Try them yourself first."""

import numpy as np


def activation_bytes(batch, widths, itemsize):
    """Each Linear keeps its input (batch x its input width); each ReLU keeps its output, which
    is the next Linear's input, the same array. So: every width but the output's, once."""
    return batch * sum(widths[:-1]) * itemsize


def sgd_step(params, grads, masters, lr, loss_scale):
    """The mixed-precision step of plain SGD: float32 gradients, one skip decision for all,
    unscale, update the float32 masters, round them into the float16 copies."""
    grads32 = [g.astype(np.float32) for g in grads]
    if not all(np.isfinite(g).all() for g in grads32):
        return True  # skipped: nothing is touched
    for param, grad, master in zip(params, grads32, masters):
        grad /= np.float32(loss_scale)  # exact: the scale is a power of two
        master -= np.float32(lr) * grad
        param[...] = master.astype(np.float16)
    return False


def stochastic_round(x, rng):
    """Round each float32 number to the float16 neighbour below or above it, going up with
    probability (x - below) / (above - below): the expected result is x itself."""
    nearest = x.astype(np.float16)
    lower = np.nextafter(nearest, np.float16(-np.inf))
    below = np.where(nearest.astype(np.float32) > x, lower, nearest)
    above = np.nextafter(below, np.float16(np.inf))
    gap = above.astype(np.float32) - below.astype(np.float32)
    up = rng.random(x.shape) < (x - below.astype(np.float32)) / gap
    return np.where(up, above, below)
