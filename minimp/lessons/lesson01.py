"""Checkers for lesson 1 (floating point): the float16 gap, rounding by hand, a sum that does not
stall. Reference solutions: lessons/solutions/lesson01.py."""

import math
from typing import Any, Callable

import numpy as np

from minimp.lessons.checking import Report, call, expect

F16 = np.float16
# Every non-negative finite float16 number, from its bits: exponent fields 0..30, all mantissas.
ALL_FLOAT16 = np.arange(0, 31 << 10, dtype=np.uint16).view(F16).astype(np.float64)


def _expected_gap(value: float) -> float:
    """2^(e - 10) for 2^e <= |value| < 2^(e+1), with e at least -14 (the subnormals' spacing)."""
    if value == 0:
        return 2.0**-24
    exponent = max(math.frexp(abs(value))[1] - 1, -14)
    return 2.0 ** (exponent - 10)


def check_ulp16(ulp16: Callable[[float], float], quiet: bool = False) -> Report:
    """ulp16(x): the gap between |x| (a float16 number) and the next float16 number up."""
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
        expect(got == 32.0, f"ulp16(65504.0) returned {got!r} (np.spacing says inf: why?)")

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

    return report.finish()


def _running_sum(values: np.ndarray) -> float:
    total = F16(0)
    for value in values:
        total = F16(total + value)
    return float(total)


def check_compensated_sum16(sum16: Callable[[np.ndarray], Any], quiet: bool = False) -> Report:
    """sum16(values): the sum of a float16 array computed in float16 only, with a compensation
    term (Kahan) so the running total does not stall."""
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
