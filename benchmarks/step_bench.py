"""Benchmark: one MLP training step in minimp (fp32, fp16, bf16) against hand-written NumPy.

    python benchmarks/step_bench.py            # batch 256, width 512, 4 hidden layers
    python benchmarks/step_bench.py --json     # one JSON object for machines
    python benchmarks/step_bench.py --device gpu --batch 4096 --width 4096   # CuPy, no NumPy line

Prints ratios measured side by side in this run (targets from the second performance issue):
  fp32 minimp / hand-written NumPy   <= 1.10   (wall clock; also on CPU time, which load hurts less)
  fp16 minimp / fp32 minimp          <= 1.50   (with minimp's float16 casts, halfcast.py)
  bytes kept for backward fp16/fp32  <= 0.52
and counts the casts (calls and elements) of one fp16 step, so it is clear where the time goes. On
the CPU, "fp16 astype" is the same fp16 step with NumPy's own float16 casts, timed in the same
round-robin, so the two cast implementations are compared side by side. Each variant's line also
shows its CPU time and the minor page faults of one step (fresh memory the kernel hands over).
"""

import argparse
import functools
import json
import resource
import statistics
import sys
import time

import numpy as np

import minimp
from minimp import Tensor, backend, nn, optim
from minimp import functional as F
from minimp.precision import (
    ACTIVATION_DTYPES,
    NoLossScaler,
    StaticLossScaler,
    casting,
    halfcast,
    mixed_precision_step,
)
from minimp.tensor import saved_bytes


def build(width, layers, classes, dtype, seed=0):
    rng = np.random.default_rng(seed)
    modules = []
    for _ in range(layers):
        modules += [nn.Linear(width, width, rng=rng), nn.ReLU()]
    modules.append(nn.Linear(width, classes, rng=rng))
    model = nn.Sequential(*modules)
    optimizer = optim.SGD(model.parameters(), lr=1e-3)
    model.to(dtype)
    return model, optimizer


def minimp_step(model, optimizer, scaler, x, targets, measure_bytes=False):
    loss = F.cross_entropy(model(x), targets)
    kept = (
        saved_bytes(loss, exclude=[p.data for p in model.parameters()]) if measure_bytes else None
    )
    scaler.scale(loss).backward()
    mixed_precision_step(optimizer, scaler)
    return kept


def numpy_step(weights, biases, x, targets, lr=1e-3):
    """The same fp32 step with no framework: forward, softmax cross-entropy, backward, SGD."""
    activations = [x]
    for index, (w, b) in enumerate(zip(weights, biases)):
        z = activations[-1] @ w.T + b
        activations.append(np.maximum(z, 0) if index < len(weights) - 1 else z)
    logits = activations[-1]
    shifted = logits - logits.max(axis=1, keepdims=True)
    probabilities = np.exp(shifted)
    probabilities /= probabilities.sum(axis=1, keepdims=True)
    grad = probabilities
    grad[np.arange(len(targets)), targets] -= 1.0
    grad /= len(targets)
    for index in range(len(weights) - 1, -1, -1):
        inputs = activations[index]
        grad_w, grad_b = grad.T @ inputs, grad.sum(axis=0)
        if index > 0:
            grad = (grad @ weights[index]) * (inputs > 0)
        weights[index] -= lr * grad_w
        biases[index] -= lr * grad_b


