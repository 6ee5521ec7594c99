"""Lesson 18 (fewer bits, finer scales): every number its prose states, as a test, and its
exercises' checkers against the reference solutions and wrong ones. A failure here means a
sentence in lessons/18_fewer_bits_finer_scales.ipynb became false, or a checker passes a wrong
answer."""

import functools

import ml_dtypes
import numpy as np
import pytest
from exercising import Wrong, exercise_tests

from minimp.lessons.lesson18 import (
    ACCUMULATION_SHAPE,
    BLOCKS,
    CHANNELS,
    OUTLIER,
    TOKENS,
    TRAIN,
    UPDATE,
    UPDATES,
    WEIGHTS,
    accumulation_errors,
    binades,
    every_rounding,
    granularity_errors,
    outlier_input,
    random_blocks,
    rule_costs,
    stalled_weights,
    train_runs,
    worked_block,
)
from minimp.precision import blocks
from minimp.precision.accumulate import PROMOTION_INTERVAL, TENSOR_CORE_BITS
from minimp.precision.blocks import E2M1, E4M3


def test_the_lessons_configuration():
    assert (TOKENS, CHANNELS, OUTLIER, BLOCKS) == (256, 512, 100.0, 4096)
    assert (UPDATE, UPDATES, WEIGHTS) == (2.0**-10, 100, 1000)
    assert (TRAIN["lr"], TRAIN["steps"], TRAIN["precision"]) == (3e-5, 200, "bf16")
    assert ACCUMULATION_SHAPE == (8, 4096, 8)
    assert (TENSOR_CORE_BITS, PROMOTION_INTERVAL) == (14, 128)


@functools.cache
def _granularity():
    return granularity_errors(outlier_input())


def test_one_outlier_channel_fp8_barely_cares():
    """The prose: the other channels' error 2.6e-2 per tensor, per row and per 1 x 128 tile, 2.9e-2
    in MX blocks; 0.040% to zero per tensor; x as a whole 2.6e-2, 5.9e-3, 5.8e-3, MX 4.2e-2; a
    row's largest value is the outlier's in 248 of 256 rows; E4M3 17.8 binades, the outlier 6.6,
    11.2 left."""
    table = _granularity()
    rest = [f"{table[name]['rest']:.1e}" for name in
            ("fp8 per-tensor", "fp8 rowwise", "fp8 1x128", "MXFP8 1x32")]
    assert rest == ["2.6e-02", "2.6e-02", "2.6e-02", "2.9e-02"]
    assert f"{table['fp8 per-tensor']['zero']:.3%}" == "0.040%"
    whole = [f"{table[name]['all']:.1e}" for name in
             ("fp8 per-tensor", "fp8 rowwise", "fp8 1x128", "MXFP8 1x32")]
    assert whole == ["2.6e-02", "5.9e-03", "5.8e-03", "4.2e-02"]
    assert table["MXFP8 1x32"]["all"] > table["fp8 per-tensor"]["all"]
    assert np.sum(np.argmax(np.abs(outlier_input()), axis=1) == 0) == 248
    assert (round(binades(E4M3), 1), round(np.log2(OUTLIER), 1)) == (17.8, 6.6)
    assert round(binades(E4M3) - np.log2(OUTLIER), 1) == 11.2


def test_one_outlier_channel_fp4_needs_blocks():
    """The prose: E2M1 3.6 binades; per tensor every other value 0, error 1.00; NVFP4 0.18, 72% of
    its square from channels 1-15, 9.2% of the other values 0; below about a 24th of the block's
    largest value rounds to 0 (half of 0.5, over 6)."""
    table = _granularity()
    assert round(binades(E2M1), 1) == 3.6 and binades(E2M1) < np.log2(OUTLIER)
    assert table["FP4 per-tensor"]["zero"] == 1.0 and table["FP4 per-tensor"]["rest"] == 1.0
    assert f"{table['NVFP4 1x16']['rest']:.2f}" == "0.18"
    assert f"{table['NVFP4 1x16']['zero']:.1%}" == "9.2%"
    x = outlier_input()
    error = (blocks.dequantize(blocks.quantize(x, E2M1, "1x16", "nvfp4")) - x).astype(np.float64)
    assert round((error[:, 1:16] ** 2).sum() / (error[:, 1:] ** 2).sum(), 2) == 0.72
    info = ml_dtypes.finfo(E2M1.dtype)
    assert (float(info.smallest_subnormal), float(info.max)) == (0.5, 6.0)


