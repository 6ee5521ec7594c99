"""Checkers for lesson 4 (loss scaling): the window of safe scales, a dynamic loss scaler against
minimp's trajectory, hysteresis. Reference solutions: lessons/solutions/lesson04.py."""

from typing import Any, Callable

import numpy as np

from minimp import DynamicLossScaler, Tensor
from minimp.lessons.checking import Report, call, expect

F16 = np.float16


def _window(gradients: np.ndarray) -> tuple[float, float]:
    """(smallest power of two that keeps every non-zero gradient non-zero in float16,
    largest power of two that keeps every gradient finite), found by trying every exponent."""
    magnitudes = np.abs(gradients[gradients != 0]).astype(np.float64)
    with np.errstate(over="ignore"):
        exponents = range(-60, 61)
        lowest = min(k for k in exponents if np.all(F16(magnitudes * 2.0**k) != 0))
        highest = max(k for k in exponents if np.all(np.isfinite(F16(magnitudes * 2.0**k))))
    return 2.0**lowest, 2.0**highest


def check_scale_window(scale_window: Callable[[np.ndarray], tuple], quiet: bool = False) -> Report:
    """scale_window(gradients) -> (lowest, highest): the smallest power of two S with no non-zero
    gradient flushed to zero by float16 after * S, and the largest with none overflowing."""
    report = Report("scale_window", quiet)

    def compare(gradients):
        low, high = call(scale_window, gradients)
        want = _window(gradients)
        expect((float(low), float(high)) == want,
               f"returned ({low!r}, {high!r}), expected ({want[0]!r}, {want[1]!r})")

    @report.case("gradients from 2^-30 to 2^-3", hint="lowest: min|g| S must round to 2^-24 "
                 "or more; highest: max|g| S must round to 65504 or less")
    def _():
        compare(np.array([2.0**-30 * 1.5, -(2.0**-10), 2.0**-3 * 1.5], np.float32))

    @report.case(
        "a smallest gradient of exactly 2^-30: 2^5 is not enough",
        hint="2^-30 x 2^5 = 2^-25 lies halfway between 0 and 2^-24 and ties to even: zero",
    )
    def _():
        compare(np.array([2.0**-30, 1e-4], np.float32))

    @report.case(
        "a largest gradient of 65519 / 2^10: 2^10 is still safe",
        hint="everything below 65520 rounds down to 65504; 65520 and above round to inf",
    )
    def _():
        compare(np.array([1e-3, 65519.0 / 2**10], np.float32))
        compare(np.array([1e-3, -65520.0 / 2**10], np.float32))

    @report.case("random gradients (zeros ignored)", hint="powers of two: 2.0 ** k")
    def _():
        rng = np.random.default_rng(5)
        for _ in range(20):
            magnitudes = 2.0 ** rng.uniform(-30, 5, 100)
            gradients = (rng.standard_normal(100) * magnitudes).astype(np.float32)
            gradients[:5] = 0
            compare(gradients)

    return report.finish()


def _trajectory(scaler: Any, flags: list[bool]) -> list[float]:
    """loss_scale after each update(found_inf)."""
    scales = []
    for flag in flags:
        scaler.update(bool(flag))
        scales.append(float(scaler.loss_scale))
    return scales


def _compare_trajectories(make: Callable[[], Any], reference: DynamicLossScaler, flags: list,
                          label: str) -> None:
    got, want = _trajectory(make(), flags), _trajectory(reference, flags)
    for step, (a, b) in enumerate(zip(got, want)):
        kind = "overflow" if flags[step] else "clean"
        expect(a == b, f"{label}: after update {step + 1} ({kind})"
               f" the scale is {a:g}, expected {b:g} (updates so far: "
               f"{''.join('x' if f else '.' for f in flags[:step + 1])[-24:]})")


TRAJECTORY_HINT = (
    "update(found_inf): on an overflow multiply by backoff_factor and reset the count of clean "
    "steps; otherwise count it, and at growth_interval multiply by growth_factor and reset"
)


