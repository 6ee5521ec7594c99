"""benchmarks/outlier_bench.py: its errors keep the order docs/benchmarks.md reads from them, its
scale bytes are the bytes blocks.quantize stores, and its rows agree with minimp's own formulas."""

import json
import os
import sys
from contextlib import redirect_stdout
from io import StringIO

import numpy as np
import pytest

from minimp.parallel.zero.formulas import per_parameter
from minimp.precision import blocks, fp8
from minimp.precision.fp8_scaling import scale_from_amax

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import outlier_bench  # noqa: E402

SMALL = ["--m", "64", "--k", "512", "--n", "128"]  # K as the issue's: the NVFP4 ratio depends on it
BITS = {"E4M3": 8, "E2M1": 4}  # the formats' widths, as their specs give them


@pytest.fixture(scope="module")
def small_run():
    """The benchmark's JSON at a small size (a 64 x 512 input, seed 0)."""
    out = StringIO()
    with redirect_stdout(out):
        outlier_bench.main(SMALL + ["--json"])
    return json.loads(out.getvalue())


def test_fp4_per_tensor_zeroes_the_other_channels_and_nvfp4_is_5x_better_on_them(small_run):
    """docs/benchmarks.md: per-tensor FP4's rest error is exactly 1 (every other value rounds to
    0), NVFP4 is below it on every measure and >= 5x below on the other channels' part."""
    fp4, nvfp4 = small_run["errors"]["FP4 (E2M1) per-tensor"], small_run["errors"]["NVFP4"]
    assert fp4["rest x"] == 1.0 and fp4["rest both"] == 1.0
    assert all(nvfp4[m] < fp4[m] for m in outlier_bench.MEASURES)
    assert fp4["rest x"] >= 5 * nvfp4["rest x"]


def test_fp8_recipes_differ_on_the_outlier_not_on_the_other_channels(small_run):
    """On the other channels' part every fp8 recipe is within 2x of the others; on the whole
    output the outlier's own rounding decides: where a group's amax is the outlier, current
    scaling maps it onto 448 exactly (rowwise, 1x128 beat per-tensor) and MX's floor rule can
    clamp it (worse than rounding the scale up)."""
    errors = small_run["errors"]
    for measure in ("rest x", "rest both"):
        values = [errors[name][measure] for name in outlier_bench.FP8_RECIPES]
        assert max(values) < 2 * min(values), measure
    x_only = {name: errors[name]["x only"] for name in outlier_bench.FP8_RECIPES}
    assert x_only["fp8 1x128 (DeepSeek-V3)"] < x_only["fp8 per-tensor"] / 2
    assert x_only["fp8 rowwise"] < x_only["fp8 per-tensor"] / 2
    assert x_only["MXFP8, floor scale"] > x_only["MXFP8, round-up scale"]


def test_the_printed_report_has_every_recipe_and_both_explanations(capsys):
    outlier_bench.main(SMALL)
    out = capsys.readouterr().out
    for recipe in outlier_bench.RECIPES:
        assert recipe.name in out
    assert "Why the fp8 recipes barely differ: E4M3 spans 17.8 binades" in out
    assert "Why FP4 needs blocks: E2M1 spans 3.6 binades" in out
    assert "BF16 with FP32 mixed precision baseline" in out


@pytest.mark.parametrize("weight", outlier_bench.WEIGHT_FORMATS, ids=lambda w: w.name)
def test_scale_bytes_are_the_bytes_blocks_quantize_stores(weight):
    """The formula's scale bytes == the nbytes of the scales blocks.quantize returns (NVFP4's
    float32 tensor scale included; the other rules' tensor_scale_inv is a placeholder 1), and its
    value bytes == the values' bits; ml_dtypes keeps a 4-bit value in a whole byte."""
    shape = (128, 512)
    x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
    q = blocks.quantize(x, weight.fmt, weight.group, weight.rule)
    stored = q.scale_inv.nbytes + (q.tensor_scale_inv.nbytes if weight.rule == "nvfp4" else 0)
    assert stored == outlier_bench.scale_bytes(shape, weight.group, weight.rule)
    packed = outlier_bench.value_bytes(weight.fmt) * q.data.size
    assert packed * 8 == BITS[weight.fmt.name] * q.data.size
    assert q.data.nbytes == q.data.size  # one byte a value in NumPy, E2M1 too: twice its packing
    assert outlier_bench.weight_bytes(shape, weight) * x.size == packed + stored


def test_the_named_formulas_read_as_the_issue_gives_them():
    """1 + 4/16384 for 128 x 128 blocks, 1 + 1/32 for MXFP8, 1/2 + 1/16 + 4/P for NVFP4."""
    formulas = {row["recipe"]: row["formula"] for row in outlier_bench.bytes_table((256, 512))}
    assert formulas["fp8 blockwise 128x128"] == "1 + 4/16384"
    assert formulas["MXFP8"] == "1 + 1/32"
    assert formulas["NVFP4"] == "1/2 + 1/16 + 4/P"


def test_the_bf16_row_is_zero_stage_0s_bytes_per_parameter():
    """minimp's bf16 model states, 2 + 4 + 4 + 8 = 18 bytes, as parallel/zero/formulas.py has
    them."""
    bf16 = outlier_bench.bytes_table((256, 512))[0]
    assert bf16["recipe"] == "bf16"
    assert bf16["total"] == per_parameter(0, 1, compute_bytes=2, slots=2)


def test_the_per_tensor_row_is_todays_fp8_current_scaling():
    """blocks' one-group current scaling decodes, bit for bit, as precision/fp8.py's per-tensor
    fp8 with fp8_scaling's current scale: the benchmark's first row is today's recipe."""
    x, _ = outlier_bench.operands(64, 512, 128, seed=0)
    ours = blocks.dequantize(blocks.quantize(x, blocks.E4M3, "tensor", "current"))
    scale = scale_from_amax(fp8.amax(x), fp8.E4M3.max, 1.0)
    today = fp8.dequantize(fp8.quantize(x, scale, fp8.E4M3), scale)
    np.testing.assert_array_equal(ours.view(np.uint32), today.view(np.uint32))
