"""Benchmark: where the GPU fp16 training step goes, against its GEMMs alone, and the update.

    python benchmarks/gpu_step_profile.py                      # batch 4096, width 4096, 4 layers
    python benchmarks/gpu_step_profile.py --json               # one JSON object for machines

Prints, all measured in this run on step_bench.py's fp16 MLP (SGD, static loss scale 1024):
  step / its GEMMs alone       target <= 1.5: the same GEMM shapes and layouts through
                               cupy.matmul (cuBLAS), back to back
  TFLOP/s of both              and their fraction of the H200's dense fp16 peak (989 TFLOP/s)
  host time per step           what Python takes to enqueue a step; near the GPU time, the GPU
                               waits for Python
  the step in phases           forward, backward, accumulate, finite checks, unscale, update,
                               each between two synchronisations (a separate, slower run)
  the optimizer's update       AdamW and SGD with momentum on the same parameters, unscale
                               included (a CuPy kernel per arithmetic operation of the rule)
Exits with status 2 and one line, before any work, when CuPy or a GPU is missing.
"""

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from minimp import Tensor, backend, nn, optim
from minimp.checkpoints.errors import ConfigError
from minimp.checkpoints.files import atomic_write, check_output
from minimp.precision import StaticLossScaler, unscale_
from minimp.precision import step as step_module

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from step_bench import build, minimp_step  # noqa: E402  (the same model as step_bench.py)

H200_DENSE_FP16_FLOPS = 989e12  # NVIDIA's H200 SXM data sheet, dense (no sparsity)
TARGET_STEP_OVER_GEMMS = 1.5  # the target


def timed(function, repeats, setup=None, warmup=2):
    """(median GPU milliseconds between CUDA events around function, median host milliseconds
    of the call itself); setup runs before each call, outside both clocks."""
    import cupy

    gpu, host = [], []
    for index in range(warmup + repeats):
        if setup is not None:
            setup()
        start, end = cupy.cuda.Event(), cupy.cuda.Event()
        start.record()
        began = time.perf_counter()
        function()
        called = time.perf_counter()
        end.record()
        end.synchronize()
        if index >= warmup:
            gpu.append(cupy.cuda.get_elapsed_time(start, end))
            host.append((called - began) * 1e3)
    return statistics.median(gpu), statistics.median(host)


def gemm_shapes(model, batch):
    """The step's GEMMs as (name, M, N, K): each Linear's forward x @ W^T, backward dL/dy @ W
    (not for the first layer: minimp skips the input data's gradient) and dL/dy^T @ x."""
    shapes = []
    linears = [layer for layer in model if isinstance(layer, nn.Linear)]
    for index, layer in enumerate(linears):
        out_features, in_features = layer.weight.shape
        shapes.append((f"layer {index} forward", batch, out_features, in_features))
        if index > 0:
            shapes.append((f"layer {index} grad_x", batch, in_features, out_features))
        shapes.append((f"layer {index} grad_weight", out_features, in_features, batch))
    return shapes


def gemms_alone(model, batch, repeats):
    """GPU ms of the step's GEMMs through cupy.matmul in minimp's layouts, and their FLOPs."""
    import cupy

    rng = cupy.random.default_rng(0)
    operations = []
    for layer in [layer for layer in model if isinstance(layer, nn.Linear)]:
        out_features, in_features = layer.weight.shape
        x = rng.standard_normal((batch, in_features), dtype=cupy.float32).astype(cupy.float16)
        w = rng.standard_normal((out_features, in_features), dtype=cupy.float32)
        g = rng.standard_normal((batch, out_features), dtype=cupy.float32).astype(cupy.float16)
        w = w.astype(cupy.float16)
        operations.append((x, w, g, len(operations) > 0))

    def run():
        for x, w, g, needs_grad_x in operations:
            cupy.matmul(x, w.T)  # forward, (N, in) @ (in, out)
            if needs_grad_x:
                cupy.matmul(g, w)  # dL/dx, (N, out) @ (out, in)
            cupy.matmul(g.T, x)  # dL/dW, (out, N) @ (N, in)

    flops = sum(2 * m * n * k for _, m, n, k in gemm_shapes(model, batch))
    return timed(run, repeats)[0], flops


def phases(model, optimizer, scaler, x, targets, repeats):
    """Median ms per step of each phase, every call between two synchronisations (a phase
    called twice in a step, the finite check, counts both calls)."""
    from minimp import functional as F

    steps: list[dict[str, float]] = []

    def clocked(name, function):
        def wrapper(*args, **kwargs):
            backend.synchronize()
            began = time.perf_counter()
            result = function(*args, **kwargs)
            backend.synchronize()
            current = steps[-1]
            current[name] = current.get(name, 0.0) + (time.perf_counter() - began) * 1e3
            return result

        return wrapper

    # The step function's helpers, where step.py still has them (a renamed one is not timed).
    helpers = {"all_finite": "finite checks", "unscale_": "unscale"}
    saved = {name: getattr(step_module, name) for name in helpers if hasattr(step_module, name)}
    for name, function in saved.items():
        setattr(step_module, name, clocked(helpers[name], function))
    optimizer.accumulate_gradients = clocked("accumulate", optimizer.accumulate_gradients)
    optimizer.step = clocked("update + round", optimizer.step)
    try:
        for _ in range(repeats + 1):  # the first one warms up
            steps.append({})
            loss = clocked("forward", lambda: F.cross_entropy(model(x), targets))()
            clocked("backward", lambda: scaler.scale(loss).backward())()
            clocked("whole step function", lambda: step_module.mixed_precision_step(
                optimizer, scaler))()
    finally:
        for name, function in saved.items():
            setattr(step_module, name, function)
        del optimizer.accumulate_gradients, optimizer.step  # the class's methods again
    return {name: statistics.median(step[name] for step in steps[1:]) for name in steps[-1]}


