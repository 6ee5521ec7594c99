"""Lesson 18 (fewer bits, finer scales): the configuration and the figures of the notebook, which
its claims test (tests/lessons/test_lesson18.py) imports too: one outlier channel under each
scaling granularity, MX's shared exponent on a worked block, bf16 weights updated without masters,
limited accumulation; and the checkers of its exercises: the MX exponent, 1 x 128 tile scales,
stochastic rounding's two outcomes. Reference solutions: lessons/solutions/lesson18.py.

The figures are computed here with minimp/precision/blocks.py, stochastic.py and accumulate.py:
benchmarks/outlier_bench.py sends the same kind of outlier through a 768 x 512 GEMM, but benchmarks/
is not part of the installed package, and a lesson must run from any working directory."""

from typing import Any, Callable, NamedTuple

import ml_dtypes
import numpy as np

from minimp import distributed as dist
from minimp.lessons.checking import Report, call, expect
from minimp.precision import blocks
from minimp.precision.accumulate import limited_accumulation
from minimp.precision.blocks import E2M1, E4M3, E5M2, FLOAT32, ElementFormat
from minimp.precision.stochastic import RANDOM_BITS, round_to_bfloat16_stochastic
from minimp.train import TrainConfig, train

# ----- the notebook's configuration ---------------------------------------------------------------
# Granularity: x (256 tokens x 512 channels) standard normal, channel 0 times 100, seed 18.
TOKENS, CHANNELS, OUTLIER, SEED = 256, 512, 100.0, 18
# MX's shared exponent: 4,096 random 1 x 32 blocks of standard normals (seed 18).
BLOCKS = 4096
# Stochastic rounding: a bf16 weight of 1.0 receiving `UPDATES` updates of 2^-10 (a bf16 ulp at 1
# is 2^-7: half of it is 2^-8), `WEIGHTS` such weights side by side.
UPDATE, UPDATES, WEIGHTS = 2.0**-10, 100, 1000
# The short trainings: the digits MLP in bf16, Adam at lr 3e-5 (benchmarks/
# stochastic_rounding_bench.py's setting, 200 of its 1000 steps), with float32 masters and without.
TRAIN: dict[str, Any] = dict(precision="bf16", optimizer="adam", lr=3e-5, steps=200, seed=0,
                             log_every=10**6)
RUNS = (("fp32 masters", dict(master_weights="fp32")),
        ("bf16, to nearest", dict(master_weights="none")),
        ("bf16, stochastic", dict(master_weights="none", stochastic_rounding=True)))
TAIL = 50  # steps averaged for a run's final loss
# Limited accumulation: (8, 4096) @ (4096, 8) standard normals (seed 18) in a 14-bit accumulator.
ACCUMULATION_SHAPE = (8, 4096, 8)


class Granularity(NamedTuple):
    """A way to scale x: element format, group shape (blocks.GROUP_SHAPES), scale rule."""

    name: str
    fmt: ElementFormat
    group: str
    rule: str


GRANULARITIES = (
    Granularity("fp8 per-tensor", E4M3, "tensor", "current"),
    Granularity("fp8 rowwise", E4M3, "rowwise", "current"),
    Granularity("fp8 1x128", E4M3, "1x128", "current"),
    Granularity("MXFP8 1x32", E4M3, "1x32", "mx_floor"),
    Granularity("FP4 per-tensor", E2M1, "tensor", "current"),
    Granularity("NVFP4 1x16", E2M1, "1x16", "nvfp4"),
)


def outlier_input() -> np.ndarray:
    """x (TOKENS, CHANNELS) float32 standard normal with channel 0 times OUTLIER."""
    x = np.random.default_rng(SEED).standard_normal((TOKENS, CHANNELS)).astype(FLOAT32)
    x[:, 0] *= np.float32(OUTLIER)
    return x


