"""Lesson 1 (floating point): the configuration its cells print and its claims tests check, and
the checkers of its exercises (the float16 gap, rounding by hand, a sum that does not stall).
Reference solutions: lessons/solutions/lesson01.py."""

import math
from typing import Any, Callable

import ml_dtypes
import numpy as np

from minimp.lessons.checking import Failed, Report, call, expect

F16 = np.float16

# ----- what the lesson's cells print (tests/lessons/test_lesson01.py checks the same) ---------
FORMATS = {"fp32": np.float32, "fp16": np.float16, "bf16": ml_dtypes.bfloat16}
OVERFLOW = (65504, 65519, 65520, 70000)  # the top of fp16: 65520 is the tie that ends at inf
# (label, value): from the smallest normal number down past the last tie, 2^-25
UNDERFLOW = [("2^-14", 2.0**-14), ("2^-20", 2.0**-20), ("2^-24", 2.0**-24),
             ("2^-25 (1 + 2^-52)", float(np.nextafter(2.0**-25, 1.0))), ("2^-25", 2.0**-25),
             ("2^-26", 2.0**-26), ("3 x 2^-25", 3 * 2.0**-25)]
TIES = (2049, 2051, 2053)  # halfway between float16 neighbours 2 apart
ONES = 3000  # a running float16 sum of this many ones stalls at 2048
EIGHT = (2048,) + (1,) * 7  # sums to 2055, a tie: tells float32 accumulation from pairwise


def decades(dtype: Any) -> float:
    """log10(largest / smallest subnormal): how many powers of ten a format spans."""
    info = ml_dtypes.finfo(dtype)
    return math.log10(float(info.max) / float(info.smallest_subnormal))


def ties_between_2048_and_4096() -> tuple[int, int]:
    """(how many of the odd integers 2049 ... 4095 float16 rounds up, how many down): every one
    is a tie, halfway between two float16 numbers 2 apart."""
    ties = np.arange(2049, 4096, 2)
    rounded = ties.astype(F16).astype(np.int64)
    return int(np.sum(rounded > ties)), int(np.sum(rounded < ties))


def pairwise_sum16(values: Any) -> Any:
    """Add in pairs, then pairs of pairs, ..., rounding every sum to float16."""
    if len(values) == 1:
        return F16(values[0])
    half = len(values) // 2
    return F16(pairwise_sum16(values[:half]) + pairwise_sum16(values[half:]))

# Every non-negative finite float16 number, from its bits: exponent fields 0..30, all mantissas.
ALL_FLOAT16 = np.arange(0, 31 << 10, dtype=np.uint16).view(F16).astype(np.float64)


def _expected_gap(value: float) -> float:
    """2^(e - 10) for 2^e <= |value| < 2^(e+1), with e at least -14 (the subnormals' spacing)."""
    if value == 0:
        return 2.0**-24
    exponent = max(math.frexp(abs(value))[1] - 1, -14)
    return 2.0 ** (exponent - 10)


def check_ulp16(ulp16: Callable[[float], float], quiet: bool = False) -> Report:
    """ulp16(x): the spacing of the float16 numbers in the binade of |x| (x a float16 number given
    as a float): 2^(e - 10) for 2^e <= |x| < 2^(e+1), with e at least -14; 65504 included."""
    report = Report("ulp16", quiet)

    @report.case("ulp16(1.0) == 2^-10", hint="10 mantissa bits: in [1, 2) the gap is 2^-10")
    def _():
        got = float(call(ulp16, 1.0))
        expect(got == 2.0**-10, f"ulp16(1.0) returned {got!r}, expected {2.0**-10!r}")

    @report.case(
        "ulp16(65504) == 32, the gap of the top binade",
        hint="65504 lies in [2^15, 2^16): the gap is 2^(15 - 10) even though 65536 is inf",
    )
    def _():
        got = float(call(ulp16, 65504.0))
        why = " (np.spacing says inf: the next number up is inf)" if math.isinf(got) else ""
        expect(got == 32.0, f"ulp16(65504.0) returned {got!r}{why}")

    @report.case(
        "subnormals and zero: ulp16(x) == 2^-24 for every x below 2^-14",
        hint="below the smallest normal number 2^-14 the exponent stops at -14: gap 2^-24",
    )
    def _():
        for value in (0.0, 2.0**-24, 2.0**-20, 2.0**-14 - 2.0**-24):
            got = float(call(ulp16, value))
            expect(got == 2.0**-24, f"ulp16({value!r}) returned {got!r}, expected 2^-24")

    @report.case(
        "all 31,744 non-negative finite float16 numbers",
        hint="find e with 2^e <= x < 2^(e+1) (math.frexp(x) returns e + 1); the gap is "
        "2^(max(e, -14) - 10)",
    )
    def _():
        for value in ALL_FLOAT16:
            got = float(call(ulp16, float(value)))
            want = _expected_gap(float(value))
            expect(got == want, f"ulp16({float(value)!r}) returned {got!r}, expected {want!r}")

    @report.case("negative numbers: the gap of |x|", hint="use abs(x)")
    def _():
        for value in (-1.0, -3.0, -65504.0, -(2.0**-20)):
            got = float(call(ulp16, value))
            want = _expected_gap(value)
            expect(got == want, f"ulp16({value!r}) returned {got!r}, expected {want!r}")

    return report.finish()


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _compare_rounding(round_to_float16: Callable[[float], Any], values: Any) -> None:
    for value in values:
        got = float(call(round_to_float16, float(value)))
        want = float(F16(value))
        expect(_same(got, want), f"round_to_float16({float(value)!r}) returned {got!r}, "
               f"float16 rounds it to {want!r}")