def median_seconds(functions, repeats, counters=None):
    """{name: median seconds}, timing the functions round-robin (one step of each in turn), so drift
    on a noisy machine hits every variant alike instead of whichever ran last. With `counters` (a
    dict), also counters[name] = {"cpu_seconds": median CPU seconds of this process per call (time
    the machine gave to other processes is not in it), "page_faults": minor page faults per call
    (each one the kernel handing a page of fresh memory over; mean of the calls)}."""
    for function in functions.values():
        function()  # warm-up
    samples = {name: [] for name in functions}
    cpu = {name: [] for name in functions}
    faults = dict.fromkeys(functions, 0)
    for _ in range(repeats):
        for name, function in functions.items():
            backend.synchronize()
            faults_before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            cpu_start, start = time.process_time(), time.perf_counter()
            function()
            backend.synchronize()  # GPU work is queued: wait for it before reading the clock
            samples[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - cpu_start)
            faults[name] += resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults_before
    if counters is not None:
        for name in functions:
            counters[name] = {
                "cpu_seconds": statistics.median(cpu[name]),
                "page_faults": faults[name] / repeats,
            }
    return {name: statistics.median(times) for name, times in samples.items()}


def with_casts(implementation, function):
    """function, run with casting's float16 casts done by `implementation` (then restored)."""

    def run():
        with halfcast.casts(implementation):
            return function()

    return run


def count_casts(step):
    """Calls, elements and seconds of the real casts in one run of step."""
    with CastCounter() as counter:
        step()
    return {"calls": counter.calls, "elements": counter.elements, "seconds": counter.seconds}


