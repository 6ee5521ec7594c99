"""benchmarks/gpu_gpt_bench.py as far as a machine without a GPU can check it: the GEMMs it times
against the model's own layers and the FLOPs formula, its JSON on tiny fake timings, the table
scripts/gpu_report.py prints from it, and its workers' protocol run on the CPU (PyTorch's side
only where PyTorch is installed); on a GPU, one run of the real thing on a small model."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import PYTHON, requires_gpu

from minimp import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
TINY = ["--vocab=11", "--context=8", "--layers=1", "--heads=2", "--width=16", "--batch=2"]
QUICK = ["--steps=2", "--blocks=1", "--runs=2", "--warmup=1"]


def bench(flags, pythonpath=ROOT):
    """gpu_gpt_bench.py FLAGS --json: (exit status, its JSON object or None, stderr)."""
    result = subprocess.run([PYTHON, "benchmarks/gpu_gpt_bench.py", *flags, "--json"],
                            capture_output=True, text=True, timeout=120, cwd=ROOT,
                            env={**os.environ, "PYTHONPATH": pythonpath})  # fmt: skip
    report = json.loads(result.stdout) if result.returncode == 0 else None
    return result.returncode, report, result.stderr


def test_the_gemms_are_the_gpt_s_linear_layers_and_attention_products():
    """Forward, dL/dx and dL/dW of every Linear, in the model's order and shapes, and the FLOPs of
    the list: 6 per weight of the matrices (the tied head's included) and 12 L T C for the
    attention products, per token (the full T x T square, as minimp computes it)."""
    from gpt_gemms import gemm_flops, gpt_gemms

    from minimp.models.gpt import GPT, GPTConfig

    layers, heads, width, context, vocab, batch = 2, 2, 8, 4, 11, 3
    config = GPTConfig(vocab_size=vocab, context=context, layers=layers, heads=heads, width=width)
    linears = [m for m in GPT(config, np.random.default_rng(0)).modules()
               if isinstance(m, nn.Linear)]  # fmt: skip
    gemms = gpt_gemms(layers, heads, width, context, vocab, batch)
    forwards = [g for g in gemms if g[0].endswith("forward") and g[1] == 1][:-1]  # not the head
    assert [(m, k, n) for _, _, m, n, k, _, _ in forwards] == [
        (batch * context, *linear.weight.shape[::-1]) for linear in linears]
    assert len(gemms) == 3 * len(linears) + 6 * layers + 3
    matrices = layers * 12 * width * width + vocab * width
    per_token = 6 * matrices + 12 * layers * context * width
    assert gemm_flops(gemms) == batch * context * per_token


def fake_report():
    """summarize() on fake step seconds: two runs each, PyTorch AMP fp16 twice as fast."""
    from gpu_gpt_bench import summarize

    config = {"vocab": 65, "context": 256, "layers": 6, "heads": 6, "width": 384, "batch": 64,
              "dropout": 0.2, "steps_per_block": 3, "blocks": 1, "runs": 2}
    samples = {"minimp fp16": [[0.1, 0.3, 0.2], [0.4, 0.4, 0.4]],
               "torch amp fp16": [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2]]}
    stats = {"minimp fp16": {"gemms_alone_ms": 100.0, "peak_allocated_bytes": 2**30,
                             "peak_reserved_bytes": 2**31, "cupy": "14.2.0"},
             "torch amp fp16": {"gemms_alone_ms": 50.0, "torch": "2.11.0"}}
    problems = {"minimp bf16": {"unsupported": "CuPy has no bfloat16 arrays"},
                "torch fp32": {"unavailable": "exit status 1: No module named 'torch'"}}
    return summarize(config, samples, stats, problems, "NVIDIA H100")


def test_the_json_holds_milliseconds_tokens_per_second_ratios_and_goals():
    report = fake_report()
    assert report["tokens_per_step"] == 64 * 256
    assert list(report["variants"]) == ["minimp fp16", "minimp bf16", "torch fp32",
                                        "torch amp fp16"]  # the bench's order, not the input's
    minimp = report["variants"]["minimp fp16"]
    assert minimp["step_ms_runs"] == pytest.approx([200.0, 400.0])  # each run's median
    assert minimp["step_ms"] == pytest.approx(300.0)  # the median of the runs
    assert minimp["tokens_per_s"] == pytest.approx(64 * 256 / 0.3)
    assert minimp["steps_timed"] == 6
    assert minimp["step_over_gemms"] == pytest.approx(3.0)
    assert minimp["gemm_share"] == pytest.approx(1 / 3)
    assert minimp["peak_allocated_bytes"] == 2**30 and minimp["cupy"] == "14.2.0"
    assert "peak_allocated_bytes" not in report["variants"]["torch amp fp16"]
    assert report["variants"]["minimp bf16"] == {"unsupported": "CuPy has no bfloat16 arrays"}
    over_torch = report["goals"]["minimp_fp16_over_torch_amp_fp16_tokens_per_s"]
    assert over_torch["value"] == pytest.approx(150 / 300)
    assert over_torch["runs"] == pytest.approx([0.5, 0.5])  # run by run: 100/200, 200/400
    assert over_torch["met"] is True and over_torch["goal"] == ">= 0.5"
    over_gemms = report["goals"]["minimp_fp16_step_over_gemms_alone"]
    assert (over_gemms["met"], over_gemms["stretch_met"]) == (False, False)
    json.dumps(report)  # plain JSON types throughout


def test_gpu_report_prints_a_row_per_variant_and_the_goals():
    from gpu_report import gpt_bench_table

    table = gpt_bench_table(fake_report())
    assert table[0].startswith("GPT step on NVIDIA H100: 6 layers, 6 heads, width 384")
    rows = {line.split(" | ")[0].lstrip("| "): line for line in table[4:] if line.startswith("|")}
    assert list(rows) == ["minimp fp16", "minimp bf16", "torch fp32", "torch amp fp16"]
    assert ("| 300.0 (200.0, 400.0) | 54,613 | 100.0 | 3.00 | 33% | 1,024 (2,048) |"
            in rows["minimp fp16"])
    assert "unsupported: CuPy has no bfloat16 arrays" in rows["minimp bf16"]
    goals = [line for line in table if line.startswith("- ")]
    assert goals[0].startswith("- minimp_fp16_over_torch_amp_fp16_tokens_per_s: **0.50** (runs "
                               "0.50, 0.50), goal >= 0.5: met")
    assert goals[1].endswith("goal <= 2.5: not met; stretch <= 1.5: not met")
    assert gpt_bench_table({"error": "gpt_bench.json: missing"}) == [
        "GPT step benchmark: gpt_bench.json: missing"]


def test_on_the_cpu_the_minimp_workers_answer_and_a_missing_torch_is_said(tmp_path):
    """The workers' protocol end to end (warm-up, blocks, stats) on the CPU, minimp's worker
    and a PyTorch worker whose `import torch` fails: its row says why, the others run."""
    (tmp_path / "torch.py").write_text("raise ModuleNotFoundError(\"No module named 'torch'\")\n")
    status, report, stderr = bench(["--device=cpu", *TINY, *QUICK,
                                    "--variants=minimp fp16,torch amp fp16"],
                                   pythonpath=f"{tmp_path}{os.pathsep}{ROOT}")
    assert status == 0, stderr
    minimp, torch = report["variants"]["minimp fp16"], report["variants"]["torch amp fp16"]
    assert minimp["steps_timed"] == 4 and minimp["gemms_alone_ms"] > 0
    assert torch == {"unavailable": "exit status 1: ModuleNotFoundError: No module named 'torch'"}
    assert report["goals"].keys() == {"minimp_fp16_step_over_gemms_alone"}


@pytest.mark.slow  # PyTorch's import alone takes seconds
def test_on_the_cpu_the_torch_worker_answers_beside_minimp_s():
    pytest.importorskip("torch", reason="PyTorch is not installed (never a dependency)")
    status, report, stderr = bench(["--device=cpu", *TINY, *QUICK,
                                    "--variants=minimp fp16,torch amp fp16 sdpa"])
    assert status == 0, stderr
    torch = report["variants"]["torch amp fp16 sdpa"]
    assert torch["steps_timed"] == 4 and torch["gemms_alone_ms"] > 0 and "torch" in torch


def test_bad_variants_are_one_line_and_exit_2():
    status, _, stderr = bench(["--variants=minimp fp8"])
    assert status == 2 and len(stderr.strip().splitlines()) == 1
    assert "--variants: unknown ['minimp fp8'] (use names from: minimp fp32," in stderr


@pytest.mark.gpu
@requires_gpu
def test_on_the_gpu_every_variant_has_its_figures_or_says_why():
    """A small model on the GPU: minimp fp16 times its steps and measures its peak memory (at
    most what its pool holds); bf16 runs or says CuPy cannot; PyTorch, where it is here, too."""
    status, report, stderr = bench([*TINY, *QUICK, "--variants=minimp fp16,minimp bf16,"
                                    "torch amp fp16"])
    assert status == 0, stderr
    minimp = report["variants"]["minimp fp16"]
    assert minimp["steps_timed"] == 4 and minimp["gemms_alone_ms"] > 0
    assert 0 < minimp["peak_allocated_bytes"] <= minimp["peak_reserved_bytes"]
    bf16 = report["variants"]["minimp bf16"]
    assert "step_ms" in bf16 or "bfloat16" in bf16["unsupported"], bf16
    torch = report["variants"]["torch amp fp16"]
    assert "peak_allocated_bytes" in torch or "unavailable" in torch, torch