def check_round_to_float16(round_to_float16: Callable[[float], float],
                           quiet: bool = False) -> Report:
    """round_to_float16(x): the float16 number nearest to the float x (as a float), ties to even,
    written with arithmetic only (no np.float16)."""
    report = Report("round_to_float16", quiet)
    with np.errstate(over="ignore"):

        @report.case("float16 numbers stay as they are", hint="x / gap is then an integer")
        def _():
            _compare_rounding(round_to_float16, [0.0, 1.0, -3.5, 2048.0, 65504.0, 2.0**-24])

        @report.case("round to the nearest", hint="q = x / gap; the result is round(q) * gap")
        def _():
            _compare_rounding(round_to_float16, [2049.2, 2050.9, 1 / 3, -0.1, 1000.3])

        @report.case(
            "ties go to the even neighbour: 2049 -> 2048, 2051 -> 2052, 2053 -> 2052",
            hint="Python's round() sends a half to the even integer: round(2.5) == 2",
        )
        def _():
            ties = [2049.0, 2051.0, 2053.0, 1 + 2.0**-11, 1 + 3 * 2.0**-11, -2049.0]
            _compare_rounding(round_to_float16, ties)

        @report.case(
            "overflow: 65519 -> 65504, 65520 -> inf, -1e6 -> -inf",
            hint="a result of 65536 or more does not exist in float16: it is inf (with x's sign)",
        )
        def _():
            _compare_rounding(round_to_float16, [65519.0, 65520.0, 70000.0, -1e6, 1e300])

        @report.case(
            "underflow: 2^-25 -> 0 (a tie), just above 2^-25 -> 2^-24, 3 x 2^-25 -> 2^-23",
            hint="below 2^-14 the gap stays 2^-24, and 2^-25 is halfway between 0 and 2^-24",
        )
        def _():
            just_above = float(np.nextafter(2.0**-25, 1.0))
            _compare_rounding(round_to_float16, [2.0**-25, just_above, 3 * 2.0**-25, 1e-9])

        @report.case("2,000 random numbers from 2^-30 to 2^17, both signs", hint="see above")
        def _():
            rng = np.random.default_rng(1)
            magnitudes = 2.0 ** rng.uniform(-30, 17, 2000)
            _compare_rounding(round_to_float16, magnitudes * rng.choice([-1.0, 1.0], 2000))

        @report.case(
            "rounds with arithmetic, not with NumPy's float16 cast",
            hint="np.float16(x) (or .astype(np.float16)) is the library cast the exercise asks "
            "you to write: count x in gaps of its binade and round the count",
        )
        def _():
            _without_numpys_float16(round_to_float16, [1 / 3, 2049.0, 65520.0, 2.0**-25])

    return report.finish()


class _LibraryCast(Exception):
    """Raised by the stand-in for np.float16 while a learner's rounding runs."""


def _refuse_library_cast(*args: Any, **kwargs: Any) -> None:
    raise _LibraryCast


def _names_float16(code: Any) -> bool:
    """Whether a code object (or one nested in it) names the float16 type: a dtype or struct
    string ("float16", "half", "f2", "e", "<f2"...), or a name float16 / half (a learner's
    `from numpy import float16` escapes the stand-in put on np.float16)."""
    if any(name in ("float16", "half") for name in code.co_names):
        return True
    for constant in code.co_consts:
        if isinstance(constant, str) and constant.strip("<>=!@") in ("float16", "half", "f2", "e"):
            return True
        if hasattr(constant, "co_consts") and _names_float16(constant):
            return True
    return False


def _without_numpys_float16(round_to_float16: Callable, values: list) -> None:
    """Run round_to_float16 with np.float16 and np.half replaced by a function that refuses, so a
    learner's np.float16(x) or x.astype(np.float16) shows; a dtype string ("float16") in its code
    shows too."""
    code = getattr(round_to_float16, "__code__", None)
    expect(code is None or not _names_float16(code),
           "round_to_float16 names the float16 dtype (a string such as 'float16' or 'e', or the "
           "name float16): that is NumPy's (or struct's) float16 cast")
    saved = np.float16, np.half
    np.float16 = np.half = _refuse_library_cast  # type: ignore[misc, assignment]
    try:
        for value in values:
            call(round_to_float16, value)
    except _LibraryCast:
        raise Failed("round_to_float16 called np.float16 (NumPy's cast): round with arithmetic")
    finally:
        np.float16, np.half = saved