class CastCounter:
    """Wraps casting.widen / round_to wherever minimp imported them, counting real casts."""

    def __init__(self):
        self.calls, self.elements, self.seconds, self.originals = 0, 0, 0.0, {}

    def __enter__(self):
        widen, round_to = casting.widen, casting.round_to

        def counted(cast):
            def wrapper(array, *dtype):
                start = time.perf_counter()
                result = cast(array, *dtype)
                if result is not array:
                    self.seconds += time.perf_counter() - start
                    self.calls, self.elements = self.calls + 1, self.elements + array.size
                return result

            return wrapper

        counted_widen, counted_round_to = counted(widen), counted(round_to)

        replacements = {widen: counted_widen, round_to: counted_round_to}
        for name, module in list(sys.modules.items()):
            if name.startswith("minimp"):
                for attribute, value in list(vars(module).items()):
                    if callable(value) and value in replacements:
                        self.originals[(module, attribute)] = value
                        setattr(module, attribute, replacements[value])
        return self

    def __exit__(self, *exc_info):
        for (module, attribute), value in self.originals.items():
            setattr(module, attribute, value)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    args = parser.parse_args(argv)
    backend.use_device(args.device)
    on_gpu = args.device == "gpu"
    rng = np.random.default_rng(1)
    x32 = rng.standard_normal((args.batch, args.width)).astype(np.float32)
    targets = backend.to_device(rng.integers(0, 10, args.batch))
    results = {
        "device": args.device,
        "batch": args.batch,
        "width": args.width,
        "layers": args.layers,
        "seconds": {},
        "kept_bytes": {},
        "minimp": minimp.__version__,
    }
    steps = {}
    # CuPy has no ml_dtypes bfloat16, so the GPU run compares fp16 with fp32 only.
    for name in ("fp32", "fp16") if on_gpu else ("fp32", "fp16", "bf16"):
        dtype = ACTIVATION_DTYPES[name]
        model, optimizer = build(args.width, args.layers, 10, dtype)
        scaler = StaticLossScaler(1024.0) if name == "fp16" else NoLossScaler()
        x = Tensor(backend.to_device(x32.astype(dtype)))
        results["kept_bytes"][name] = minimp_step(
            model, optimizer, scaler, x, targets, measure_bytes=True
        )
        steps[name] = functools.partial(minimp_step, model, optimizer, scaler, x, targets)
        if name == "fp16" and not on_gpu:
            results["casts"] = halfcast.selected_casts()
            results["fp16_casts_per_step"] = count_casts(steps[name])
            # The same step on its own model with NumPy's float16 casts, for the side-by-side ratio.
            model, optimizer = build(args.width, args.layers, 10, dtype)
            astype_step = functools.partial(minimp_step, model, optimizer, scaler, x, targets)
            steps["fp16 astype"] = with_casts("astype", astype_step)
            results["fp16_astype_casts_per_step"] = count_casts(steps["fp16 astype"])
    if not on_gpu:
        reference, _ = build(args.width, args.layers, 10, np.float32)
        linears = [layer for layer in reference if isinstance(layer, nn.Linear)]
        weights = [layer.weight.data.copy() for layer in linears]
        biases = [layer.bias.data.copy() for layer in linears]
        steps["numpy"] = functools.partial(numpy_step, weights, biases, x32, targets)
    results["counters"] = {}
    results["seconds"] = median_seconds(steps, args.repeats, results["counters"])
    seconds, kept = results["seconds"], results["kept_bytes"]
    results["ratios"] = {
        "fp16_over_fp32": seconds["fp16"] / seconds["fp32"],
        "kept_bytes_fp16_over_fp32": kept["fp16"] / kept["fp32"],
    }
    flops = (
        6 * args.batch * sum(layer.weight.size for layer in model if isinstance(layer, nn.Linear))
    )
    results["tflops"] = {name: flops / seconds[name] / 1e12 for name in list(seconds)}
    if on_gpu:
        results["ratios"]["fp32_over_fp16_throughput"] = seconds["fp32"] / seconds["fp16"]
        if args.json:
            print(json.dumps(results))
        else:
            print(
                f"GPU MLP step, batch {args.batch}, width {args.width}: "
                f"fp32 {seconds['fp32'] * 1e3:.2f} ms, fp16 {seconds['fp16'] * 1e3:.2f} ms, "
                f"fp16 throughput {seconds['fp32'] / seconds['fp16']:.2f}x fp32's (target >= 2)"
            )
        return
    results["ratios"].update(
        {
            "fp32_over_numpy": seconds["fp32"] / seconds["numpy"],
            "fp32_over_numpy_cpu": (
                results["counters"]["fp32"]["cpu_seconds"]
                / results["counters"]["numpy"]["cpu_seconds"]
            ),
            "fp16_astype_over_fp32": seconds["fp16 astype"] / seconds["fp32"],
            "bf16_over_fp32": seconds["bf16"] / seconds["fp32"],
        }
    )
    if args.json:
        print(json.dumps(results))
        return
    print(
        f"MLP step: batch {args.batch}, width {args.width}, {args.layers} hidden layers, "
        f"median of {args.repeats}"
    )
    for name in ("numpy", "fp32", "fp16", "fp16 astype", "bf16"):
        cpu_ms = results["counters"][name]["cpu_seconds"] * 1e3
        faults = results["counters"][name]["page_faults"]
        print(
            f"  {name:>11}: {seconds[name] * 1e3:8.2f} ms   (CPU {cpu_ms:6.2f} ms, "
            f"{faults:6.1f} page faults per step)"
        )
    casts = results["fp16_casts_per_step"]
    elements = casts["elements"]
    print(f"  fp16 casts per step: {casts['calls']} calls, {elements / 1e6:.2f} M elements")
    for name, implementation in (("fp16", results["casts"]), ("fp16 astype", "astype")):
        casts = results[name.replace(" ", "_") + "_casts_per_step"]
        print(
            f"    {implementation:>6}: {casts['seconds'] * 1e3:6.2f} ms "
            f"({casts['seconds'] / casts['elements'] * 1e9:.2f} ns/element); "
            f"{name} step without them: {(seconds[name] - casts['seconds']) * 1e3:.2f} ms"
        )
    targets_text = {
        "fp32_over_numpy": 1.10,
        "fp32_over_numpy_cpu": 1.10,
        "fp16_over_fp32": 1.50,
        "kept_bytes_fp16_over_fp32": 0.52,
    }
    for name, value in results["ratios"].items():
        target = f"(target <= {targets_text[name]:.2f})" if name in targets_text else ""
        print(f"  {name:<26} {value:6.3f} {target}")


if __name__ == "__main__":
    main()
