"""Lesson 15 (eight bits): the configuration of its training runs, which the notebook and its
claims test (tests/lessons/test_lesson15.py) both import, and the checkers of its exercises: the
saturating fp8 cast, delayed scaling's update against minimp's quantizer, the forward of a Linear
in fp8. Reference solutions: lessons/solutions/lesson15.py."""

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from minimp import Tensor
from minimp import functional as F
from minimp.lessons.checking import Report, call, expect
from minimp.precision import (
    BFLOAT16,
    E4M3,
    E5M2,
    DelayedScaling,
    Float8CurrentScaling,
    Fp8Meta,
    Fp8Quantizer,
    fp8,
)


# ----- the notebook's training runs ---------------------------------------------------------------
# Small enough that five runs fit the lesson's 20 s (each fp8 step costs about twice a bf16 one:
# the casts are emulated), long enough that unscaled fp8 falls behind and the scales move.
GPT_SHAPE = dict(context=32, layers=2, heads=2, width=32)  # GPTConfig's, the vocabulary the data's
BATCH_SIZE = 16  # windows of `context` characters a step: 512 positions
STEPS = 50
LEARNING_RATE = 3e-3  # AdamW's
VALIDATION_WINDOWS = 128  # one batch of the validation text, seed 1
AMAX_HISTORY = 16  # delayed scaling's window of steps (DelayedScaling's default here; TE's 1024)
# The three tensors of block 1's q, k, v projection whose scales the runs record at every step.
WATCHED = ("1.attn.c_attn.input", "1.attn.c_attn.weight", "1.attn.c_attn.grad_output")


# ----- the saturating cast ------------------------------------------------------------------------
def _midpoints(values: np.ndarray) -> np.ndarray:
    """The points halfway between neighbours (exact in float32: fp8 has 4 significant bits)."""
    ordered = np.unique(values)
    return ((ordered[:-1] + ordered[1:]) / 2).astype(np.float32)


def _positive_values(fmt: Any) -> np.ndarray:
    """Every positive finite value of the format, as float32."""
    values = fp8.to_float32(np.arange(256, dtype=np.uint8).view(fmt.dtype))
    return np.unique(values[np.isfinite(values) & (values > 0)])


@dataclass(frozen=True)
class _Format:
    """A format given by its limits alone, with no ml_dtypes dtype to cast to."""

    name: str
    max: float
    smallest_normal: float
    smallest_subnormal: float
    mantissa_bits: int

    def __repr__(self) -> str:
        return self.name


SHIFT = 8  # E4M3 moved down 8 binades: a format of the same kind that ml_dtypes lacks
E4M3_DOWN = _Format("E4M3 / 2^8", E4M3.max * 2.0**-SHIFT, E4M3.smallest_normal * 2.0**-SHIFT,
                    E4M3.smallest_subnormal * 2.0**-SHIFT, E4M3.mantissa_bits)


