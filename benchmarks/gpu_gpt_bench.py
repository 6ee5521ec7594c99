"""Benchmark: nanoGPT's shakespeare-char GPU config, one training step, in minimp (fp32, fp16,
bf16) and in PyTorch eager (fp32 and torch.autocast fp16 / bf16, with SDPA beside them), timed
in alternating blocks on one GPU.

    python benchmarks/gpu_gpt_bench.py                  # 6 layers, 6 heads, 384 wide, 256 x 64
    python benchmarks/gpu_gpt_bench.py --json --save gpt_bench.json

Each variant is a worker process (gpu_gpt_step.py for minimp, torch_gpt_step.py for PyTorch,
both serving step_server.py's protocol), so each has the GPU's memory to itself and its own peak;
the parent asks them in turn for --steps steps, --blocks rounds per run, --runs runs, and takes
the median step of each run. Both sides: dropout 0.2 (nanoGPT's), AdamW, clip at norm 1, float32
products in float32 (no TF32), PyTorch's attention written out as nanoGPT's slow path (its SDPA
variant is flash attention where PyTorch picks it). Prints tokens/s of each, minimp fp16 / PyTorch
AMP fp16 (goal >= 0.5), each step against its GEMMs alone (the step's matrix products back to
back between CUDA events, gpt_gemms.py; goal <= 2.5, stretch 1.5), and the peak device memory
(CuPy's memory pool read by a memory hook / torch.cuda.max_memory_allocated). Without a GPU it
exits with status 2 and one line, before any work; without PyTorch its rows say why.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from minimp import backend
from minimp.checkpoints.errors import ConfigError
from minimp.checkpoints.files import atomic_write, check_output

HERE = os.path.dirname(os.path.abspath(__file__))
# variant -> (library, worker flags); the minimp ones first, as the goals compare them
VARIANTS = {
    "minimp fp32": ("minimp", ["--precision", "fp32"]),
    "minimp fp16": ("minimp", ["--precision", "fp16"]),
    "minimp bf16": ("minimp", ["--precision", "bf16"]),
    "torch fp32": ("torch", ["--autocast", "none"]),
    "torch amp fp16": ("torch", ["--autocast", "fp16"]),
    "torch amp bf16": ("torch", ["--autocast", "bf16"]),
    "torch amp fp16 sdpa": ("torch", ["--autocast", "fp16", "--attention", "sdpa"]),
}
SIZES = ("vocab", "context", "layers", "heads", "width", "batch")
GOAL_OVER_TORCH = 0.5  # minimp fp16 tokens/s over PyTorch eager AMP fp16, at least
GOAL_OVER_GEMMS, STRETCH_OVER_GEMMS = 2.5, 1.5  # minimp fp16 step / its GEMMs alone, at most
GEMM_TIMING = ("the step's GEMMs alone (gpt_gemms.py: same shapes, the dtypes each library's "
               "products read), back to back between CUDA events (on the CPU, the host's "
               "clock), median of 10")
MEMORY = ("peak bytes in use during one step (minimp: CuPy's memory pool, read by a memory hook "
          "after each allocation; PyTorch: torch.cuda.max_memory_allocated) and the most the "
          "allocator held (pool total_bytes / max_memory_reserved)")


def worker_command(name, args):
    """The command line of a variant's worker."""
    library, flags = VARIANTS[name]
    sizes = [f"--{size}={getattr(args, size)}" for size in SIZES] + [f"--dropout={args.dropout}"]
    if library == "minimp":
        return [sys.executable, os.path.join(HERE, "gpu_gpt_step.py"), *flags, *sizes,
                f"--device={args.device}"]
    device = "cuda" if args.device == "gpu" else "cpu"
    return [args.torch_python, os.path.join(HERE, "torch_gpt_step.py"), *flags, *sizes,
            f"--device={device}"]


class Worker:
    """A variant's process: ask(command) sends one line and returns its JSON answer, or None
    once the process has ended (then `problem` says why, from its last line of stderr)."""

    def __init__(self, command):
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a file: a chatty worker cannot block
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=self.stderr, text=True)
        self.problem = None

    def send(self, command):
        try:
            self.process.stdin.write(f"{command}\n")
            self.process.stdin.flush()
        except BrokenPipeError:
            pass  # it has ended: receive says why

    def receive(self):
        for line in self.process.stdout:
            try:
                return json.loads(line)
            except ValueError:
                continue  # a library's own message on stdout, not an answer
        self.process.wait()
        self.stderr.seek(0)
        lines = self.stderr.read().strip().splitlines()
        self.problem = {"unavailable": f"exit status {self.process.returncode}: " + (
            lines[-1] if lines else "no message")}
        return None

    def close(self):
        if self.process.stdin:
            self.process.stdin.close()
        self.process.wait()
        self.stderr.close()