def test_the_worked_block():
    """The prose: amax 1.9; floor X = 2^-8, 486.4 stored as 448, decodes 1.75, 7.9% off; round-up
    X = 2^-7, 243.2 stored as 240 (E4M3's numbers 16 apart there), 1.875, 1.3% off; the other 31
    values' mean error the same to three digits (2.05%)."""
    block = worked_block()
    assert np.abs(block).max() == np.float32(1.9) and np.argmax(np.abs(block)) == 0
    seen = {}
    for rule in ("mx_floor", "mx_round_up"):
        q = blocks.quantize(block[None], E4M3, "1x32", rule)
        scale = float(q.scale_inv.astype(np.float32)[0, 0])
        decoded = blocks.dequantize(q)[0]
        error = np.abs(decoded - block) / np.abs(block)
        seen[rule] = (np.log2(scale), float(np.float32(1.9) / scale),
                      float(q.data[0, 0].astype(np.float32)), float(decoded[0]),
                      f"{error[0]:.1%}", f"{error[1:].mean():.2%}")
    assert seen["mx_floor"][0] == -8 and round(seen["mx_floor"][1], 1) == 486.4
    assert seen["mx_floor"][2:5] == (448.0, 1.75, "7.9%")
    assert seen["mx_round_up"][0] == -7 and round(seen["mx_round_up"][1], 1) == 243.2
    assert seen["mx_round_up"][2:5] == (240.0, 1.875, "1.3%")
    assert seen["mx_floor"][5] == seen["mx_round_up"][5] == "2.05%"
    assert 2.0 ** (7 - E4M3.mantissa_bits) == 16  # the gap in [128, 256)


def test_what_the_round_up_rule_costs():
    """The prose: E4M3 16.5% clipped, floor 2.92e-2 against round-up 2.65e-2 (outlier's x: 4.18e-2
    against 2.74e-2); E2M1 29.3%, both 1.15e-1, zero 8.9% and 10.8%; E4M3's max mantissa 1.75,
    E2M1's 1.5, emax 8 and 2."""
    costs = rule_costs(random_blocks())
    e4m3, e2m1 = costs["E4M3"], costs["E2M1"]
    assert (f"{e4m3['clipped']:.1%}", f"{e2m1['clipped']:.1%}") == ("16.5%", "29.3%")
    assert (f"{e4m3['mx_floor']:.2e}", f"{e4m3['mx_round_up']:.2e}") == ("2.92e-02", "2.65e-02")
    assert (f"{e2m1['mx_floor']:.2e}", f"{e2m1['mx_round_up']:.2e}") == ("1.15e-01", "1.15e-01")
    assert (f"{e2m1['mx_floor zero']:.1%}", f"{e2m1['mx_round_up zero']:.1%}") == ("8.9%", "10.8%")
    x = outlier_input()
    assert f"{blocks.quantization_error(x, E4M3, '1x32', 'mx_round_up'):.2e}" == "2.74e-02"
    assert f"{_granularity()['MXFP8 1x32']['all']:.2e}" == "4.18e-02"
    assert (E4M3.max / 2**E4M3.emax, E2M1.max / 2**E2M1.emax) == (1.75, 1.5)
    assert (E4M3.emax, E2M1.emax) == (8, 2)


def test_stochastic_rounding_moves_a_weight_to_nearest_cannot():
    """The prose: bf16's gap at 1 is 2^-7; to nearest every weight stays 1.0; stochastic: 1.02 to
    1.20, mean 1.099, the exact 1.0977; 8,192 of 65,536 round 1 + 2^-10 up, the mean is x."""
    assert float(ml_dtypes.finfo(ml_dtypes.bfloat16).eps) == 2.0**-7 and UPDATE < 2.0**-8
    weights = stalled_weights()
    assert np.all(weights["nearest"] == 1.0)
    w = weights["stochastic"]
    assert (f"{w.min():.2f}", f"{w.max():.2f}", f"{w.mean():.3f}") == ("1.02", "1.20", "1.099")
    assert f"{1 + UPDATES * UPDATE:.4f}" == "1.0977"
    rounded = every_rounding(np.float32(1 + UPDATE))
    assert (rounded > 1).sum() == 8192 and set(rounded.tolist()) == {1.0, 1.0078125}
    assert rounded.astype(np.float64).mean() == 1 + UPDATE


def test_adams_steps_are_below_half_a_gap():
    """The prose: lr 3e-5 is below half a bf16 gap, 2^-15 = 3.05e-5, from magnitude 2^-7 on."""
    half_gap = 2.0**-7 * 2.0**-7 / 2
    assert half_gap == 2.0**-15 and f"{half_gap:.3g}" == "3.05e-05" and TRAIN["lr"] < half_gap


@pytest.mark.slow  # three short trainings, about 5 s
def test_without_masters_stochastic_rounding_follows_fp32_masters():
    """The prose: every run starts at 2.305; the last 50 steps' means 2.271 (fp32 masters), 2.300
    (to nearest), 2.271 (stochastic). (The same under Haswell's and Prescott's OpenBLAS.)"""
    losses = train_runs()
    assert {f"{run[0]:.3f}" for run in losses.values()} == {"2.305"}
    tails = {name: f"{np.mean(run[-50:]):.3f}" for name, run in losses.items()}
    assert tails == {"fp32 masters": "2.271", "bf16, to nearest": "2.300",
                     "bf16, stochastic": "2.271"}


def test_limited_accumulation_and_its_promotion():
    """The prose: 1.1e-3 over all 4,096 products in 14 bits, 2.2e-4 promoted every 128, float32
    below 1e-6."""
    errors = accumulation_errors()
    assert f"{errors['14 bits, no promotion']:.1e}" == "1.1e-03"
    assert f"{errors['14 bits, promoted every 128']:.1e}" == "2.2e-04"
    assert errors["fp32"] < 1e-6