def granularity_errors(x: np.ndarray) -> dict[str, dict[str, float]]:
    """{name: {"all": relative error of x, "rest": of the other channels alone, "zero": share of
    the other channels' values stored as 0}} for each of GRANULARITIES (errors in float64)."""
    table = {}
    for g in GRANULARITIES:
        q = blocks.quantize(x, g.fmt, g.group, g.rule)
        rest = (blocks.dequantize(q) - x)[:, 1:].astype(np.float64)
        table[g.name] = {
            "all": blocks.quantization_error(x, g.fmt, g.group, g.rule),
            "rest": float(np.linalg.norm(rest) / np.linalg.norm(x[:, 1:].astype(np.float64))),
            "zero": float(np.mean(q.data[:, 1:].astype(FLOAT32) == 0)),
        }
    return table


def binades(fmt: ElementFormat) -> float:
    """log2(max / smallest subnormal), from ml_dtypes.finfo: the magnitudes fmt holds."""
    info = ml_dtypes.finfo(fmt.dtype)
    return float(np.log2(float(info.max) / float(info.smallest_subnormal)))


def random_blocks() -> np.ndarray:
    """(BLOCKS, 32) float32 standard normals: one MX block a row."""
    return np.random.default_rng(SEED).standard_normal((BLOCKS, 32)).astype(FLOAT32)


def worked_block() -> np.ndarray:
    """An MX block of 32 float32 values: standard normals times 0.4 (seed 18), the first 1.9, an
    amax whose mantissa lies above E4M3's 1.75."""
    block = (np.random.default_rng(SEED).standard_normal(32) * 0.4).astype(FLOAT32)
    block[0] = 1.9
    return block


def rule_costs(x: np.ndarray) -> dict[str, dict[str, float]]:
    """{format name: {"clipped": share of blocks whose amax lands past max under the floor rule,
    rule: relative error, rule + " zero": share of values stored as 0, for rule mx_floor and
    mx_round_up}} for E4M3 and E2M1 1 x 32 blocks of x (no value of x is 0)."""
    amax = np.abs(x).max(axis=1)
    mantissa = amax / np.exp2(blocks.floor_log2(amax)).astype(FLOAT32)  # in [1, 2), exact
    table = {}
    for fmt in (E4M3, E2M1):
        top = fmt.max / 2.0**fmt.emax  # max's own mantissa: 1.75 for E4M3, 1.5 for E2M1
        table[fmt.name] = {"clipped": float(np.mean(mantissa > top))}
        for rule in ("mx_floor", "mx_round_up"):
            table[fmt.name][rule] = blocks.quantization_error(x, fmt, "1x32", rule)
            stored = blocks.quantize(x, fmt, "1x32", rule).data.astype(FLOAT32)
            table[fmt.name][rule + " zero"] = float(np.mean(stored == 0))
    return table


def stalled_weights() -> dict[str, np.ndarray]:
    """WEIGHTS bf16 weights of 1.0 after UPDATES additions of UPDATE each, every sum rounded back
    to bf16 to nearest ("nearest") or stochastically ("stochastic", bits from seed 18): float32."""
    rng = np.random.default_rng(SEED)
    nearest = np.ones(WEIGHTS, ml_dtypes.bfloat16)
    stochastic = np.ones(WEIGHTS, ml_dtypes.bfloat16)
    for _ in range(UPDATES):  # fp32 on purpose: the optimizer adds in float32, then writes bf16
        nearest = (nearest.astype(FLOAT32) + np.float32(UPDATE)).astype(ml_dtypes.bfloat16)
        bits = rng.integers(0, 1 << RANDOM_BITS, WEIGHTS, dtype=np.uint32)
        stochastic = round_to_bfloat16_stochastic(stochastic.astype(FLOAT32) + np.float32(UPDATE),
                                                  bits)
    return {"nearest": nearest.astype(FLOAT32), "stochastic": stochastic.astype(FLOAT32)}