def measure(workers, args, deadline):
    """{variant: [[step seconds of run 1], ...]}, {variant: its stats}, {variant: its problem}:
    warm-up, then --runs runs of --blocks rounds, each round one block of every live variant in
    turn; past `deadline` (time.monotonic()) a run starts no round but its first."""
    problems = {}

    def answer(name, command):
        workers[name].send(command)
        reply = workers[name].receive()
        if reply is None or isinstance(reply, dict) and set(reply) & {"unavailable",
                                                                      "unsupported"}:
            problems[name] = reply or workers[name].problem
            return None
        return reply

    for worker in workers.values():  # the warm-ups run side by side
        worker.send(args.warmup)
    for name, worker in workers.items():
        reply = worker.receive()
        if reply is None or isinstance(reply, dict):
            problems[name] = reply or worker.problem
    samples = {name: [] for name in workers if name not in problems}
    for _ in range(args.runs):
        runs = {name: [] for name in samples}
        for round_index in range(args.blocks):
            if round_index and time.monotonic() > deadline:
                break
            for name in [name for name in samples if name not in problems]:
                runs[name] += answer(name, args.steps) or []
        for name, seconds in runs.items():
            samples[name].append(seconds)
    stats = {name: answer(name, "stats") for name in samples if name not in problems}
    for name in problems:
        samples.pop(name, None)
        stats.pop(name, None)
    return samples, stats, problems


def median_ms(seconds):
    return 1e3 * statistics.median(seconds)


def variant_row(runs, stats, tokens):
    """The figures of one variant from its step seconds per run and its worker's stats."""
    per_run = [median_ms(run) for run in runs]
    step_ms = statistics.median(per_run)
    row = {
        "step_ms": step_ms, "step_ms_runs": per_run,
        "tokens_per_s": tokens / step_ms * 1e3,
        "tokens_per_s_runs": [tokens / ms * 1e3 for ms in per_run],
        "steps_timed": sum(len(run) for run in runs),
    }  # fmt: skip
    gemms = stats.get("gemms_alone_ms")
    if gemms:
        row.update(gemms_alone_ms=gemms, step_over_gemms=step_ms / gemms,
                   gemm_share=gemms / step_ms)
    for key in ("peak_allocated_bytes", "peak_reserved_bytes", "torch", "cupy"):
        if key in stats:
            row[key] = stats[key]
    return row


def summarize(config, samples, stats, problems, device):
    """The benchmark's JSON object: config, every variant's row (or why it did not run), the
    ratio to PyTorch AMP and the goals. samples: {variant: [[seconds], ...] per run}."""
    tokens = config["batch"] * config["context"]
    variants = {name: dict(problems[name]) if name in problems
                else variant_row(samples[name], stats.get(name, {}), tokens)
                for name in [*samples, *problems]}
    report = {
        "device": device, "config": config, "tokens_per_step": tokens,
        "variants": {name: variants[name] for name in VARIANTS if name in variants},
        "gemm_timing": GEMM_TIMING, "memory": MEMORY, "goals": {},
    }  # fmt: skip
    minimp, torch = variants.get("minimp fp16", {}), variants.get("torch amp fp16", {})
    if "step_ms" in minimp and "step_ms" in torch:
        runs = zip(minimp["step_ms_runs"], torch["step_ms_runs"])  # runs alternate: pair them
        ratio = torch["step_ms"] / minimp["step_ms"]
        report["goals"]["minimp_fp16_over_torch_amp_fp16_tokens_per_s"] = {
            "value": ratio, "runs": [t / m for m, t in runs], "goal": f">= {GOAL_OVER_TORCH}",
            "met": ratio >= GOAL_OVER_TORCH}
    if "step_over_gemms" in minimp:
        value = minimp["step_over_gemms"]
        report["goals"]["minimp_fp16_step_over_gemms_alone"] = {
            "value": value, "goal": f"<= {GOAL_OVER_GEMMS}", "met": value <= GOAL_OVER_GEMMS,
            "stretch": f"<= {STRETCH_OVER_GEMMS}", "stretch_met": value <= STRETCH_OVER_GEMMS}
    return report