def check_round_to_fp8(round_to_fp8: Callable, quiet: bool = False) -> Report:
    """round_to_fp8(x, fmt): the float32 array of the fmt values nearest x (ties to even), +-max
    for anything beyond (inf included), NaN for NaN, the sign of x kept on zero; compared bit for
    bit with minimp's saturating cast. fmt is E4M3, E5M2 or a format ml_dtypes lacks (E4M3
    moved down 8 binades, with max, smallest_normal, smallest_subnormal and mantissa_bits but
    no dtype), so ml_dtypes' cast (`.astype(fmt.dtype)`), which the spec rules out, fails."""
    report = Report("round_to_fp8", quiet)
    rng = np.random.default_rng(14)

    def saturated(x, fmt):
        """minimp's cast; for E4M3_DOWN, E4M3's on x * 2^8, times 2^-8 (both exact)."""
        if fmt is E4M3_DOWN:
            return fp8.to_float32(fp8.cast_saturating(x * 2.0**SHIFT, E4M3)) * 2.0**-SHIFT
        return fp8.to_float32(fp8.cast_saturating(x, fmt))

    def compare(x, fmt):
        x = np.asarray(x, np.float32)
        got = np.asarray(call(round_to_fp8, x.copy(), fmt))
        expect(got.dtype == np.float32 and got.shape == x.shape,
               f"returned {got.dtype} of shape {got.shape}, expected float32 of shape {x.shape}")
        want = saturated(x, fmt).astype(np.float32)
        nan = np.isnan(want)
        if not np.array_equal(np.isnan(got), nan):
            expect(False, f"NaN where there should be none, or a number where {fmt} has NaN: "
                   f"at x = {x[np.isnan(got) != nan][0]!r}")
        wrong = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
        if wrong.size:
            at = wrong[0]
            expect(False, f"{wrong.size} of {int((~nan).sum())} values differ; first: x = "
                   f"{x[~nan][at]!r} gave {got[~nan][at]!r}, {fmt} rounds it to {want[~nan][at]!r}")

    normals = _positive_values(E4M3)
    normals = normals[normals >= E4M3.smallest_normal]

    @report.case(
        "E4M3, 2^-6 to 448: every value, and random numbers between them",
        hint="the gap is 2^(e - 3) in the binade [2^e, 2^(e+1)); np.frexp(x) gives e + 1 "
        "exactly; divide by the gap, np.rint, multiply back",
    )
    def _():
        between = 2.0 ** rng.uniform(-6, np.log2(448), 5000) * rng.choice([-1, 1], 5000)
        compare(np.concatenate([normals, -normals, between]), E4M3)

    @report.case(
        "halfway between two neighbours: to the even one",
        hint="np.rint and np.round round half to even; math.floor(x + 0.5) rounds half up",
    )
    def _():
        compare(_midpoints(normals), E4M3)

    @report.case(
        "below 2^-6: the subnormals, a fixed gap of 2^-9; below 2^-10, zero (with x's sign)",
        hint="below the smallest normal the gap stays that of the lowest binade (the "
        "subnormals are numbers: do not flush them to zero); np.copysign puts the sign back on "
        "a zero",
    )
    def _():
        small = _positive_values(E4M3)[:9]
        tiny = np.array([2.0**-10, 2.0**-10 * 1.01, 1e-4, 1e-30, 0.0])
        compare(np.concatenate([small, _midpoints(small), tiny, -tiny]), E4M3)

    @report.case(
        "past 448: +-448 (464, halfway to the 480 E4M3 lacks, ties to 448 either way); inf too; "
        "NaN stays NaN",
        hint="clip the magnitude to the maximum before rounding: rounding past it has nowhere "
        "to go in eight bits",
    )
    def _():
        compare(np.array([449, 463.9, 464, 464.1, 1e4, np.inf, -500, -np.inf, np.nan]), E4M3)

    @report.case(
        "E5M2: every float16 value (65,536 of them), 61440 included",
        hint="nothing about E4M3 is special: read fmt.max, fmt.smallest_normal and "
        "fmt.mantissa_bits",
    )
    def _():
        every = np.arange(65536, dtype=np.uint16).view(np.float16).astype(np.float32)
        every[np.isnan(every)] = np.nan  # one quiet NaN: signalling ones warn when widened
        compare(every, E5M2)

    @report.case(
        "a format ml_dtypes lacks: E4M3 moved down 8 binades (largest 1.75, smallest normal "
        "2^-14), given by its limits, with no dtype",
        hint="build the cast from fmt.max, fmt.smallest_normal and fmt.mantissa_bits: a cast "
        "to fmt.dtype is ml_dtypes' own, the shortcut the exercise rules out",
    )
    def _():
        between = 2.0 ** rng.uniform(-20, 2, 2000) * rng.choice([-1, 1], 2000)
        edges = [1.75, 1.8125, 1.82, 100.0, np.inf, 2.0**-18, 2.0**-17.5, -1e-30, np.nan]
        down = np.concatenate([normals, _midpoints(normals)]) * 2.0**-SHIFT
        compare(np.concatenate([down, -down, between, edges]), E4M3_DOWN)

    return report.finish()


# ----- delayed scaling ----------------------------------------------------------------------------
def _trajectory(amaxes: np.ndarray, length: int, margin: int, fmt: Any) -> list:
    """(history, scale) after each step, from minimp's quantizer fed these amaxes."""
    quantizer = Fp8Quantizer(fmt, DelayedScaling(margin=margin, amax_history_len=length))
    states = []
    for amax in amaxes:
        quantizer.end_step(float(amax))
        states.append((quantizer.amax_history.copy(), quantizer.scale))
    return states


