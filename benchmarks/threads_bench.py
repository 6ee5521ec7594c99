"""Benchmark: `python -m minimp.train` with the default thread count against a fixed one, on a
quiet machine and beside processes that keep cores busy, timed in alternating runs.

    python benchmarks/threads_bench.py                      # the digits MLP, 500 steps
    python benchmarks/threads_bench.py --run gpt --busy 2   # the GPT, 10 steps, 2 busy processes
    python benchmarks/threads_bench.py --products --busy 2  # single products, 1 and 2 threads

`--threads 0` (the default) gives a rank one BLAS thread per 2^30 multiply-adds of its step's
largest product (minimp/train/threads.py); the baseline, `--threads 2` by default, is what the
default was before on this project's 2-core machine (its cores / its ranks). Each round runs both,
in alternating order; `--busy N` starts N `while True: pass` processes first (and stops them at the
end). Prints each variant's wall times (min-max and median over the rounds), the median ratio
default / baseline, and the line in which the run said how many threads it chose. `--products`
times single products instead (each followed by elementwise work on its result, as in a step),
with one BLAS thread and with two, in alternating blocks: where a second thread starts to pay; and
says whether the two counts give the product the same bits.
"""

import argparse
import math
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


PRODUCTS = [(768, 128, 512), (768, 512, 2048), (2048, 512, 2048), (4096, 768, 3072)]  # m, k, n


def time_products() -> None:
    """Print each product's median time with 2 BLAS threads over its time with 1."""
    import numpy as np
    from threadpoolctl import threadpool_limits

    rng = np.random.default_rng(0)
    for m, k, n in PRODUCTS:
        a, b = (rng.standard_normal(shape, dtype=np.float32) for shape in ((m, k), (k, n)))

        def product():
            c = a @ b
            np.tanh(c, out=c)  # the elementwise work that follows a product in a step
            c *= 0.5

        repeats = max(3, math.ceil(3e8 / (m * k * n)))
        seconds: dict = {1: [], 2: []}
        for block in range(8):
            for threads in (1, 2) if block % 2 == 0 else (2, 1):
                with threadpool_limits(threads):
                    product()
                    for _ in range(repeats):
                        start = time.perf_counter()
                        product()
                        seconds[threads].append(time.perf_counter() - start)
        one, two = (statistics.median(seconds[threads]) for threads in (1, 2))
        with threadpool_limits(1):
            alone = a @ b
        with threadpool_limits(2):
            same = np.array_equal(alone, a @ b)
        print(f"  {m}x{k} @ {k}x{n}: {m * k * n / 1e6:7,.0f} M multiply-adds, 1 thread "
              f"{1e3 * one:8.2f} ms, 2 threads {1e3 * two:8.2f} ms, 2 / 1: {two / one:.2f}, "
              f"{'the same bits' if same else 'other bits'} with 2 threads")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", default="mlp", choices=sorted(RUNS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--busy", type=int, default=0, help="busy processes beside the runs")
    parser.add_argument("--baseline", type=int, default=2, help="the fixed --threads to compare")
    parser.add_argument("--products", action="store_true",
                        help="time single products with 1 and 2 threads instead of runs")
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
        if args.products:
            print(f"single products, {args.busy} busy processes beside")
            time_products()
            return 0
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
