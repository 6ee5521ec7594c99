"""Benchmark: one outlier channel through each block-scaled recipe, and bytes per parameter.

    python benchmarks/outlier_bench.py              # x 768 x 512 (channel 0 x 100), w 512 x 256
    python benchmarks/outlier_bench.py --json       # one JSON object for machines
    python benchmarks/outlier_bench.py --m 64 --n 128   # a smaller GEMM (K, N multiples of 128)

Issue 41's "Outliers, measured". x (M, K) is a standard normal with one input channel (a column,
along K) times 100, as LLM activations grow a few huge channels; w (K, N) a standard normal; both
drawn from one generator (x first) with the seed given. Each recipe quantizes both operands along
K, as a GEMM's scales must run (x's rows, w's columns: w.T is quantized as an (N, K) array), with
minimp/precision/blocks.py, and the GEMM runs in float32 on the dequantized operands: accumulation
is the same in every row, so only the quantization differs. The errors printed, each a relative
Frobenius error ||got - want|| / ||want|| in float64:

    input        Q(x) against x                        (as blocks.quantization_error)
    x only       Q(x) @ w against x @ w                (only the input quantized)
    both         Q(x) @ Q(w) against x @ w             (both operands)
    rest x       the other K - 1 channels' part of the output alone: Q(x)[:, rest] @ w[rest]
    rest both    the same with Q(w)                    against x[:, rest] @ w[rest]

The outlier channel dominates the output's norm (100^2 against K - 1 in variance), so "x only" and
"both" measure mostly how the outlier's own values round; "rest" measures what the outlier does to
everything else, which is what "per-tensor FP4 zeroes the other channels (error 1.0)" means.

Then the bytes a parameter takes in each weight format, from the formats' definitions (value bits,
one scale per group of blocks.py's group shapes, NVFP4's float32 tensor scale), beside minimp's
other model states and the Ultra-Scale Playbook's table.
"""

import argparse
import json
import textwrap
from fractions import Fraction
from typing import NamedTuple

import ml_dtypes
import numpy as np

from minimp.precision import blocks
from minimp.precision.blocks import E2M1, E4M3, E8M0, FLOAT32, ElementFormat


class Recipe(NamedTuple):
    """A quantized GEMM: the element format, the groups of x (M, K) and of w.T (N, K), both along
    K, the scale rule (blocks.RULES), and issue 41's figure for it (None where it gives none)."""

    name: str
    fmt: ElementFormat
    input_group: str
    weight_group: str
    rule: str
    issue: float | None


# Weights take the published recipes' groups: DeepSeek-V3's 128 x 128 blocks (report section 3.3),
# NVFP4's 16 x 16 ("Pretraining Large Language Models with NVFP4", section 4).
RECIPES = (
    Recipe("fp8 per-tensor", E4M3, "tensor", "tensor", "current", 3.4e-2),
    Recipe("fp8 rowwise", E4M3, "rowwise", "rowwise", "current", None),
    Recipe("fp8 1x128 (DeepSeek-V3)", E4M3, "1x128", "128x128", "current", 2.3e-2),
    Recipe("MXFP8, floor scale", E4M3, "1x32", "1x32", "mx_floor", 4.3e-2),
    Recipe("MXFP8, round-up scale", E4M3, "1x32", "1x32", "mx_round_up", None),
    Recipe("FP4 (E2M1) per-tensor", E2M1, "tensor", "tensor", "current", 1.0),
    Recipe("NVFP4", E2M1, "1x16", "16x16", "nvfp4", 0.18),
)
MEASURES = ("input", "x only", "both", "rest x", "rest both")
FP8_RECIPES = tuple(r.name for r in RECIPES if r.fmt is E4M3)


