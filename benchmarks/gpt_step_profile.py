"""Benchmark: where one GPT training step spends its time, per op family, in minimp and PyTorch.

    python benchmarks/gpt_step_profile.py          # minimp fp32, fp16, bf16; PyTorch if importable
    python benchmarks/gpt_step_profile.py --precision fp16 --torch-python ~/torchenv/bin/python

The step and model are benchmarks/gpt_step_bench.py's (nanoGPT's CPU config, batch 12 x 64, one
BLAS thread). minimp's side wraps every Function's forward and backward, every cast
(`casting.round_to`), every request to the memory pool (`backend.empty`) and the optimizer's step in
a timer, each charged with its own time only (a cast inside an op's backward is a cast, not the
op's); what the step's wall time holds beyond them is Python's own work: building the graph,
walking it back, checking shapes, adding gradients (`autograd and Python`). PyTorch's side comes
from torch.profiler: the self CPU time of every aten op, by the same families; what its step holds
beyond them is its own dispatch and autograd engine. The timers cost minimp some time of their own,
so the per-family figures add up to a little more than the plain step (gpt_step_bench.py). The
last line times the step's matrix products alone (gpt_gemms.py), float32, in NumPy (OpenBLAS) and
in PyTorch (its own BLAS) on the same shapes and layouts: the part of the gap that is the BLAS's.
"""

import argparse
import collections
import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

FAMILIES = ("matmul", "attention softmax", "LayerNorm", "GELU", "casts", "embedding",
            "loss", "optimizer", "allocation", "other ops", "autograd and Python")


def family_of(name: str) -> str:
    """The op family of a minimp Function's or an aten op's name."""
    lowered = name.lower()
    for family, words in (
        ("matmul", ("matmul", "linear", "addmm", "::mm", "bmm", "baddbmm")),
        ("attention softmax", ("softmax", "masked_fill")),
        ("LayerNorm", ("layernorm", "layer_norm")),
        ("GELU", ("gelu",)),
        ("casts", ("cast", "round_to", "::to", "_to_copy", "copy_")),
        ("embedding", ("embedding",)),
        ("loss", ("crossentropy", "cross_entropy", "nll_loss", "log_softmax")),
        ("optimizer", ("optimizer", "adam", "_foreach", "norm", "clamp", "lerp", "addcdiv")),
        ("allocation", ("empty", "zeros", "fill_", "zero_")),
    ):
        if any(word in lowered for word in words):
            return family
    return "other ops"


class Timers:
    """Exclusive time per family: a region nested in another is taken out of the outer one."""

    def __init__(self):
        self.seconds = collections.Counter()
        self.stack = []  # [family, start, time of the regions inside]

    def wrap(self, family: str, function):
        @functools.wraps(function)
        def timed(*args, **kwargs):
            self.stack.append([family, time.perf_counter(), 0.0])
            try:
                return function(*args, **kwargs)
            finally:
                family_, start, inner = self.stack.pop()
                elapsed = time.perf_counter() - start
                self.seconds[family_] += elapsed - inner
                if self.stack:
                    self.stack[-1][2] += elapsed
        return timed


def all_subclasses(cls):
    for subclass in cls.__subclasses__():
        yield subclass
        yield from all_subclasses(subclass)


def profile_minimp(precisions: list, steps: int) -> dict:
    """For each precision, milliseconds per step by family (and the step's wall time), from timers
    around minimp."""
    import numpy as np

    sys.path.insert(0, str(Path(__file__).parent))
    import gpt_step_bench

    from minimp import backend, function
    from minimp.precision import casting

    timers = Timers()
    for op in all_subclasses(function.Function):
        family = family_of(op.__name__)
        for method in ("forward", "backward"):
            if method in vars(op):
                setattr(op, method, staticmethod(timers.wrap(family, vars(op)[method].__func__)))
    patched = [(casting, "round_to", "casts"), (backend, "empty", "allocation")]
    for module, name, family in patched:
        setattr(module, name, timers.wrap(family, getattr(module, name)))
    # The step after backward: the finite check, clipping and AdamW (PyTorch's side: the same)
    gpt_step_bench.mixed_precision_step = timers.wrap("optimizer",
                                                      gpt_step_bench.mixed_precision_step)
    # Modules that imported round_to/empty by name keep their own reference: rebind those too.
    for module in list(sys.modules.values()):
        if getattr(module, "__name__", "").startswith("minimp."):
            for module_, name, family in patched:
                original = getattr(module_, name).__wrapped__
                if getattr(module, name, None) is original:
                    setattr(module, name, getattr(module_, name))
    profiles = {}
    with backend.limit_cpu_threads(1), np.errstate(over="ignore"):
        for precision in precisions:
            step = gpt_step_bench.minimp_step(precision)
            for _ in range(3):
                step()
            timers.seconds.clear()
            walls = []
            for _ in range(steps):
                start = time.perf_counter()
                step()
                walls.append(time.perf_counter() - start)
            profiles[f"minimp {precision}"] = per_step(timers.seconds, walls, steps)
        gemms = gpt_step_bench.gemm_step()
        for profile in profiles.values():  # one figure for all: NumPy's float32 products
            profile["gemms_alone_ms"] = 1e3 * median_time(gemms, steps)
    return profiles