def _running_sum(values: np.ndarray) -> float:
    total = F16(0)
    for value in values:
        total = F16(total + value)
    return float(total)


def kahan_sum16(values: np.ndarray) -> np.float16:
    """Kahan's recurrence with every operation rounded to float16 (the exercise's spec)."""
    total, compensation = F16(0), F16(0)
    for value in values:
        corrected = F16(F16(value) - compensation)
        new_total = F16(total + corrected)
        compensation = F16(F16(new_total - total) - corrected)
        total = new_total
    return total


def kahan_cases() -> list[np.ndarray]:
    """Arrays on which Kahan's recurrence in float16 ends one gap away from the exact sum rounded
    once: what np.sum, a float32 or float64 accumulator, or math.fsum give. The first: 2048 + 1
    leaves 2048 and a compensation of -1; the next term, 2^-11, corrected to 1 + 2^-11, rounds to
    1 in float16; 2048 + 1 ties to 2048 again, where the exact 2049 + 2^-11 rounds up to 2050."""
    cases = [np.array([2048, 1, 2.0**-11], F16), np.array([0.5, 2048, 1], F16)]
    rng = np.random.default_rng(6)
    while len(cases) < 6:  # random ones, the first four that tell the two apart
        values = rng.uniform(0, 1, 30).astype(F16)
        if kahan_sum16(values) != F16(math.fsum(values.astype(np.float64))):
            cases.append(values)
    return cases


def check_compensated_sum16(sum16: Callable[[np.ndarray], Any], quiet: bool = False) -> Report:
    """sum16(values): Kahan's compensated sum of a float16 array with every operation rounded to
    float16, returned as a float16 number."""
    report = Report("compensated_sum16", quiet)

    @report.case("3,000 ones sum to 3000", hint="keep the part of each term the total lost")
    def _():
        got = float(call(sum16, np.ones(3000, F16)))
        expect(got == 3000.0, f"returned {got!r}; a plain running sum stalls at 2048")

    @report.case(
        "[2048, 1, 1, 1, 1, 1, 1, 1] sums to 2056, the exact 2055 rounded",
        hint="Kahan: y = x - c; t = total + y; c = (t - total) - y; total = t",
    )
    def _():
        got = float(call(sum16, np.array([2048] + [1] * 7, F16)))
        expect(got == 2056.0, f"returned {got!r}")

    @report.case(
        "random arrays (up to 20,000 numbers in [0, 1)): within one float16 gap of the exact sum",
        hint="every operation in float16, but none of the lost low bits thrown away",
    )
    def _():
        rng = np.random.default_rng(2)
        for size in (100, 5000, 20000):
            values = rng.uniform(0, 1, size).astype(F16)
            exact = float(np.sum(values.astype(np.float64)))
            got = float(call(sum16, values))
            gap = _expected_gap(exact)
            expect(abs(got - exact) <= gap, f"{size} numbers: returned {got!r}, exact {exact!r} "
                   f"(one float16 gap there is {gap}); a running sum gives {_running_sum(values)}")

    @report.case(
        "every intermediate in float16: Kahan's recurrence bit for bit, where it differs from "
        "the exact sum rounded once",
        hint="y, t and c are float16 numbers, each operation rounded to float16 (np.float16 "
        "scalars do that): no float32 or float64 accumulator, no np.sum (it adds in float32), "
        "no math.fsum",
    )
    def _():
        for values in kahan_cases():
            got, want = call(sum16, values), kahan_sum16(values)
            once = F16(math.fsum(values.astype(np.float64)))
            first = ", ".join(f"{float(v):g}" for v in values[:3])
            shown = f"[{first}{', ...' if len(values) > 3 else ''}]"
            expect(float(got) != float(once) or float(want) == float(once),
                   f"{shown}: returned {float(got)!r}, the exact sum rounded once, as a float32 "
                   f"accumulator or np.sum gives; Kahan's recurrence in float16 gives "
                   f"{float(want)!r}")
            expect(float(got) == float(want), f"{shown}: returned {float(got)!r}; Kahan's "
                   f"recurrence in float16 gives {float(want)!r}")

    @report.case("the result is a float16 number", hint="return the float16 total itself")
    def _():
        got = call(sum16, np.array([0.5, 0.25], F16))
        expect(np.asarray(got).dtype == F16, f"returned a {type(got).__name__} "
               f"of dtype {np.asarray(got).dtype}")

    return report.finish()


# (name of the solution in lessons/solutions/lesson01.py, its checker), easiest first
EXERCISES = [
    ("ulp16", check_ulp16),
    ("round_to_float16", check_round_to_float16),
    ("compensated_sum16", check_compensated_sum16),
]