def check_dynamic_scaler(Scaler: Any, quiet: bool = False) -> Report:
    """Scaler(init_scale, growth_factor, backoff_factor, growth_interval): loss_scale, scale(loss),
    update(found_inf), with torch.amp.GradScaler's trajectory."""
    report = Report("DynamicLossScaler", quiet)

    @report.case("starts at init_scale; scale(loss) is loss * S",
                 hint="self.loss_scale = init_scale")
    def _():
        scaler = Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                        growth_interval=3)
        expect(float(scaler.loss_scale) == 2.0**16, f"loss_scale starts at {scaler.loss_scale}")
        scaled = scaler.scale(Tensor(np.float32(1.5)))
        expect(float(scaled.item()) == 1.5 * 2**16, f"scale(1.5) gave {scaled.item()}")

    @report.case("grows after growth_interval clean steps, halves on an overflow",
                 hint=TRAJECTORY_HINT)
    def _():
        def make():
            return Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=3)

        flags = [False] * 7 + [True] + [False] * 4 + [True, True] + [False] * 3
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3)
        _compare_trajectories(make, reference, flags, "interval 3")

    @report.case(
        "an overflow restarts the count of clean steps",
        hint="after an overflow, growth needs growth_interval clean steps again, counted from 0",
    )
    def _():
        def make():
            return Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                          growth_interval=4)

        flags = [False, False, False, True, False, False, False, False, False]
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=4)
        _compare_trajectories(make, reference, flags, "interval 4")

    @report.case("300 random updates, other factors", hint=TRAJECTORY_HINT)
    def _():
        flags = list(np.random.default_rng(6).random(300) < 0.15)
        for growth, backoff, interval in ((2.0, 0.5, 5), (4.0, 0.25, 6)):
            def make():
                return Scaler(init_scale=2.0**20, growth_factor=growth, backoff_factor=backoff,
                              growth_interval=interval)

            reference = DynamicLossScaler(2.0**20, growth, backoff, growth_interval=interval,
                                          min_scale=2.0**-100)
            label = f"x{growth:g} / x{backoff:g} / {interval}"
            _compare_trajectories(make, reference, flags, label)

    return report.finish()


def check_hysteresis(Scaler: Any, quiet: bool = False) -> Report:
    """The same Scaler with `hysteresis=h`: h overflows are tolerated before the scale backs off
    (Megatron-LM); the allowance refills when the scale grows."""
    report = Report("DynamicLossScaler with hysteresis", quiet)

    def make(h, interval=3):
        return lambda: Scaler(init_scale=2.0**16, growth_factor=2.0, backoff_factor=0.5,
                              growth_interval=interval, hysteresis=h)

    @report.case("hysteresis=1 is the plain scaler", hint="one overflow is enough to back off")
    def _():
        flags = [False] * 4 + [True, False, True, True] + [False] * 4
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=1)
        _compare_trajectories(make(1), reference, flags, "hysteresis 1")

    @report.case(
        "hysteresis=2: the first overflow only uses up the allowance",
        hint="keep a counter of overflows still tolerated; back off when it reaches 0",
    )
    def _():
        flags = [True, False, True, True, False]
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=2)
        _compare_trajectories(make(2), reference, flags, "hysteresis 2")

    @report.case(
        "the allowance refills only when the scale grows, not after each clean step",
        hint="reset the counter to hysteresis where the scale is multiplied by growth_factor",
    )
    def _():
        flags = [True, False, False, True, False, False, False, True, True, False, False, False]
        flags.append(True)
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=2)
        _compare_trajectories(make(2), reference, flags, "hysteresis 2")

    @report.case("300 random updates, hysteresis 3", hint="see the hints above")
    def _():
        flags = list(np.random.default_rng(7).random(300) < 0.3)
        reference = DynamicLossScaler(2.0**16, 2.0, 0.5, growth_interval=3, hysteresis=3,
                                      min_scale=2.0**-100)
        _compare_trajectories(make(3), reference, flags, "hysteresis 3")

    return report.finish()


EXERCISES = [
    ("scale_window", check_scale_window),
    ("DynamicLossScaler", check_dynamic_scaler),
    ("DynamicLossScaler", check_hysteresis),
]