def every_rounding(x: float) -> np.ndarray:
    """float32 x rounded stochastically to bf16 with each of the 65,536 values of its random bits,
    as float32 (65,536,)."""
    bits = np.arange(1 << RANDOM_BITS, dtype=np.uint32)
    return round_to_bfloat16_stochastic(np.full(bits.shape, x, FLOAT32), bits).astype(FLOAT32)


def train_runs() -> dict[str, list[float]]:
    """{run name: its training losses} for RUNS, each on one process from the same seed."""
    losses = {}
    for name, flags in RUNS:
        config = TrainConfig(**TRAIN, **flags)
        config.validate(1)
        result = dist.simulate(1, lambda comm: train(config, lambda line: None, comm=comm))[0]
        losses[name] = [row["loss"] for row in result["history"] if "loss" in row]
    return losses


def accumulation_errors() -> dict[str, float]:
    """Relative Frobenius errors against float64 of a @ b (ACCUMULATION_SHAPE): in plain float32
    ("fp32"), in the 14-bit accumulator over all K ("14 bits, no promotion") and promoted to
    float32 every 128 products ("14 bits, promoted every 128")."""
    m, k, n = ACCUMULATION_SHAPE
    rng = np.random.default_rng(SEED)
    a = rng.standard_normal((m, k)).astype(FLOAT32)
    b = rng.standard_normal((k, n)).astype(FLOAT32)
    want = a.astype(np.float64) @ b.astype(np.float64)

    def error(got: np.ndarray) -> float:
        return float(np.linalg.norm(got - want) / np.linalg.norm(want))

    return {"fp32": error(a @ b),  # fp32 on purpose: the reference the promotion aims at
            "14 bits, no promotion": error(limited_accumulation(a, b, interval=k)),
            "14 bits, promoted every 128": error(limited_accumulation(a, b, interval=128))}


# ----- exercise 1: the MX exponent ----------------------------------------------------------------
def _amaxes() -> np.ndarray:
    """Positive float32 amaxes: random over many binades, mantissas near 1, 1.75 and 2, exact
    powers of two, the float32 just below them, and subnormals deep enough to need the clamp."""
    rng = np.random.default_rng(SEED)
    random = np.exp2(rng.uniform(-20, 20, 200)).astype(FLOAT32)
    powers = np.exp2(np.arange(-10, 11)).astype(FLOAT32)
    below = np.nextafter(powers, np.float32(0))
    edges = np.array([1.75, 1.8, 1.875, 1.9, 1.99, 448, 480, 500, 6, 7], FLOAT32)
    tiny = np.array([2.0**-130, 2.0**-140, 2.0**-149], FLOAT32)
    return np.concatenate([random, powers, below, edges, tiny])