def markdown(report):
    """The report as Markdown lines (what docs/gpu.md shows; scripts/gpu_report.py prints it
    too): the model, a row per variant or why it did not run, then each goal with its value."""
    config = report["config"]
    out = [f"GPT step on {report['device']}: {config['layers']} layers, {config['heads']} heads, "
           f"width {config['width']}, context {config['context']}, batch {config['batch']}, "
           f"dropout {config['dropout']}; the median step of each of {config['runs']} runs of "
           "alternating blocks, and their median", "",
           "| variant | step ms (runs) | tokens/s | GEMMs alone ms | step / GEMMs | GEMM share "
           "| peak MiB (held) |", "| --- | --- | --- | --- | --- | --- | --- |"]
    mib = lambda row, key: f"{row[key] / 2**20:,.0f}" if key in row else "-"  # noqa: E731
    for name, row in report["variants"].items():
        if "step_ms" not in row:
            why = "; ".join(f"{kind}: {reason}" for kind, reason in row.items())
            out.append(f"| {name} | {why} | | | | | |")
            continue
        runs = ", ".join(f"{ms:.1f}" for ms in row["step_ms_runs"])
        gemms = (f"{row['gemms_alone_ms']:.1f} | {row['step_over_gemms']:.2f} | "
                 f"{row['gemm_share']:.0%}" if "gemms_alone_ms" in row else "- | - | -")
        out.append(f"| {name} | {row['step_ms']:.1f} ({runs}) | {row['tokens_per_s']:,.0f} | "
                   f"{gemms} | {mib(row, 'peak_allocated_bytes')} "
                   f"({mib(row, 'peak_reserved_bytes')}) |")
    out.append("")
    for name, goal in report["goals"].items():
        runs = f" (runs {', '.join(f'{r:.2f}' for r in goal['runs'])})" if "runs" in goal else ""
        stretch = (f"; stretch {goal['stretch']}: {'met' if goal['stretch_met'] else 'not met'}"
                   if "stretch" in goal else "")
        out.append(f"- {name}: **{goal['value']:.2f}**{runs}, goal {goal['goal']}: "
                   f"{'met' if goal['met'] else 'not met'}{stretch}")
    out.append(f"- GEMMs alone: {report['gemm_timing']}; memory: {report['memory']}")
    return out


def device_name(device):
    if device == "cpu":
        return "cpu (a smoke run: these figures say nothing of a GPU)"
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    return name.decode() if isinstance(name, bytes) else name


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 65), ("context", 256), ("layers", 6), ("heads", 6),
                          ("width", 384), ("batch", 64)):
        parser.add_argument(f"--{name}", type=int, default=default, help=f"(default {default})")
    parser.add_argument("--dropout", type=float, default=0.2, help="nanoGPT's 0.2 by default")
    parser.add_argument("--steps", type=int, default=10, help="steps per block (default 10)")
    parser.add_argument("--blocks", type=int, default=2, help="rounds per run (default 2)")
    parser.add_argument("--runs", type=int, default=3, help="runs, each its own median (3)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (3)")
    parser.add_argument("--max-seconds", type=float, default=150.0,
                        help="from the start, after which a run starts no round but its first "
                        "(default 150)")
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--torch-python", default=sys.executable,
                        help="a Python with PyTorch (default this one); '' for no PyTorch rows")
    parser.add_argument("--device", choices=("gpu", "cpu"), default="gpu",
                        help="cpu: the same protocol on the CPU, for tests")
    parser.add_argument("--json", action="store_true", help="one JSON object, nothing else")
    parser.add_argument("--save", metavar="PATH", help="also write the JSON object to PATH")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.variants.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in VARIANTS]
    if unknown or not chosen:
        parser.exit(2, f"{parser.prog}: error: --variants: unknown {unknown or 'none given'} "
                       f"(use names from: {', '.join(VARIANTS)})\n")
    if not args.torch_python:
        chosen = [name for name in chosen if VARIANTS[name][0] != "torch"]
    args.variants = chosen
    try:  # before any work: the file can be written and replaces no other kind
        if args.save:
            check_output("--save", args.save, "json", force=None)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    return args


def main(argv=None):
    args = parse_args(argv)
    if args.device == "gpu":
        try:
            backend.check_device("gpu")
        except backend.DeviceError as error:
            print(f"gpu_gpt_bench: {error}", file=sys.stderr)
            return 2
    deadline = time.monotonic() + args.max_seconds
    workers = {name: Worker(worker_command(name, args)) for name in args.variants}
    try:
        samples, stats, problems = measure(workers, args, deadline)
    finally:
        for worker in workers.values():
            worker.close()
    config = {size: getattr(args, size) for size in SIZES}
    config.update(dropout=args.dropout, steps_per_block=args.steps, blocks=args.blocks,
                  runs=args.runs)
    report = summarize(config, samples, stats, problems, device_name(args.device))
    text = json.dumps(report)
    if args.save:
        atomic_write(args.save, lambda file: file.write(text.encode()))
    print(text if args.json else "\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
