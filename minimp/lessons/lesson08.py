"""Checkers for lesson 8 (the cost model): the ring's time from its messages, alpha and beta fitted
from three measurements, where the ring overtakes recursive doubling. The reference formulas are
the textbook ones (Thakur, Rabenseifner & Gropp 2005) written here, not imported from
minimp.measure.costmodel, so the exercises stay what the lesson derives whatever that model becomes.
Reference solutions: lessons/solutions/lesson08.py."""

import math
from typing import Callable

from minimp.lessons.checking import Report, call, close, expect

NETWORKS = {  # (alpha s, beta s/byte, gamma s/byte)
    "a 2-core machine": (15e-6, 1 / 8.7e9, 1 / 12.9e9),
    "a data centre": (5e-6, 1 / 25e9, 1 / 1e12),
}


def ring_time(nbytes: float, p: int, alpha: float, beta: float, gamma: float) -> float:
    """2(p-1) messages of n/p bytes, (p-1) reductions of n/p bytes."""
    if p == 1:
        return 0.0
    return 2 * (p - 1) * (alpha + nbytes / p * beta) + (p - 1) * nbytes / p * gamma


def recursive_doubling_time(
    nbytes: float, p: int, alpha: float, beta: float, gamma: float
) -> float:
    """log2 p rounds, each one message of n bytes and one reduction of n bytes (p = 2^k)."""
    return math.log2(p) * (alpha + nbytes * beta + nbytes * gamma)


def check_ring_allreduce_time(ring_allreduce_time: Callable[..., float],
                              quiet: bool = False) -> Report:
    """ring_allreduce_time(nbytes, p, alpha, beta, gamma): seconds for the ring all-reduce."""
    report = Report("ring_allreduce_time", quiet)
    hint = ("count per rank: 2(p - 1) messages (reduce-scatter, then all-gather) of n/p bytes "
            "each, and p - 1 additions of n/p bytes (reduce-scatter only)")

    @report.case("one rank costs nothing", hint="with p = 1 there is nothing to send")
    def _():
        got = float(call(ring_allreduce_time, 1e6, 1, 1e-5, 1e-9, 1e-10))
        expect(got == 0.0, f"returned {got}")

    @report.case("only latency (beta = gamma = 0): 2(p - 1) alpha", hint=hint)
    def _():
        for p in (2, 4, 1024):
            got = float(call(ring_allreduce_time, 1e6, p, 1e-5, 0.0, 0.0))
            expect(close(got, 2 * (p - 1) * 1e-5, 1e-9), f"p={p}: returned {got:.6g}")

    @report.case("both networks, p from 2 to 4096, 1 KiB to 1 GiB", hint=hint)
    def _():
        for name, network in NETWORKS.items():
            for p in (2, 3, 8, 4096):
                for nbytes in (1024.0, 2.0**20, 2.0**30):
                    got = float(call(ring_allreduce_time, nbytes, p, *network))
                    want = ring_time(nbytes, p, *network)
                    expect(close(got, want, 1e-9), f"{name}, p={p}, {nbytes:g} bytes: returned "
                           f"{got:.6g} s, expected {want:.6g} s")

    return report.finish()


TRUE_ALPHA, TRUE_BETA = 20e-6, 1 / 5e9
SIZES = [1024.0, 2.0**20, 2.0**24]


def check_predict_time(predict_time: Callable[[list, list, float], float],
                       quiet: bool = False) -> Report:
    """predict_time(sizes, seconds, nbytes): fit seconds = alpha + size * beta to the measurements,
    then predict the time of an nbytes message."""
    report = Report("predict_time", quiet)

    def times(noise):
        return [(TRUE_ALPHA + TRUE_BETA * n) * f for n, f in zip(SIZES, noise)]

    @report.case("exact measurements: the fourth size predicted exactly",
                 hint="two unknowns, three equations: np.linalg.lstsq, or a line through them")
    def _():
        for nbytes in (64.0, 2.0**26):
            got = float(call(predict_time, list(SIZES), times((1, 1, 1)), nbytes))
            want = TRUE_ALPHA + TRUE_BETA * nbytes
            expect(close(got, want, 1e-6), f"{nbytes:g} bytes: predicted {got:.4g} s, "
                   f"true {want:.4g} s")

    for noise in ((1.04, 0.96, 1.05), (0.95, 1.05, 0.96)):

        @report.case(
            f"measurements off by {noise}: 64 bytes within 25%, 64 MiB within 10%",
            hint="least squares on seconds lets the 16 MiB point decide alpha (its 5% is 170 us, "
            "alpha is 20 us): weigh each equation by 1/seconds, so each counts in relative error",
        )
        def _():
            for nbytes, tolerance in ((64.0, 0.25), (2.0**26, 0.10)):
                got = float(call(predict_time, list(SIZES), times(noise), nbytes))
                want = TRUE_ALPHA + TRUE_BETA * nbytes
                expect(close(got, want, tolerance), f"{nbytes:g} bytes: predicted {got:.4g} s, "
                       f"true {want:.4g} s ({got / want - 1:+.0%})")

    return report.finish()


def crossover(p: int, alpha: float, beta: float, gamma: float) -> float:
    """Where ring - recursive doubling = A + B n changes sign (inf when it never does)."""
    rounds = math.log2(p)
    a = alpha * (2 * (p - 1) - rounds)
    b = beta * (2 * (p - 1) / p - rounds) + gamma * ((p - 1) / p - rounds)
    return math.inf if b >= 0 else -a / b


def check_crossover_bytes(crossover_bytes: Callable[[int, float, float, float], float],
                          quiet: bool = False) -> Report:
    """crossover_bytes(p, alpha, beta, gamma): the message size (bytes) from which the ring
    all-reduce is faster than recursive doubling (p a power of two); math.inf if never."""
    report = Report("crossover_bytes", quiet)
    hint = ("write both times as A + B n; the ring wins where ring(n) < doubling(n): "
            "n* = (A_ring - A_doubling) / (B_doubling - B_ring)")

    @report.case("both networks, p = 4 to 1024: the two formulas cross there", hint=hint)
    def _():
        for name, network in NETWORKS.items():
            for p in (4, 8, 64, 1024):
                got = float(call(crossover_bytes, p, *network))
                want = crossover(p, *network)
                expect(close(got, want, 1e-6), f"{name}, p={p}: returned {got:.6g} bytes, the "
                       f"formulas cross at {want:.6g}")

    @report.case(
        "p = 2: both send n bytes, so only the reduction can decide (2 alpha / gamma)",
        hint="at p = 2 the ring sends two half messages, doubling one whole: the same bytes",
    )
    def _():
        got = float(call(crossover_bytes, 2, 15e-6, 1e-10, 1e-10))
        expect(close(got, crossover(2, 15e-6, 1e-10, 1e-10), 1e-6), f"returned {got:.6g}")

    @report.case("p = 2 with free reductions (gamma = 0): the ring never wins, math.inf",
                 hint="B_doubling - B_ring is 0: the sizes never cross")
    def _():
        got = float(call(crossover_bytes, 2, 15e-6, 1e-10, 0.0))
        expect(got == math.inf, f"returned {got}")

    return report.finish()


EXERCISES = [
    ("ring_allreduce_time", check_ring_allreduce_time),
    ("predict_time", check_predict_time),
    ("crossover_bytes", check_crossover_bytes),
]
