"""Lesson 1 (floating point): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/01_floating_point.ipynb became false, or a checker passes a wrong answer."""

import math

import ml_dtypes
import numpy as np
from exercising import Wrong, exercise_tests, solutions
from hypothesis import given
from hypothesis import strategies as st

f16 = np.float16


def test_lesson1_the_formats_table():
    rows = {name: ml_dtypes.finfo(t) for name, t in
            (("fp32", np.float32), ("fp16", f16), ("bf16", ml_dtypes.bfloat16))}
    assert float(rows["fp16"].max) == 65504 == (2 - 2.0**-10) * 2.0**15
    attributes = ("smallest_normal", "smallest_subnormal", "eps")
    powers = {name: [math.log2(float(getattr(info, a))) for a in attributes]
              for name, info in rows.items()}
    assert powers == {"fp32": [-126, -149, -23], "fp16": [-14, -24, -10], "bf16": [-126, -133, -7]}
    assert [(info.nexp, info.nmant) for info in rows.values()] == [(8, 23), (5, 10), (8, 7)]


def test_lesson1_fp16_spans_12_decades_fp32_and_bf16_more_than_75():
    def decades(t):
        info = ml_dtypes.finfo(t)
        return math.log10(float(info.max) / float(info.smallest_subnormal))

    assert 12 <= decades(f16) < 13
    assert decades(np.float32) > 75 and decades(ml_dtypes.bfloat16) > 75


def test_lesson1_a_loss_of_2_times_2_to_the_16_is_inf_in_fp16():
    with np.errstate(over="ignore"):
        assert np.isinf(f16(2.0 * 2.0**16))


def test_lesson1_underflow_in_units_of_2_to_the_minus_24():
    cases = {2.0**-14: 1024, 2.0**-20: 16, 2.0**-24: 1, float(np.nextafter(2.0**-25, 1.0)): 1,
             2.0**-25: 0, 2.0**-26: 0, 3 * 2.0**-25: 2}
    for value, units in cases.items():
        assert float(f16(value)) == units * 2.0**-24


@given(st.floats(2.0**-25, 2.0**-24, exclude_min=True))
def test_lesson1_and_4_everything_above_2_to_the_minus_25_rounds_up_to_2_to_the_minus_24(value):
    assert float(f16(value)) == 2.0**-24


def test_lesson1_ties_to_even_2049_2051_2053():
    assert [float(f16(v)) for v in (2049, 2051, 2053)] == [2048, 2052, 2052]


def test_lesson1_running_sums_stall_where_numpys_float16_sum_does_not():
    ones = np.ones(3000, f16)
    running = f16(0)
    for one in ones:
        running = f16(running + one)
    assert float(running) == 2048 and float(np.cumsum(ones)[-1]) == 2048
    assert float(np.sum(ones)) == 3000


def test_lesson1_numpys_float16_sum_adds_in_float32_and_rounds_once_it_is_not_pairwise():
    """[2048] + [1] * 7 sums to 2055: a running fp16 sum gives 2048, a pairwise fp16 sum 2054
    ((2048 + 1) + (1 + 1)) + ((1 + 1) + (1 + 1)), the exact sum rounded once 2056."""

    def pairwise(values):
        if len(values) == 1:
            return values[0]
        half = len(values) // 2
        return f16(pairwise(values[:half]) + pairwise(values[half:]))

    eight = np.array([2048] + [1] * 7, f16)
    assert float(pairwise(list(eight))) == 2054
    assert float(np.sum(eight)) == 2056 == float(f16(2055))


def test_lesson1_the_accumulator_is_float32_not_float64():
    """2049 + 2^-20 needs 32 significant bits: float32 drops the 2^-20, and 2049 ties to 2048."""
    assert float(np.float32(2049 + 2.0**-20)) == 2049
    assert float(np.sum(np.array([2048, 1, 2.0**-20], f16))) == 2048
    assert float(f16(2049 + 2.0**-20)) == 2050


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def ulp16_without_the_top_binade(x):
    return float(np.spacing(np.float16(abs(x))))  # inf at 65504


def ulp16_without_subnormals(x):
    return 2.0 ** (math.frexp(abs(x))[1] - 11) if x else 2.0**-24


def round_half_up(x):
    gap = solutions(1).ulp16(x)
    return math.floor(x / gap + 0.5) * gap


def round_without_overflow(x):
    gap = solutions(1).ulp16(x)
    return round(x / gap) * gap


def running_sum16(values):
    total = np.float16(0)
    for value in values:
        total = np.float16(total + value)
    return total


WRONG = {
    "check_ulp16": [
        Wrong(ulp16_without_the_top_binade, ""),
        Wrong(ulp16_without_subnormals, ""),
    ],
    "check_round_to_float16": [
        Wrong(round_half_up, ""),
        Wrong(round_without_overflow, ""),
    ],
    "check_compensated_sum16": [
        Wrong(running_sum16, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(1, WRONG)