def check_delayed_scaling_update(delayed_scaling_update: Callable, quiet: bool = False) -> Report:
    """delayed_scaling_update(amax_history, amax, scale, fp8_max, margin) -> (history, scale):
    the history (row 0 the newest step) with `amax` in front and the oldest dropped, and the next
    scale (fp8_max / 2^margin) / (the largest amax of that history), in float32; the scale as it
    was when that largest amax is 0, inf or NaN; float32's largest number when the quotient
    overflows. Compared, step by step, with the trajectory of minimp's Fp8Quantizer."""
    report = Report("delayed_scaling_update", quiet)
    rng = np.random.default_rng(15)

    def follow(amaxes, length, margin=0, fmt=E4M3):
        history, scale = np.zeros(length, np.float32), np.float32(1.0)
        for step, (amax, (want_history, want_scale)) in enumerate(
                zip(amaxes, _trajectory(amaxes, length, margin, fmt)), start=1):
            history, scale = call(delayed_scaling_update, history.copy(), np.float32(amax),
                                  scale, fmt.max, margin)
            history = np.asarray(history, np.float32)
            expect(history.shape == want_history.shape
                   and np.array_equal(history, want_history, equal_nan=True),
                   f"step {step}: history {history.tolist()}, expected {want_history.tolist()}")
            expect(np.float32(scale) == want_scale, f"step {step} (amax {float(amax):.6g}): "
                   f"scale {float(scale)!r}, minimp's quantizer {float(want_scale)!r}")

    @report.case(
        "a history of 4 steps: 30 amaxes between 2^-10 and 2^10",
        hint="np.roll(history, 1) moves every amax one row back, then history[0] = amax (row 0 "
        "is the newest); the scale from history.max(), after this step's amax entered it",
    )
    def _():
        follow((2.0 ** rng.uniform(-10, 10, 30)).astype(np.float32), length=4)

    @report.case(
        "a history of 16: one large amax sets the scale for exactly 16 steps, then leaves",
        hint="the scale comes from the whole window, this step's amax and the 15 before it, "
        "not from this step's alone",
    )
    def _():
        amaxes = np.full(40, 0.5, np.float32)
        amaxes[5] = 100.0
        follow(amaxes, length=16)

    @report.case(
        "a margin of 2, and E5M2's maximum: the largest amax is aimed at 57344 / 4",
        hint="fp8_max * 2.0**-margin, in float32 (a power of two: exact)",
    )
    def _():
        amaxes = (2.0 ** rng.uniform(-20, -5, 20)).astype(np.float32)
        follow(amaxes, length=3, margin=2, fmt=E5M2)

    @report.case(
        "an amax of 0 (nothing seen), inf or NaN (an overflow) in the window: the scale stays",
        hint="only a positive, finite window maximum makes a new scale (np.isfinite: NaN is "
        "not, and history.max() is NaN while a NaN is in the window); a history of one step "
        "forgets an inf or NaN at once, a longer one keeps the scale while it is in it",
    )
    def _():
        amaxes = np.array([0, 0, 2, 0, 3, np.inf, 4, 4, 4, 0.5, 0.5, 0.5, 2, np.nan, 4, 4, 4, 1],
                          np.float32)  # NaN in the window: no np.nanmax, no test of 0 and inf only
        follow(amaxes, length=1)
        follow(amaxes, length=3)

    @report.case(
        "an amax of 1e-45: 448 / amax overflows float32, the scale is float32's largest number",
        hint="np.finfo(np.float32).max where the quotient is not finite",
    )
    def _():
        follow(np.array([1.0, 1e-45, 1e-45, 1.0], np.float32), length=2)

    return report.finish()


