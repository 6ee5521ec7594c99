"""Checkers for lesson 8 (the cost model): the ring's time from its messages, alpha and beta fitted
from three measurements, where the ring overtakes recursive doubling; and the configurations the
notebook prints. The checkers' reference formulas are the textbook ones (Thakur, Rabenseifner &
Gropp 2005) written here, not imported from minimp.measure.costmodel, so the exercises stay what
the lesson derives whatever that model becomes.
Reference solutions: lessons/solutions/lesson08.py."""

import math
from typing import Callable

import numpy as np

from minimp.lessons.checking import Report, call, close, expect
from minimp.measure import costmodel

# What lessons/08_scale.ipynb runs and prints; tests/lessons/test_lesson08.py checks the same.
BENCH_FLAGS = ("--max-mib", "4", "--rounds", "4")  # 4 KiB to 4 MiB, 4 rounds: a few seconds
STRETCHES = {  # sizes by what their all-reduce time is mostly made of
    "4 KiB-64 KiB, fixed costs (agreement, Python, latency)": (2**12, 2**16),
    "128 KiB-4 MiB, bytes": (2**17, 2**22),
}
SCALE_BYTES = (2**20, 2**30)  # the all-reduces priced on the data-centre network
SCALE_RANKS = [2**k for k in range(1, 13)]


def best_algorithm(nbytes: float, p: int) -> str:
    """The fastest of costmodel's all-reduce formulas on costmodel.DATACENTER."""
    return min(costmodel.ALLREDUCE_MODELS,
               key=lambda name: costmodel.allreduce_time(name, nbytes, p, costmodel.DATACENTER))


def ring_over_best(nbytes: float, p: int) -> float:
    """The ring's time over the fastest algorithm's, on costmodel.DATACENTER."""
    best = costmodel.allreduce_time(best_algorithm(nbytes, p), nbytes, p, costmodel.DATACENTER)
    return costmodel.ring_allreduce_time(nbytes, p, costmodel.DATACENTER) / best

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


def relative_fit(sizes: list, seconds: list) -> tuple[float, float]:
    """(alpha, beta) minimising the sum of ((alpha + size beta) / seconds - 1)^2."""
    seconds_ = np.asarray(seconds, float)
    design = np.stack([np.ones(len(sizes)), np.asarray(sizes, float)], axis=1) / seconds_[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(design, np.ones(len(sizes)), rcond=None)
    return float(alpha), float(beta)


def check_predict_time(predict_time: Callable[[list, list, float], float],
                       quiet: bool = False) -> Report:
    """predict_time(sizes, seconds, nbytes): fit seconds = alpha + size * beta to the measurements
    in relative error, then predict the time of an nbytes message."""
    report = Report("predict_time", quiet)

    def times(noise):
        return [(TRUE_ALPHA + TRUE_BETA * n) * f for n, f in zip(SIZES, noise)]

    @report.case("exact measurements: the fourth size predicted exactly",
                 hint="two unknowns, three equations: use all three measurements in one fit")
    def _():
        for nbytes in (64.0, 2.0**26):
            got = float(call(predict_time, list(SIZES), times((1, 1, 1)), nbytes))
            want = TRUE_ALPHA + TRUE_BETA * nbytes
            expect(close(got, want, 1e-6), f"{nbytes:g} bytes: predicted {got:.4g} s, "
                   f"true {want:.4g} s")

    for noise in ((1.04, 0.96, 1.05), (0.95, 1.05, 0.96)):

        @report.case(
            f"measurements off by {noise}: the fit in relative error, at 64 bytes and 64 MiB",
            hint="least squares on the seconds lets the 16 MiB point decide alpha (its 5% is "
            "170 us, alpha is 20 us); in relative error each equation is divided by its measured "
            "seconds (np.polyfit: w = 1/seconds), and all three measurements count",
        )
        def _():
            alpha, beta = relative_fit(SIZES, times(noise))
            for nbytes in (64.0, 2.0**26):
                got = float(call(predict_time, list(SIZES), times(noise), nbytes))
                want, true = alpha + beta * nbytes, TRUE_ALPHA + TRUE_BETA * nbytes
                expect(close(got, want, 1e-6), f"{nbytes:g} bytes: predicted {got:.4g} s, the "
                       f"fit in relative error predicts {want:.4g} s (the true time {true:.4g} s)")

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
    hint = ("write both times as A + B n: the ring's A is 2(p - 1) alpha, its B counts the bytes "
            "it sends (beta) and adds (gamma), doubling's log2 p (alpha + n beta + n gamma); "
            "the ring wins where ring(n) < doubling(n): n* = (A_ring - A_doubling) / "
            "(B_doubling - B_ring)")

    @report.case("both networks, p = 4 to 1024: the two formulas cross there", hint=hint)
    def _():
        for name, network in NETWORKS.items():
            for p in (4, 8, 64, 1024):
                got = float(call(crossover_bytes, p, *network))
                want = crossover(p, *network)
                # a size rounded to a whole byte (up or down) is as right as the real number
                expect(close(got, want, 1e-6) or abs(got - want) <= 1.0,
                       f"{name}, p={p}: returned {got:.6g} bytes, the "
                       f"formulas cross at {want:.6g}")

    @report.case(
        "p = 2: both send n bytes, so only the reduction can decide (2 alpha / gamma)",
        hint="at p = 2 the ring sends two half messages, doubling one whole: the same bytes",
    )
    def _():
        got = float(call(crossover_bytes, 2, 15e-6, 1e-10, 1e-10))
        want = crossover(2, 15e-6, 1e-10, 1e-10)
        expect(close(got, want, 1e-6) or abs(got - want) <= 1.0, f"returned {got:.6g}")

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
