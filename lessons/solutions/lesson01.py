"""Reference solutions to lesson 1's exercises (floating point). Try them yourself first."""

import math

import numpy as np


def ulp16(x):
    """The gap between |x| and the next float16 number up: 2^(e - 10) in the binade
    2^e <= |x| < 2^(e+1), and 2^-24 among the subnormals (e stops at -14)."""
    if x == 0:
        return 2.0**-24
    _, exponent = math.frexp(abs(x))  # |x| = m 2^exponent with 0.5 <= m < 1
    return 2.0 ** (max(exponent - 1, -14) - 10)


def round_to_float16(x):
    """The nearest float16 number: count x in gaps of its binade, round that count to the
    nearest integer (Python's round() sends halves to the even integer), scale back."""
    if x == 0 or math.isinf(x) or math.isnan(x):
        return x
    gap = ulp16(x)
    rounded = round(x / gap) * gap  # x / gap is exact: gap is a power of two
    if abs(rounded) > 65504:  # 65536 and beyond do not exist: inf, with x's sign
        return math.copysign(math.inf, x)
    return rounded


def compensated_sum16(values):
    """Kahan summation, every operation in float16: `compensation` keeps the low part of each
    term that the rounded total lost, and hands it to the next term."""
    total, compensation = np.float16(0), np.float16(0)
    for value in values:
        corrected = np.float16(value - compensation)
        new_total = np.float16(total + corrected)
        # (new_total - total) is what was really added; minus corrected: what was lost (negated)
        compensation = np.float16(np.float16(new_total - total) - corrected)
        total = new_total
    return total
