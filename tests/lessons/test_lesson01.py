"""Lesson 1 (floating point): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/01_floating_point.ipynb became false, or a checker passes a wrong answer."""

import math
import struct

import ml_dtypes
import numpy as np
from exercising import Wrong, exercise_tests, solutions
from hypothesis import given
from hypothesis import strategies as st
from numpy import float16

from minimp.lessons import lesson01 as lesson

f16 = np.float16


def test_lesson1_the_formats_table():
    rows = {name: ml_dtypes.finfo(t) for name, t in lesson.FORMATS.items()}
    assert float(rows["fp16"].max) == 65504 == (2 - 2.0**-10) * 2.0**15
    attributes = ("smallest_normal", "smallest_subnormal", "eps")
    powers = {name: [math.log2(float(getattr(info, a))) for a in attributes]
              for name, info in rows.items()}
    assert powers == {"fp32": [-126, -149, -23], "fp16": [-14, -24, -10], "bf16": [-126, -133, -7]}
    assert [(info.nexp, info.nmant) for info in rows.values()] == [(8, 23), (5, 10), (8, 7)]


def test_lesson1_decades_fp16_12_bf16_78_6_fp32_83_4():
    spans = {name: round(lesson.decades(t), 1) for name, t in lesson.FORMATS.items()}
    assert spans == {"fp32": 83.4, "fp16": 12.0, "bf16": 78.6}


def test_lesson1_overflow_65519_to_65504_65520_and_a_scaled_loss_to_inf():
    with np.errstate(over="ignore"):
        assert [float(f16(v)) for v in lesson.OVERFLOW] == [65504, 65504, np.inf, np.inf]
        assert np.isinf(f16(2.0 * 2.0**16))


def test_lesson1_underflow_in_units_of_2_to_the_minus_24():
    units = [float(f16(value)) / 2.0**-24 for _, value in lesson.UNDERFLOW]
    assert units == [1024, 16, 1, 1, 0, 0, 2]
    assert float(np.nextafter(2.0**-25, 1.0)) == 2.0**-25 * (1 + 2.0**-52)


@given(st.floats(0, 2.0**-25))
def test_lesson1_every_number_from_0_to_2_to_the_minus_25_rounds_to_0(value):
    assert float(f16(value)) == 0 and float(f16(-value)) == 0


@given(st.floats(2.0**-25, 3 * 2.0**-25, exclude_min=True, exclude_max=True))
def test_lesson1_and_4_above_2_to_the_minus_25_and_below_3_times_it_rounds_to_2_to_the_minus_24(
        value):
    assert float(f16(value)) == 2.0**-24


def test_lesson1_ties_to_even_2049_2051_2053_and_half_of_the_ties_go_up():
    assert [float(f16(v)) for v in lesson.TIES] == [2048, 2052, 2052]
    assert lesson.ties_between_2048_and_4096() == (512, 512)


def test_lesson1_running_sums_stall_where_numpys_float16_sum_does_not():
    ones = np.ones(lesson.ONES, f16)
    running = f16(0)
    for one in ones:
        running = f16(running + one)
    assert float(running) == 2048 and float(np.cumsum(ones)[-1]) == 2048
    assert float(np.sum(ones)) == 3000


def test_lesson1_numpys_float16_sum_adds_in_float32_and_rounds_once_it_is_not_pairwise():
    """[2048] + [1] * 7 sums to 2055: a running fp16 sum gives 2048, a pairwise fp16 sum 2054
    ((2048 + 1) + (1 + 1)) + ((1 + 1) + (1 + 1)), the exact sum rounded once 2056."""

    eight = np.array(lesson.EIGHT, f16)
    assert float(lesson.pairwise_sum16(eight)) == 2054 and sum(lesson.EIGHT) == 2055
    assert float(np.sum(eight)) == 2056 == float(f16(2055))