def optimizer_update(width, layers, repeats):
    """Update ms (the unscale by 2^16 included: unscale_, then step) for AdamW and SGD with
    momentum on the fp16 MLP's parameters, and AdamW's GB/s counted at 30 bytes per parameter
    (the least an update can move: read the gradient, the master and both moments, write the
    master, both moments and the float16 copy)."""
    import cupy

    results = {}
    makers = {
        "adamw": lambda p: optim.AdamW(p, lr=1e-3),
        "sgd_momentum": lambda p: optim.SGD(p, lr=1e-3, momentum=0.9),
    }
    for name, make in makers.items():
        model, _ = build(width, layers, 10, np.float32)
        optimizer = make(model.parameters())
        model.to(np.float16)
        pristine = [cupy.random.default_rng(1).standard_normal(m.shape, dtype=cupy.float32)
                    for m in optimizer.master_weights]
        grads = [g.copy() for g in pristine]

        def setup():
            for grad, original in zip(grads, pristine):
                grad[...] = original  # the unscale works in place
            optimizer.master_gradients = list(grads)

        def update():
            unscale_(optimizer.master_gradients, 2.0**16)
            optimizer.step()

        parameters = sum(int(m.size) for m in optimizer.master_weights)
        results[name] = {"update_ms": timed(update, repeats, setup)[0], "parameters": parameters}
    adamw = results["adamw"]
    adamw["gb_per_s"] = 30 * adamw["parameters"] / (adamw["update_ms"] * 1e-3) / 1e9
    return results


def require_gpu():
    """One line and exit status 2 unless CuPy imports and sees a GPU (before any work)."""
    try:
        backend.check_device("gpu")
    except backend.DeviceError as error:
        print(f"gpu_step_profile: {error}", file=sys.stderr)
        raise SystemExit(2)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4096)
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4, help="hidden layers")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--json", action="store_true", help="one JSON object, nothing else")
    parser.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args(argv)
    try:  # before any work: the file can be written and replaces no other kind
        if args.save:
            check_output("--save", args.save, "json", force=None)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    require_gpu()
    backend.use_device("gpu")
    rng = np.random.default_rng(1)
    x = Tensor(backend.to_device(rng.standard_normal((args.batch, args.width)).astype(np.float16)))
    targets = backend.to_device(rng.integers(0, 10, args.batch))
    model, optimizer = build(args.width, args.layers, 10, np.float16)
    scaler = StaticLossScaler(1024.0)
    step = lambda: minimp_step(model, optimizer, scaler, x, targets)  # noqa: E731
    step_ms, host_ms = timed(step, args.repeats)
    gemm_ms, flops = gemms_alone(model, args.batch, args.repeats)
    report = {
        "batch": args.batch, "width": args.width, "layers": args.layers,
        "step_ms": step_ms, "step_host_ms": host_ms, "gemms_ms": gemm_ms,
        "step_over_gemms": step_ms / gemm_ms, "target_step_over_gemms": TARGET_STEP_OVER_GEMMS,
        "gemm_flops": flops,
        "tflops_step": flops / step_ms / 1e9, "tflops_gemms": flops / gemm_ms / 1e9,
        "peak_fraction_step": flops / (step_ms * 1e-3) / H200_DENSE_FP16_FLOPS,
        "peak_fraction_gemms": flops / (gemm_ms * 1e-3) / H200_DENSE_FP16_FLOPS,
        "gemm_shapes": gemm_shapes(model, args.batch),
        "phases_ms": phases(model, optimizer, scaler, x, targets, args.repeats),
        "optimizer": optimizer_update(args.width, args.layers, args.repeats),
    }  # fmt: skip
    if args.save:
        text = json.dumps(report)
        atomic_write(args.save, lambda file: file.write(text.encode()))
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"fp16 MLP step, batch {args.batch}, width {args.width}, {args.layers} hidden layers")
    print(f"  step {step_ms:.2f} ms (host enqueues it in {host_ms:.2f} ms), its GEMMs alone "
          f"{gemm_ms:.2f} ms: {step_ms / gemm_ms:.2f}x (target <= {TARGET_STEP_OVER_GEMMS})")
    print(f"  {report['tflops_step']:.0f} TFLOP/s ({report['peak_fraction_step']:.1%} of the "
          f"dense fp16 peak); GEMMs alone {report['tflops_gemms']:.0f} TFLOP/s "
          f"({report['peak_fraction_gemms']:.1%})")
    print("  phases, each between synchronisations: " + ", ".join(
        f"{name} {ms:.2f} ms" for name, ms in report["phases_ms"].items()))
    for name, row in report["optimizer"].items():
        print(f"  {name}: update {row['update_ms']:.3f} ms for {row['parameters']} parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