# ----- a Linear in fp8 ----------------------------------------------------------------------------
def _fp8_linear(x: np.ndarray, weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """minimp's Fp8Linear forward with current scaling."""
    meta = Fp8Meta(Float8CurrentScaling())
    return F.linear(Tensor(x), Tensor(weight), Tensor(bias), meta).data


def _exact_operands(rng: np.random.Generator, shape: tuple, power: int) -> np.ndarray:
    """bf16 values that are integers held by E4M3 times 2^power, 448 times 2^power among them:
    the scale is 2^-power, and sums of up to 64 products of them are exact in float32, in any
    order (each product an integer below 2^18, their sum below 2^24)."""
    integers = _positive_values(E4M3)
    integers = integers[integers == np.round(integers)]
    values = rng.choice(integers, shape) * rng.choice([-1.0, 1.0], shape)
    values.flat[rng.integers(values.size)] = 448.0
    return (values * 2.0**power).astype(BFLOAT16)


def check_fp8_linear(fp8_linear: Callable, quiet: bool = False) -> Report:
    """fp8_linear(x, weight, bias) -> y: x @ weight^T + bias as minimp's Fp8Linear computes it
    with current scaling, for bf16 x (..., in), weight (out, in), bias (out,): x and weight
    quantized to E4M3 with scales 448 / amax (1 for an all-zero tensor), float32 products and
    sums of the fp8 values, times (1/s_x)(1/s_w), plus the bias, rounded once to bf16."""
    report = Report("fp8_linear", quiet)
    rng = np.random.default_rng(16)

    def compare(x, weight, bias):
        got = np.asarray(call(fp8_linear, x.copy(), weight.copy(), bias.copy()))
        want = _fp8_linear(x, weight, bias)
        expect(got.dtype == want.dtype and got.shape == want.shape,
               f"returned {got.dtype} of shape {got.shape}, expected bf16 of shape {want.shape}")
        wrong = np.flatnonzero(got.view(np.uint16) != want.view(np.uint16))
        if wrong.size:
            at = wrong[0]
            expect(False, f"{wrong.size} of {want.size} outputs differ; first: "
                   f"{got.flat[at]!r} against Fp8Linear's {want.flat[at]!r}")

    def bf16(*shape, size=1.0):
        return (rng.standard_normal(shape) * size).astype(BFLOAT16)

    @report.case(
        "one input feature (each output one product): bit for bit, scales of any size",
        hint="s = 448 / amax in float32, so that each tensor's amax lands on 448; q = the E4M3 "
        "value nearest x * s, computed in float32 and not rounded to bf16 first; "
        "y = (q_x * q_w) * (np.float32(1 / s_x) * np.float32(1 / s_w)) + bias",
    )
    def _():
        compare(bf16(64, 1, size=3e-4), bf16(8, 1, size=20.0), bf16(8))
        compare(bf16(64, 1, size=50.0), bf16(8, 1, size=0.01), bf16(8))

    @report.case(
        "64 input features, values fp8 holds exactly at power-of-two scales",
        hint="q_x @ q_w.T in float32 (the tensor core's sums), then the inverse scales, the "
        "bias (widened to float32) and one rounding to bf16 (.astype(BFLOAT16))",
    )
    def _():
        x, weight = _exact_operands(rng, (32, 64), -12), _exact_operands(rng, (16, 64), -5)
        compare(x, weight, bf16(16))

    @report.case(
        "x of shape (B, T, in): the product over the last axis, y of shape (B, T, out)",
        hint="one scale for the whole of x: its amax over every axis",
    )
    def _():
        compare(_exact_operands(rng, (4, 8, 64), -3), _exact_operands(rng, (24, 64), -7), bf16(24))

    @report.case(
        "one input feature, no bias, 300 pairs of scales: the two inverses are one float32 "
        "number, x * s a float32 product", hint="(1 / s_x) * (1 / s_w) first, rounded once to "
        "float32, then one multiplication of the sums by it: multiplying the sums by each "
        "inverse in turn rounds twice, and now and then lands on another bf16; likewise x * s "
        "in float32 (x.astype(np.float32) * a float32 s), not float64: E4M3 then rounds "
        "another number",
    )
    def _():
        pairs = np.random.default_rng(0)  # among these, some that two roundings get wrong
        for _ in range(300):
            x = pairs.standard_normal((64, 1)) * 2.0 ** pairs.uniform(-12, 4)
            weight = pairs.standard_normal((8, 1)) * 2.0 ** pairs.uniform(-12, 4)
            compare(x.astype(BFLOAT16), weight.astype(BFLOAT16), np.zeros(8, BFLOAT16))

    @report.case(
        "an all-zero x: its scale is 1 (448 / 0 is no scale) and y is the bias",
        hint="current scaling keeps scale 1 when the amax is 0",
    )
    def _():
        compare(np.zeros((4, 16), BFLOAT16), bf16(8, 16), bf16(8))

    return report.finish()


EXERCISES = [
    ("round_to_fp8", check_round_to_fp8),
    ("delayed_scaling_update", check_delayed_scaling_update),
    ("fp8_linear", check_fp8_linear),
]