def test_lesson1_the_accumulator_is_float32_not_float64():
    """2049 + 2^-20 needs 32 significant bits: float32 drops the 2^-20, and 2049 ties to 2048."""
    assert float(np.float32(2049 + 2.0**-20)) == 2049
    assert float(np.sum(np.array([2048, 1, 2.0**-20], f16))) == 2048
    assert float(f16(2049 + 2.0**-20)) == 2050


def test_lesson1_minimps_sum_of_3000_float16_ones_is_3000_in_float16():
    from minimp import Tensor

    total = Tensor(np.ones(lesson.ONES, f16)).sum()
    assert total.item() == 3000 and total.dtype == f16


def test_lesson1_the_kahan_cases_tell_kahan_from_the_exact_sum_rounded_once():
    for values in lesson.kahan_cases():
        once = f16(math.fsum(values.astype(np.float64)))
        assert lesson.kahan_sum16(values) != once == np.sum(values)
    assert float(lesson.kahan_sum16(np.array([2048, 1, 2.0**-11], f16))) == 2048


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def ulp16_without_the_top_binade(x):
    return float(np.spacing(np.float16(abs(x))))  # inf at 65504


def ulp16_without_subnormals(x):
    return 2.0 ** (math.frexp(abs(x))[1] - 11) if x else 2.0**-24


def ulp16_off_by_one_in_frexp(x):
    return 2.0 ** (max(math.frexp(abs(x))[1], -14) - 10) if x else 2.0**-24  # frexp says e + 1


def round_half_up(x):
    gap = solutions(1).ulp16(x)
    return math.floor(x / gap + 0.5) * gap


def round_without_overflow(x):
    gap = solutions(1).ulp16(x)
    return round(x / gap) * gap


def round_with_the_library_cast(x):
    return float(np.float16(x))


def round_with_astype(x):
    return float(np.array(x).astype("float16"))


def round_with_the_e_typecode(x):
    return float(np.array(x, dtype="e"))  # "e" is float16's one-letter type code


def round_with_struct(x):
    try:
        return struct.unpack("e", struct.pack("e", x))[0]  # IEEE half, packed and unpacked
    except OverflowError:
        return math.copysign(math.inf, x)


def round_with_the_imported_float16(x):
    return float(float16(x))  # from numpy import float16: np.float16 under another name


def running_sum16(values):
    total = np.float16(0)
    for value in values:
        total = np.float16(total + value)
    return total


def float32_sum16(values):
    total = np.float32(0)
    for value in values:
        total += np.float32(value)
    return np.float16(total)


def numpy_sum16(values):
    return np.sum(values)  # float16 in, float16 out: NumPy adds in float32


def kahan_with_a_float32_compensation(values):
    total, compensation = np.float16(0), np.float32(0)
    for value in values:
        corrected = np.float32(value) - compensation
        new_total = np.float16(total + corrected)
        compensation = (np.float32(new_total) - np.float32(total)) - corrected
        total = new_total
    return total


WRONG = {
    "check_ulp16": [
        Wrong(ulp16_without_the_top_binade, "65504"),
        Wrong(ulp16_without_subnormals, "subnormal"),
        Wrong(ulp16_off_by_one_in_frexp, "frexp"),
    ],
    "check_round_to_float16": [
        Wrong(round_half_up, "even"),
        Wrong(round_without_overflow, "inf"),
        Wrong(round_with_the_library_cast, "np.float16"),
        Wrong(round_with_astype, "float16 dtype"),
        Wrong(round_with_the_e_typecode, "'e'"),
        Wrong(round_with_struct, "struct"),
        Wrong(round_with_the_imported_float16, "name float16"),
    ],
    "check_compensated_sum16": [
        Wrong(running_sum16, "running sum"),
        Wrong(float32_sum16, "float32"),
        Wrong(numpy_sum16, "np.sum"),
        Wrong(kahan_with_a_float32_compensation, "every intermediate in float16"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(1, WRONG)
