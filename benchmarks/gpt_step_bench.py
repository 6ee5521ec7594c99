"""Benchmark: one GPT training step (nanoGPT's CPU config) in minimp, fp32 / fp16 / bf16, and the
same step in PyTorch eager fp32, timed in alternating blocks in one run.

    python benchmarks/gpt_step_bench.py                                  # minimp alone
    python benchmarks/gpt_step_bench.py --torch-python ~/torchenv/bin/python   # and PyTorch
    python benchmarks/gpt_step_bench.py --json

The step: forward, cross-entropy, backward, clip at norm 1, AdamW; batch 12 x 64 characters,
4 blocks, 4 heads, width 128 (4 x 128 x 64 x 12). Each library runs one BLAS thread (--threads)
so that two processes on a 2-core machine do not fight over cores. Prints the median step time of
each, tokens per second, and the ratios, with the goals of the second performance issue: minimp fp32
/ PyTorch fp32 (<= 1.4, stretch 1.25), fp16 / fp32 (<= 1.10), bf16 / fp32, and the fp32 step over
its matrix products alone ("fp32 GEMMs": the same products in NumPy, what no framework can save).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from gpt_gemms import gpt_gemms
from minimp import backend
from minimp import functional as F
from minimp.models.gpt import GPT, GPTConfig
from minimp.optim import AdamW
from minimp.precision import ACTIVATION_DTYPES, DynamicLossScaler, NoLossScaler
from minimp.precision.step import mixed_precision_step
from minimp.tensor import Tensor

CONFIG = GPTConfig(vocab_size=65, context=64, layers=4, heads=4, width=128)
BATCH = 12


def build_step(config: GPTConfig, batch: int, precision: str):
    """One training step of a fresh model in `precision`, its inputs on the current device (the
    GPU benchmark's worker, gpu_gpt_step.py, builds its steps here too)."""
    model = GPT(config, np.random.default_rng(0))
    decay = [{"params": [p], "weight_decay": 0.1 * (p.ndim >= 2)} for p in model.parameters()]
    optimizer = AdamW(decay, lr=1e-3, betas=(0.9, 0.99))
    model.to(ACTIVATION_DTYPES[precision])
    scaler = DynamicLossScaler() if precision == "fp16" else NoLossScaler()
    ids = np.random.default_rng(1).integers(0, config.vocab_size, (batch, config.context + 1))
    inputs = Tensor(backend.to_device(ids[:, :-1]))
    targets = backend.to_device(ids[:, 1:].reshape(-1))
    steps = iter(range(1, 2**62))

    def step():
        if config.dropout:  # fresh masks every step, as in training
            model.set_dropout_state(seed=0, step=next(steps), sample_indices=np.arange(batch))
        logits = model(inputs)  # (B, T, V)
        loss = F.cross_entropy(logits.reshape(-1, config.vocab_size), targets)
        scaler.scale(loss).backward()
        mixed_precision_step(optimizer, scaler, max_grad_norm=1.0)

    return step


def minimp_step(precision: str):
    """A function running one training step of this benchmark's model in this precision."""
    step = build_step(CONFIG, BATCH, precision)
    step()  # warm-up (and numba's first compile)
    return step


def gemm_step():
    """A function running the step's matrix products alone (gpt_gemms.py: every Linear's forward,
    dL/dx and dL/dW, attention's batched products both ways, the tied head's), float32 NumPy on
    arrays made once, each operand laid out as the step reads it: the floor the rest stands on."""
    rng = np.random.default_rng(0)
    sizes = (CONFIG.layers, CONFIG.heads, CONFIG.width, CONFIG.context, CONFIG.vocab_size, BATCH)
    pairs = []
    for _, count, m, n, k, a_transposed, b_transposed in gpt_gemms(*sizes):
        a = rng.standard_normal((count, k, m) if a_transposed else (count, m, k), np.float32)
        b = rng.standard_normal((count, n, k) if b_transposed else (count, k, n), np.float32)
        a, b = (array[0] if count == 1 else array for array in (a, b))
        pairs.append((a.swapaxes(-1, -2) if a_transposed else a,
                      b.swapaxes(-1, -2) if b_transposed else b))

    def step():
        for a, b in pairs:
            a @ b

    return step


def timed(step, count):
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    return seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch-python", default="", help="a Python that has PyTorch")
    parser.add_argument("--blocks", type=int, default=10, help="alternating blocks per variant")
    parser.add_argument("--steps", type=int, default=5, help="steps per block")
    parser.add_argument("--threads", type=int, default=1, help="BLAS threads of each library")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    with backend.limit_cpu_threads(args.threads), np.errstate(over="ignore"):
        variants = {precision: minimp_step(precision) for precision in ("fp32", "fp16", "bf16")}
        variants["fp32 GEMMs"] = gemm_step()
        torch = None
        if args.torch_python:
            script = Path(__file__).with_name("torch_gpt_step.py")
            torch = subprocess.Popen(
                [args.torch_python, str(script), "--threads", str(args.threads)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        samples = {name: [] for name in [*variants, *(["torch fp32"] if torch else [])]}
        for _ in range(args.blocks):  # alternate, so drift on a shared machine hits all alike
            for name, step in variants.items():
                samples[name] += timed(step, args.steps)
            if torch:
                torch.stdin.write(f"{args.steps}\n")
                torch.stdin.flush()
                samples["torch fp32"] += json.loads(torch.stdout.readline())
        if torch:
            torch.stdin.close()
            torch.wait()
    medians = {name: statistics.median(times) for name, times in samples.items()}
    tokens = BATCH * CONFIG.context
    result = {
        "milliseconds": {name: 1e3 * seconds for name, seconds in medians.items()},
        "tokens_per_second": {name: tokens / seconds for name, seconds in medians.items()},
        "fp16_over_fp32": medians["fp16"] / medians["fp32"],
        "bf16_over_fp32": medians["bf16"] / medians["fp32"],
        "fp32_over_its_gemms": medians["fp32"] / medians["fp32 GEMMs"],
    }
    if torch:
        result["minimp_fp32_over_torch_fp32"] = medians["fp32"] / medians["torch fp32"]
    if args.json:
        print(json.dumps(result))
        return
    print(f"GPT step, batch {BATCH} x {CONFIG.context}, median of {args.blocks * args.steps}")
    for name, milliseconds in result["milliseconds"].items():
        rate = result["tokens_per_second"][name]
        print(f"  {name:>10}: {milliseconds:7.1f} ms  {rate:9,.0f} tokens/s")
    goals = {"fp16_over_fp32": "<= 1.10", "minimp_fp32_over_torch_fp32": "<= 1.4"}
    for key in ("fp16_over_fp32", "bf16_over_fp32", "fp32_over_its_gemms",
                "minimp_fp32_over_torch_fp32"):
        if key in result:
            goal = f"  (goal {goals[key]})" if key in goals else ""
            print(f"  {key:<28} {result[key]:.2f}{goal}")


if __name__ == "__main__":
    sys.exit(main())
