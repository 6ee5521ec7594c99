"""Reference solutions to lesson 15's exercises (eight bits). Try them yourself first."""

import numpy as np

from minimp.precision import BFLOAT16, E4M3

FLOAT32_MAX = np.finfo(np.float32).max


def round_to_fp8(x, fmt):
    """The fmt value nearest each x, ties to even, saturating at +-fmt.max, from the format's
    definition: in the binade [2^e, 2^(e+1)) the gap is 2^(e - mantissa bits); below the smallest
    normal it stays the lowest binade's (the subnormals). float64 holds every step exactly."""
    x = np.asarray(x, np.float64)
    magnitude = np.minimum(np.abs(x), fmt.max)  # saturate first (NaN stays NaN)
    _, exponent = np.frexp(np.maximum(magnitude, fmt.smallest_normal))  # m 2^exponent, m in [.5, 1)
    gap = np.ldexp(1.0, exponent - 1 - fmt.mantissa_bits)
    rounded = np.rint(magnitude / gap) * gap  # np.rint: half to even
    return np.copysign(rounded, x).astype(np.float32)  # -1e-30 rounds to -0


def delayed_scaling_update(amax_history, amax, scale, fp8_max, margin=0):
    """Transformer Engine's DelayedScaling step: this step's amax in front of the history (the
    oldest drops out), then the scale that puts the window's largest amax at fp8_max / 2^margin.
    An amax of 0 (nothing seen), inf or NaN (an overflow) says nothing: the scale stays."""
    history = np.roll(np.asarray(amax_history, np.float32), 1)
    history[0] = amax
    window = history.max()
    if not (np.isfinite(window) and window > 0):
        return history, np.float32(scale)
    with np.errstate(over="ignore"):
        new_scale = np.float32(fp8_max) * np.float32(2.0**-margin) / window
    return history, new_scale if np.isfinite(new_scale) else FLOAT32_MAX


def _current_scale(array):
    amax = np.float32(np.abs(array.astype(np.float32)).max(initial=0))
    return np.float32(E4M3.max) / amax if amax > 0 else np.float32(1.0)


def fp8_linear(x, weight, bias):
    """What an fp8 tensor core computes: both operands in E4M3 at their own scales, float32
    products and sums, the two inverse scales multiplied into the sum, the bias, one rounding."""
    x_scale, w_scale = _current_scale(x), _current_scale(weight)
    x_q = round_to_fp8(x.astype(np.float32) * x_scale, E4M3)  # (..., in), float32 products
    w_q = round_to_fp8(weight.astype(np.float32) * w_scale, E4M3)  # (out, in)
    inverses = (np.float32(1) / x_scale) * (np.float32(1) / w_scale)  # one float32 number
    y = (x_q @ w_q.T) * inverses + bias.astype(np.float32)  # (..., out), float32
    return y.astype(BFLOAT16)
