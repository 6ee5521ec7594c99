"""Performance smoke tests: the hot path against a baseline timed in the same run, with bounds
generous enough for a shared machine and tight enough to catch a slow path coming back.

The figures themselves live in the benchmarks (benchmarks/step_bench.py, gpt_step_bench.py; their
latest runs in docs/benchmarks.md). Each test times its variants in alternating rounds, one BLAS
thread, and compares medians, so load on the machine hits both sides alike. The benchmarks
measured on the 2-core VM, 2026-12-06: MLP fp32 / NumPy 1.056-1.062, MLP fp16 / fp32 1.17-1.18, GPT
fp32 / its products alone 1.37-1.39, GPT fp16 / fp32 1.46-1.50. These tests, run with GELU as it
was before it worked in place, gave the GPT 2.02x its products; with NumPy's own float16 casts
(MINIMP_HALF_CASTS=astype), fp16 / fp32 2.15 (MLP) and 2.58 (GPT).
"""

import functools
import os
import statistics
import sys
import time

import numpy as np
import pytest

from minimp import Tensor, backend
from minimp.precision import NoLossScaler, StaticLossScaler

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks"))
import gpt_step_bench  # noqa: E402
import step_bench  # noqa: E402


def medians(steps: dict, rounds: int) -> dict:
    """{name: median seconds}, one call of each in turn per round, after one warm-up call each."""
    times: dict = {name: [] for name in steps}
    with backend.limit_cpu_threads(1), np.errstate(over="ignore"):
        for step in steps.values():
            step()
        for _ in range(rounds):
            for name, step in steps.items():
                start = time.perf_counter()
                step()
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(seconds) for name, seconds in times.items()}


def test_the_mlp_step_keeps_near_hand_written_numpy_and_fp16_near_fp32():
    rng = np.random.default_rng(1)
    x32 = rng.standard_normal((256, 512)).astype(np.float32)
    targets = rng.integers(0, 10, 256)
    steps = {}
    for name, dtype, scaler in (("fp32", np.float32, NoLossScaler()),
                                ("fp16", np.float16, StaticLossScaler(1024.0))):
        model, optimizer = step_bench.build(512, 4, 10, dtype)
        x = Tensor(x32.astype(dtype))
        steps[name] = functools.partial(step_bench.minimp_step, model, optimizer, scaler, x,
                                        targets)
    reference, _ = step_bench.build(512, 4, 10, np.float32)
    weights = [layer.weight.data.copy() for layer in reference if hasattr(layer, "weight")]
    biases = [layer.bias.data.copy() for layer in reference if hasattr(layer, "bias")]
    steps["numpy"] = functools.partial(step_bench.numpy_step, weights, biases, x32, targets)
    seconds = medians(steps, rounds=15)
    assert seconds["fp32"] <= 1.5 * seconds["numpy"], seconds
    assert seconds["fp16"] <= 1.8 * seconds["fp32"], seconds


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_the_gpt_step_keeps_near_its_matrix_products_and_fp16_near_fp32():
    steps = {name: gpt_step_bench.minimp_step(name) for name in ("fp32", "fp16")}
    steps["products alone"] = gpt_step_bench.gemm_step()
    seconds = medians(steps, rounds=8)
    assert seconds["fp32"] <= 2.0 * seconds["products alone"], seconds
    assert seconds["fp16"] <= 2.2 * seconds["fp32"], seconds
