"""Benchmark: `python -m minimp.train` with the default thread count against a fixed one, on a
quiet machine and beside processes that keep cores busy, timed in alternating runs.

    python benchmarks/threads_bench.py                      # the digits MLP, 500 steps
    python benchmarks/threads_bench.py --run gpt --busy 2   # the GPT, 10 steps, 2 busy processes

`--threads 0` (the default) gives a rank one BLAS thread per 2^30 multiply-adds of its step's
largest product (minimp/train/threads.py); the baseline, `--threads 2` by default, is what the
default was before on this project's 2-core machine (its cores / its ranks). Each round runs both,
in alternating order; `--busy N` starts N `while True: pass` processes first (and stops them at the
end). Prints each variant's wall times (min-max and median over the rounds), the median ratio
default / baseline, and the line in which the run said how many threads it chose.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

RUNS = {  # the README's runs, with fewer steps for the GPT (its evaluation at the end included)
    "mlp": [sys.executable, "-m", "minimp.train"],
    "gpt": [sys.executable, "-m", "minimp.train", "--dataset", "shakespeare", "--steps", "10",
            "--eval-every", "0", "--eval-batches", "2"],
    "mpi2": ["mpirun", "-n", "2", sys.executable, "-m", "minimp.train", "--steps", "100"],
}


def wall_seconds(command: list) -> tuple[float, str]:
    """The command's wall time and the line where it said its threads (exit status checked)."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=900)
    seconds = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"threads_bench: {' '.join(command)} exited {done.returncode}: "
                         f"{(done.stderr.strip().splitlines() or [''])[-1]}")
    said = re.search(r"threads: [^\n]*", done.stdout)
    return seconds, said.group(0).strip() if said else ""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="mlp", choices=sorted(RUNS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--baseline", type=int, default=2, help="the fixed --threads to compare")
    args = parser.parse_args()
    for flag in ("rounds", "baseline"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    if args.busy < 0:
        parser.error(f"--busy must be 0 or more, got {args.busy}")
    variants = {"default (--threads 0)": "0", f"--threads {args.baseline}": str(args.baseline)}
    times: dict = {name: [] for name in variants}
    said = {}
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
            for _ in range(args.busy)]
    try:
        for round_ in range(args.rounds):
            names = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
            for name in names:
                seconds, said[name] = wall_seconds(RUNS[args.run] + ["--threads", variants[name]])
                times[name].append(seconds)
    finally:
        for process in busy:
            process.kill()
    print(f"{args.run}, {args.rounds} rounds, {args.busy} busy processes beside, load "
          f"{os.getloadavg()[0]:.1f}")
    for name, seconds in times.items():
        print(f"  {name:<22} {min(seconds):7.2f}-{max(seconds):7.2f} s  median "
              f"{statistics.median(seconds):7.2f} s   {said[name]}")
    default, baseline = (statistics.median(seconds) for seconds in times.values())
    print(f"  default / --threads {args.baseline}: {default / baseline:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