def check_mx_exponent(mx_exponent: Callable, quiet: bool = False) -> Report:
    """mx_exponent(amax, emax) -> the E8M0 exponents X (ints) of MX blocks with these amaxes:
    floor(log2 amax) - emax, clamped to E8M0's -127 .. 127 (OCP MX v1.0 section 6.3), for a
    float32 array of positive finite amaxes. Compared with blocks.mx_floor_exponent."""
    report = Report("mx_exponent", quiet)
    amax = _amaxes()

    def compare(fmt: ElementFormat, values: np.ndarray) -> None:
        got = np.asarray(call(mx_exponent, values.copy(), fmt.emax))
        want = blocks.mx_floor_exponent(values, fmt)
        expect(got.shape == want.shape, f"{fmt}: shape {got.shape}, expected {want.shape}")
        wrong = np.flatnonzero(got != want)
        if wrong.size == 0:
            return
        i = wrong[0]
        log2 = float(np.log2(np.float64(values[i])))
        extra = ""
        if got[i] < -127:
            extra = " (below E8M0's smallest exponent, -127: clamp)"
        elif np.round(log2) - fmt.emax == got[i]:
            extra = " (log2 rounded to nearest, not floored)"
        elif np.floor(log2) == got[i]:
            extra = f" (emax = {fmt.emax} not subtracted)"
        elif np.floor(np.log2(values[i])) - fmt.emax == got[i]:
            extra = " (a float32 log2 rounded up to the next integer: use the bits)"
        expect(False, f"{fmt}: {wrong.size} of {values.size} wrong; amax {values[i]!r} "
               f"(log2 {log2:.7f}): X = {got[i]}, expected {want[i]}{extra}")

    @report.case("E4M3 (emax 8): random amaxes, mantissas 1.75 to 1.99, 448, 480, 500",
                 hint="X = floor(log2 amax) - emax: the floor puts amax / 2^X in [2^emax, "
                 "2^(emax+1)), the binade holding max; rounding log2 to nearest or forgetting "
                 "to subtract emax puts it elsewhere")
    def _():
        compare(E4M3, amax[amax > 2.0**-100])

    @report.case("E5M2 (emax 15) and E2M1 (emax 2), powers of two and the float32 just below",
                 hint="compute floor(log2) from the bits (np.frexp: amax = m 2^e with m in "
                 "[0.5, 1), so floor(log2 amax) = e - 1); a float32 log2 rounds 2 - 2^-23 to 1")
    def _():
        for fmt in (E5M2, E2M1):
            compare(fmt, amax[amax > 2.0**-100])

    @report.case("subnormal amaxes, 2^-130 to 2^-149: the clamp at -127",
                 hint="E8M0 holds exponents -127 .. 127: clamp X into that range")
    def _():
        compare(E4M3, amax[amax < 2.0**-100])

    return report.finish()