def median_time(function, count: int) -> float:
    """Seconds of the median of `count` calls, after one call to warm up."""
    function()
    seconds = []
    for _ in range(count):
        start = time.perf_counter()
        function()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def profile_torch(steps: int) -> dict:
    """Milliseconds per step by family, from torch.profiler's self CPU times of the aten ops."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, str(Path(__file__).parent))
    from torch_gpt_step import build_step, gemms_alone_ms, parse_args

    torch.set_num_threads(1)
    sizes = parse_args([])  # the defaults: gpt_step_bench.py's model and batch, fp32, the CPU
    step = build_step(sizes)

    for _ in range(3):
        step()
    walls = []
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        for _ in range(steps):
            start = time.perf_counter()
            step()
            walls.append(time.perf_counter() - start)
    seconds = collections.Counter()
    for event in profiler.key_averages():
        if event.key.startswith("aten::"):
            seconds[family_of(event.key)] += event.self_cpu_time_total / 1e6
    profile = per_step(seconds, walls, steps)
    profile["gemms_alone_ms"] = gemms_alone_ms(sizes, torch.float32, repeats=steps)
    return profile


def per_step(seconds: collections.Counter, walls: list, steps: int) -> dict:
    """The families in milliseconds per step; what the wall time holds beyond them is the rest."""
    step = statistics.median(walls)
    families = {family: 1e3 * seconds[family] / steps for family in FAMILIES[:-1]}
    families["autograd and Python"] = 1e3 * step - sum(families.values())
    return {"step_ms": 1e3 * step, "families_ms": families}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", nargs="+", default=["fp32", "fp16", "bf16"],
                        choices=("fp32", "fp16", "bf16"), help="minimp's precisions to profile")
    parser.add_argument("--steps", type=int, default=20, help="profiled steps after 3 warm-up")
    parser.add_argument("--torch-python", default="",
                        help="a Python that has PyTorch (default: this one, if it has)")
    parser.add_argument("--torch-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    if args.torch_only:
        print(json.dumps(profile_torch(args.steps)))
        return 0
    result = profile_minimp(args.precision, args.steps)
    command = [args.torch_python or sys.executable, __file__, "--torch-only",
               "--steps", str(args.steps)]
    try:
        done = subprocess.run(command, capture_output=True, text=True)
        torch = json.loads(done.stdout) if done.returncode == 0 else {
            "error": (done.stderr.strip().splitlines() or ["exit status %d" % done.returncode])[-1]}
    except OSError as error:  # no such interpreter
        torch = {"error": f"{command[0]}: {error.strerror}"}
    result["torch fp32"] = torch
    if args.json:
        print(json.dumps(result))
        return 0
    columns = [name for name in result if "families_ms" in result[name]]
    print(f"GPT step, batch 12 x 64, one thread: ms per step by op family, each step's median of "
          f"{args.steps}")
    print(f"  {'family':<20}" + "".join(f"{name:>13}" for name in columns))
    for family in FAMILIES:
        print(f"  {family:<20}" + "".join(f"{result[name]['families_ms'][family]:13.2f}"
                                          for name in columns))
    print(f"  {'step':<20}" + "".join(f"{result[name]['step_ms']:13.2f}" for name in columns))
    print(f"  {'its GEMMs alone':<20}" + "".join(f"{result[name]['gemms_alone_ms']:13.2f}"
                                                 for name in columns))
    if "error" in torch:
        print(f"  PyTorch not profiled: {torch['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