# ----- wrong solutions a learner would write --------------------------------------------------
def mx_rounding_log2(amax, emax):
    """log2 rounded to nearest (what a cast to float8_e8m0fnu does)."""
    return np.clip(np.round(np.log2(np.asarray(amax, np.float64))) - emax, -127, 127).astype(int)


def mx_without_emax(amax, emax):
    return np.clip(np.frexp(np.asarray(amax, np.float32))[1] - 1, -127, 127)


def mx_float32_log2(amax, emax):
    """floor of a float32 log2: 2 - 2^-23 gives log2 1.0."""
    return np.clip(np.floor(np.log2(np.asarray(amax, np.float32))) - emax, -127, 127).astype(int)


def mx_unclamped(amax, emax):
    return np.frexp(np.asarray(amax, np.float32))[1] - 1 - emax


def mx_ceil(amax, emax):
    """NVIDIA's round-up rule where the floor rule was asked."""
    return np.clip(np.ceil(np.log2(np.asarray(amax, np.float64) / 2.0**emax)), -127, 127)


def tiles_along_rows(x):
    """128 x 1 groups: 128 rows of one column."""
    rows, columns = x.shape
    return np.abs(x).reshape(rows // 128, 128, columns).max(axis=1) / np.float32(448)


def tiles_inverted(x):
    """448 / amax: the scale that encodes, not scale_inv."""
    rows, columns = x.shape
    return np.float32(448) / np.abs(x).reshape(rows, columns // 128, 128).max(axis=2)


def tiles_signed_max(x):
    """max of x, not of |x|."""
    rows, columns = x.shape
    return x.reshape(rows, columns // 128, 128).max(axis=2) / np.float32(448)


def tiles_with_float32_division_by_scale(x):
    """Right: 1 / (448 / amax) in float32, as Transformer Engine computes scale_inv."""
    rows, columns = x.shape
    amax = np.abs(x).reshape(rows, columns // 128, 128).max(axis=2)
    return np.float32(1) / (np.float32(448) / amax)


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


def sr_to_nearest(x):
    """lower: rounded to nearest, not truncated."""
    lower = np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)
    upper = (lower.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
    return lower, upper, (_bits(x) & np.uint32(0xFFFF)) / np.float32(65536)


def sr_upward(x):
    """upper toward +inf for negative x too."""
    lower = (_bits(x) & np.uint32(0xFFFF0000)).view(np.float32)
    step = np.spacing(np.abs(lower).astype(ml_dtypes.bfloat16)).astype(np.float32)
    return lower, lower + step, (_bits(x) & np.uint32(0xFFFF)) / np.float32(65536)


def sr_fair_coin(x):
    lower = (_bits(x) & np.uint32(0xFFFF0000)).view(np.float32)
    upper = ((_bits(x) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return lower, upper, np.full(lower.shape, 0.5, np.float32)


def sr_over_65535(x):
    lower = (_bits(x) & np.uint32(0xFFFF0000)).view(np.float32)
    upper = ((_bits(x) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
    return lower, upper, (_bits(x) & np.uint32(0xFFFF)) / np.float64(65535)


def sr_from_values(x):
    """Right: from the values, in float64: truncate toward zero with np.trunc on the grid."""
    x = np.asarray(x, np.float32)
    lower = (_bits(x) & np.uint32(0xFFFF0000)).view(np.float32)
    gap = np.abs(((_bits(x) & np.uint32(0xFFFF0000)) + np.uint32(0x10000)).view(np.float32)
                 .astype(np.float64) - lower)
    p = np.abs(x.astype(np.float64) - lower) / gap
    return lower, lower + np.sign(x) * gap, p


@pytest.mark.parametrize("checker, solution", [
    ("check_tile_scales", tiles_with_float32_division_by_scale),
    ("check_sr_outcomes", sr_from_values),
])
def test_lesson18_checkers_accept_answers_the_spec_allows(checker, solution):
    import minimp.lessons.lesson18 as lesson

    assert getattr(lesson, checker)(solution, quiet=True).passed


WRONG = {
    "check_mx_exponent": [
        Wrong(mx_rounding_log2, "rounded to nearest"),
        Wrong(mx_without_emax, "not subtracted"),
        Wrong(mx_float32_log2, "from the bits"),
        Wrong(mx_unclamped, "clamp"),
        Wrong(mx_ceil, "floor"),
    ],
    "check_tile_scales": [
        Wrong(tiles_along_rows, "128 x 1"),
        Wrong(tiles_inverted, "decodes"),
        Wrong(tiles_signed_max, "abs"),
    ],
    "check_sr_outcomes": [
        Wrong(sr_to_nearest, "truncate"),
        Wrong(sr_upward, "away from zero"),
        Wrong(sr_fair_coin, "fair coin"),
        Wrong(sr_over_65535, "65536"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(18, WRONG)