# ----- exercise 2: 1 x 128 tile scales ------------------------------------------------------------
def check_tile_scales(tile_scales: Callable, quiet: bool = False) -> Report:
    """tile_scales(x) -> scale_inv (R, C / 128) float32: for x (R, C), C a multiple of 128, each
    1 x 128 tile's amax / 448 (E4M3's max), the number decoding multiplies the tile's values by.
    Compared with blocks.quantize(x, E4M3, "1x128", "current").scale_inv to a relative 1e-6."""
    report = Report("tile_scales", quiet)

    def compare(x: np.ndarray) -> None:
        got = np.asarray(call(tile_scales, x.copy()), dtype=np.float64)
        want = blocks.quantize(x, E4M3, "1x128", "current").scale_inv.astype(np.float64)
        rows, columns = x.shape
        extra = ""
        if got.shape == (rows // 128, columns) or got.shape == want.shape[::-1] != want.shape:
            extra = " (groups of 128 rows: 128 x 1; the tiles run along K, a row's columns)"
        expect(got.shape == want.shape, f"x {x.shape}: scales of shape {got.shape}, expected "
               f"(R, C / 128) = {want.shape}{extra}")
        if np.allclose(got * want, 1.0, rtol=1e-5):
            extra = " (448 / amax is the scale that encodes; scale_inv = amax / 448 decodes)"
        elif np.all(got <= want * (1 + 1e-6)) and not np.allclose(got, want, rtol=1e-6):
            extra = " (a tile's amax is the largest magnitude: max of abs(x), not of x)"
        expect(np.allclose(got, want, rtol=1e-6, atol=0), f"x {x.shape}: scales differ, "
               f"largest relative difference {np.max(np.abs(got / want - 1)):.3g}{extra}")

    @report.case("x (4, 512) with one large negative value per row",
                 hint="amax is max |x| over the tile; scale_inv = amax / 448 multiplies the "
                 "stored values back (448 / amax is its inverse, which encodes)")
    def _():
        x = np.random.default_rng(SEED).standard_normal((4, 512)).astype(FLOAT32)
        x[np.arange(4), [5, 200, 300, 511]] = -50
        compare(x)

    @report.case("x (256, 512) and (256, 256): the outlier input, and a square one",
                 hint="the tiles are 1 x 128: one row, 128 consecutive columns (K), so "
                 "x.reshape(R, C // 128, 128); 128 rows x 1 column is DeepSeek-V3's other shape")
    def _():
        compare(outlier_input())
        compare(np.random.default_rng(SEED + 1).standard_normal((256, 256)).astype(FLOAT32))

    return report.finish()


# ----- exercise 3: stochastic rounding's two outcomes ---------------------------------------------
def _sr_inputs() -> np.ndarray:
    """float32 values, both signs, from subnormals to 1e30, some already bf16 (low bits 0)."""
    rng = np.random.default_rng(SEED)
    x = (rng.standard_normal(40) * np.exp2(rng.uniform(-30, 30, 40))).astype(FLOAT32)
    exact = np.array([1.0, -2.5, 0.0], FLOAT32)
    tiny = np.array([1e-40, -3e-39], FLOAT32)
    return np.concatenate([x, -x[:10], exact, tiny, np.array([1 + 2**-10, 1 + 2**-20], FLOAT32)])


def check_sr_outcomes(sr_outcomes: Callable, quiet: bool = False) -> Report:
    """sr_outcomes(x) -> (lower, upper, p): for a float32 array x, the bf16 value stochastic
    rounding can give toward zero (x with its low 16 bits cleared) and away from zero (the next
    bf16 of x's sign), as float32, and the probability p of `upper`. Checked against minimp's
    round_to_bfloat16_stochastic over all 2^16 values of its random bits, and E[result] == x."""
    report = Report("sr_outcomes", quiet)
    x = _sr_inputs()

    def outcomes() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        got = call(sr_outcomes, x.copy())
        expect(len(got) == 3, f"returned {len(got)} things, expected (lower, upper, p)")
        return tuple(np.asarray(part, np.float64) for part in got)  # type: ignore[return-value]

    truncated = (x.view(np.uint32) & np.uint32(0xFFFF0000)).view(FLOAT32).astype(np.float64)
    low = (x.view(np.uint32) & np.uint32(0xFFFF)).astype(np.float64)

    @report.case("the two outcomes: truncated, and the next bf16 away from zero",
                 hint="lower: clear the low 16 bits (truncate toward zero, not to nearest); "
                 "upper: the bf16 pattern after it, away from zero for negative x too")
    def _():
        lower, upper, _ = outcomes()
        bad = np.flatnonzero(lower != truncated)
        expect(bad.size == 0, f"lower of {x[bad[:1]]} is {lower[bad[:1]]}, expected "
               f"{truncated[bad[:1]]} (truncate: clear the low 16 bits)")
        for i in range(x.size):
            rounded = every_rounding(float(x[i])).astype(np.float64)
            seen = set(rounded.tolist()) - {truncated[i]}
            want = seen.pop() if seen else None
            if want is not None:
                expect(upper[i] == want, f"upper of {x[i]!r} is {upper[i]!r}, expected {want!r}"
                       + (" (away from zero: for negative x the upper outcome is more negative)"
                          if x[i] < 0 else ""))

    @report.case("p against all 65,536 values of the random bits; E[result] == x exactly",
                 hint="p = low / 2^16, low the 16 cleared bits as an integer: not a fair coin "
                 "(0.5), not low / 65535; then lower + p (upper - lower) is x exactly")
    def _():
        lower, upper, p = outcomes()
        want = low / 2.0**RANDOM_BITS
        bad = np.flatnonzero(p != want)
        extra = " (not a fair coin)" if np.all(p == 0.5) else ""
        if bad.size and np.allclose(p[bad], low[bad] / 65535):
            extra = " (2^16 values of the random bits: divide by 65536)"
        expect(bad.size == 0, f"p of {x[bad[:1]]} is {p[bad[:1]]}, expected {want[bad[:1]]}"
               + extra)
        mean = lower + p * (upper - lower)
        expect(np.array_equal(mean[low > 0], x[low > 0].astype(np.float64)),
               "lower + p (upper - lower) differs from x")

    return report.finish()


EXERCISES = [
    ("mx_exponent", check_mx_exponent),
    ("tile_scales", check_tile_scales),
    ("sr_outcomes", check_sr_outcomes),
]