def operands(m: int, k: int, n: int, seed: int, outlier: float = 100.0,
             channel: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(x (M, K) with input channel `channel` times `outlier`, w (K, N)), float32 standard normals
    from one generator, x drawn first."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)).astype(FLOAT32)
    x[:, channel] *= np.float32(outlier)
    return x, rng.standard_normal((k, n)).astype(FLOAT32)


def along_k(x: np.ndarray, w: np.ndarray, recipe: Recipe) -> tuple[blocks.BlockQuantized, ...]:
    """x (M, K) and w.T (N, K) quantized by the recipe: both operands' groups run along K."""
    return (blocks.quantize(x, recipe.fmt, recipe.input_group, recipe.rule),
            blocks.quantize(np.ascontiguousarray(w.T), recipe.fmt, recipe.weight_group,
                            recipe.rule))


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """||got - want||_F / ||want||_F, in float64."""
    want = want.astype(np.float64)
    return float(np.linalg.norm(got.astype(np.float64) - want) / np.linalg.norm(want))


def errors(x: np.ndarray, w: np.ndarray, recipe: Recipe, channel: int = 0) -> dict[str, float]:
    """{measure: relative error} for MEASURES (the module docstring's table)."""
    qx, qw = along_k(x, w, recipe)
    dx, dw = blocks.dequantize(qx), blocks.dequantize(qw).T  # (M, K), (K, N) float32
    rest = np.arange(x.shape[1]) != channel
    # fp32 on purpose: every recipe's GEMM accumulates alike, so only the quantization differs
    return {
        "input": relative_error(dx, x),
        "x only": relative_error(dx @ w, x @ w),
        "both": relative_error(dx @ dw, x @ w),
        "rest x": relative_error(dx[:, rest] @ w[rest], x[:, rest] @ w[rest]),
        "rest both": relative_error(dx[:, rest] @ dw[rest], x[:, rest] @ w[rest]),
    }


def binades(fmt: ElementFormat) -> float:
    """log2(max / smallest subnormal): the magnitudes a format holds, from ml_dtypes.finfo."""
    info = ml_dtypes.finfo(fmt.dtype)
    return float(np.log2(float(info.max) / float(info.smallest_subnormal)))


def stored_rest(x: np.ndarray, recipe: Recipe, channel: int = 0) -> np.ndarray:
    """|the values| x's quantization stores for the other channels, (M, K - 1), scales not
    applied: 0 where a value rounded to zero."""
    data = blocks.quantize(x, recipe.fmt, recipe.input_group, recipe.rule).data
    return np.abs(np.delete(data.astype(FLOAT32), channel, axis=1))


def explanations(x: np.ndarray, table: dict[str, dict[str, float]], outlier: float,
                 channel: int = 0) -> list[str]:
    """Two lines: why the fp8 recipes barely differ, why FP4 needs blocks; every number computed."""
    recipes = {r.name: r for r in RECIPES}
    spread = max(max(table[r][m] for r in FP8_RECIPES) / min(table[r][m] for r in FP8_RECIPES)
                 for m in ("rest x", "rest both"))
    smallest_normal = ml_dtypes.finfo(E4M3.dtype).smallest_normal
    subnormal = (stored_rest(x, recipes["fp8 per-tensor"], channel) < smallest_normal).mean()
    zeroed = (stored_rest(x, recipes["FP4 (E2M1) per-tensor"], channel) == 0).mean()
    fp4, nvfp4 = table["FP4 (E2M1) per-tensor"], table["NVFP4"]
    ratios = ", ".join(f"{fp4[m] / nvfp4[m]:.1f}x on {m}" for m in MEASURES)
    block = blocks.resolve_group_shape(x.shape, recipes["NVFP4"].input_group)[1]
    start = channel - channel % block  # the outlier's block of input channels
    neighbours = stored_rest(x, recipes["NVFP4"], channel)[:, start:start + block - 1]
    share = np.sqrt((block - 1) / (x.shape[1] - 1))
    return [
        f"Why the fp8 recipes barely differ: E4M3 spans {binades(E4M3):.1f} binades (log2 of 448 "
        f"over 2^-9, ml_dtypes.finfo) and the {outlier:g}x outlier takes {np.log2(outlier):.1f}: "
        f"per tensor only {subnormal:.1%} of the other channels' values fall below E4M3's "
        f"smallest normal, so on the other channels' part every fp8 recipe is within "
        f"{spread:.2f}x of the others.",
        f"Why FP4 needs blocks: E2M1 spans {binades(E2M1):.1f} binades (6 over 0.5), fewer than "
        f"the outlier's {np.log2(outlier):.1f}: per tensor {zeroed:.1%} of the other channels' "
        f"values round to 0. NVFP4 against FP4 per-tensor: {ratios}. NVFP4's own rest error is "
        f"mostly the {block - 1} channels sharing the outlier's block "
        f"({(neighbours == 0).mean():.1%} of their values round to 0): all zeroed, they alone "
        f"would give about sqrt({block - 1}/"
        f"{x.shape[1] - 1}) = {share:.3f}.",
    ]


def print_errors(table: dict[str, dict[str, float]], shape: tuple[int, int, int], seed: int,
                 outlier: float) -> None:
    m, k, n = shape
    print(f"Outliers: x ({m} x {k}, channel 0 times {outlier:g}) @ w ({k} x {n}), seed {seed}: "
          f"relative error\nagainst float32, each operand quantized along K, the GEMM in float32")
    print(f"  {'recipe':<24}{'x groups':>9}{'w groups':>9}"
          + "".join(f"{name:>10}" for name in MEASURES) + f"{'issue 41':>9}")
    for recipe in RECIPES:
        cells = "".join(f"{table[recipe.name][name]:>10.2e}" for name in MEASURES)
        issue = f"{recipe.issue:>9.2g}" if recipe.issue is not None else ""
        print(f"  {recipe.name:<24}{recipe.input_group:>9}{recipe.weight_group:>9}{cells}{issue}")


# ----- bytes per parameter ---------------------------------------------------------------------


class WeightFormat(NamedTuple):
    """How a weight is stored: element format, scaling groups of w.T (N, K), scale rule, and the
    Ultra-Scale Playbook's nearest row ("" where its table has none)."""

    name: str
    fmt: ElementFormat
    group: str
    rule: str
    playbook: str


# A scale per 1 x 16 values is NVFP4's definition (4.5 bits a value): the block-scaled GEMM reads
# one for every 16 values along K, so 16 x 16 weight blocks hand it each block's scale 16 times;
# kept once per block they take 1/256 byte a value (the last row).
WEIGHT_FORMATS = (
    WeightFormat("fp8 per-tensor", E4M3, "tensor", "current", "TE"),
    WeightFormat("fp8 rowwise", E4M3, "rowwise", "current", ""),
    WeightFormat("fp8 blockwise 128x128", E4M3, "128x128", "current", "DeepSeek-V3"),
    WeightFormat("MXFP8", E4M3, "1x32", "mx_floor", ""),
    WeightFormat("NVFP4", E2M1, "1x16", "nvfp4", ""),
    WeightFormat("NVFP4, scale per 16x16", E2M1, "16x16", "nvfp4", ""),
)
# What one scale is stored in, by rule (blocks.py): current scaling's float32 scale_inv
# (Transformer Engine's), an E8M0 exponent (OCP MX v1.0 section 5.4.1), an E4M3 scale (NVFP4).
SCALE_DTYPES = {"current": FLOAT32, "mx_floor": E8M0, "mx_round_up": E8M0,
                "nvfp4": np.dtype(E4M3.dtype)}
TENSOR_SCALE_BYTES = {"nvfp4": FLOAT32.itemsize}  # NVFP4's float32 scale for the whole tensor
# minimp's model states besides the weights, the same under every recipe (parallel/zero/
# formulas.py, stage 0): float32 gradient accumulators, Adam's two float32 moments, float32 masters.
GRADIENT_BYTES, OPTIMIZER_BYTES, MASTER_BYTES = 4, 2 * 4, 4
BF16_BYTES = np.dtype(ml_dtypes.bfloat16).itemsize

# The Ultra-Scale Playbook (https://huggingface.co/spaces/nanotron/ultrascale-playbook), section
# "FP8 pretraining", its table of known approaches to FP8 training: {short name: (its row's name,
# bytes per parameter of master weights, accumulated gradients, weights, gradients, optimizer
# states, total)}.
PLAYBOOK = {
    "baseline": ("BF16 with FP32 mixed precision baseline", 4, 4, 2, 2, 8, 20),
    "no fp32 grads": ("The above without FP32 grad accumulation", 4, 0, 2, 2, 8, 16),
    "TE": ("Transformer engine", 0, 0, 4, 4, 8, 16),
    "FP8-LM O3": ("FP8-LM's O3 level", 2, 2, 1, 1, 3, 9),
    "DeepSeek-V3": ("DeepSeek-V3", 4, 4, 1, 2, 4, 15),
    "Nanotron": ("Nanotron's FP8", 2, 4, 1, 1, 2, 10),
}


def value_bytes(fmt: ElementFormat) -> Fraction:
    """Bytes a value takes packed: the format's bits / 8 (E2M1: 1/2). ml_dtypes stores a 4-bit
    value in a whole byte; hardware packs two."""
    return Fraction(ml_dtypes.finfo(fmt.dtype).bits, 8)


def scale_bytes(shape: tuple[int, int], group: str, rule: str) -> int:
    """The bytes of a (R, C) tensor's scales: one per group in the rule's scale format, plus the
    tensor scale where the rule has one (NVFP4)."""
    rows, cols = blocks.resolve_group_shape(shape, group)
    groups = (shape[0] // rows) * (shape[1] // cols)
    return groups * SCALE_DTYPES[rule].itemsize + TENSOR_SCALE_BYTES.get(rule, 0)


def weight_bytes(shape: tuple[int, int], weight: WeightFormat) -> Fraction:
    """Bytes per parameter of a (R, C) weight stored in the format: values + scales."""
    parameters = shape[0] * shape[1]
    return value_bytes(weight.fmt) + Fraction(scale_bytes(shape, weight.group, weight.rule),
                                              parameters)


def weight_formula(shape: tuple[int, int], weight: WeightFormat) -> str:
    """weight_bytes as a sum a reader can check: values + scale bytes / group (+ 4/P)."""
    rows, cols = blocks.resolve_group_shape(shape, weight.group)
    group = "P" if (rows, cols) == shape else str(rows * cols)
    terms = [str(value_bytes(weight.fmt)), f"{SCALE_DTYPES[weight.rule].itemsize}/{group}"]
    if weight.rule in TENSOR_SCALE_BYTES:
        terms.append(f"{TENSOR_SCALE_BYTES[weight.rule]}/P")
    return " + ".join(terms)


def bytes_table(shape: tuple[int, int]) -> list[dict]:
    """A row per weight format (bf16 first): weights, gradients, optimizer state, masters, total."""
    rows = [("bf16", Fraction(BF16_BYTES), str(BF16_BYTES), "baseline")]
    rows += [(w.name, weight_bytes(shape, w), weight_formula(shape, w), w.playbook)
             for w in WEIGHT_FORMATS]
    others = GRADIENT_BYTES + OPTIMIZER_BYTES + MASTER_BYTES
    return [{"recipe": name, "formula": formula, "weights": float(weights),
             "gradients": GRADIENT_BYTES, "optimizer": OPTIMIZER_BYTES, "masters": MASTER_BYTES,
             "total": float(weights + others), "playbook": playbook}
            for name, weights, formula, playbook in rows]


def print_bytes(rows: list[dict], shape: tuple[int, int]) -> None:
    print(f"\nBytes per parameter: a {shape[0]} x {shape[1]} weight (w.T, P = "
          f"{shape[0] * shape[1]:,}) stored in each format,\nminimp's other model states beside it")
    print(f"  {'format':<25}{'weights (formula)':<18}{'weights':>8}{'grads':>6}{'optim':>6}"
          f"{'master':>7}{'total':>9}  Playbook")
    for row in rows:
        short = row["playbook"]
        nearest = f"{short}: {PLAYBOOK[short][-1]}" if short else "none"
        print(f"  {row['recipe']:<25}{row['formula']:<18}{row['weights']:>8.5f}"
              f"{row['gradients']:>6}{row['optimizer']:>6}{row['masters']:>7}{row['total']:>9.5f}"
              f"  {nearest}")
    print("The Ultra-Scale Playbook's FP8 table: master + accumulated grads + weights + grads +"
          " optimizer")
    for short, (name, *parts, total) in PLAYBOOK.items():
        print(f"  {name + ' (' + short + ')':<58}{' + '.join(str(p) for p in parts)} = {total}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--m", type=int, default=768, help="rows of x (tokens)")
    parser.add_argument("--k", type=int, default=512, help="the GEMM's K: x's columns, w's rows")
    parser.add_argument("--n", type=int, default=256, help="columns of w (a multiple of 128)")
    parser.add_argument("--outlier", type=float, default=100.0, help="channel 0's factor")
    parser.add_argument("--seed", type=int, default=0, help="the generator's seed")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args(argv)
    x, w = operands(args.m, args.k, args.n, args.seed, args.outlier)
    table = {recipe.name: errors(x, w, recipe) for recipe in RECIPES}
    lines = explanations(x, table, args.outlier)
    weight_shape = (args.n, args.k)  # w.T, quantized along K like the GEMM's
    rows = bytes_table(weight_shape)
    if args.json:
        print(json.dumps({"m": args.m, "k": args.k, "n": args.n, "seed": args.seed,
                          "outlier": args.outlier, "errors": table, "explanations": lines,
                          "bytes_per_parameter": rows}))
        return
    print_errors(table, (args.m, args.k, args.n), args.seed, args.outlier)
    for line in lines:
        print(textwrap.fill(line, width=98))
    print_bytes(rows, weight_shape)


if __name__ == "__main__":
    main()
