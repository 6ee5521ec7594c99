"""Benchmark: a training step of nanoGPT's CPU GPT under each low-precision recipe, against bf16
timed in the same run.

    python benchmarks/recipe_step_bench.py              # 12 steps each, median of the last 10
    python benchmarks/recipe_step_bench.py --steps 30

Each recipe trains the shakespeare defaults (4 blocks of width 128, 12 x 64 tokens a step, AdamW)
on one process and one BLAS thread; the first two steps are left out of the median (numba's
compiled loops load there). Prints the median step time, tokens per second and the ratio to
bf16's step. The recipes emulate their formats in NumPy and numba (precision/codes.py casts,
accumulate.py sums), so the ratios measure the emulation, not what the formats cost on a GPU.
"""

import argparse
import statistics
import time

from minimp import backend
from minimp import distributed as dist
from minimp.train import TrainConfig
from minimp.train.fp8 import RECIPE_FLAGS
from minimp.train.loop import Run

WARMUP = 2


def step_seconds(flags: dict, steps: int) -> float:
    """The median wall time of steps WARMUP + 1 .. steps of one run."""
    config = TrainConfig(dataset="shakespeare", steps=steps, eval_every=0, threads=1, **flags)
    config.validate(1)

    def body(comm) -> list[float]:
        run = Run(config, comm, log=lambda line: None)
        times = []
        for step in range(1, steps + 1):
            started = time.perf_counter()
            run.step(step)
            times.append(time.perf_counter() - started)
        return times[WARMUP:]

    with backend.limit_cpu_threads(1):
        (times,) = dist.simulate(1, body)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12, help="steps per recipe (> 2)")
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must be above {WARMUP} (the warm-up steps left out)")
    tokens = 12 * 64
    print(f"nanoGPT CPU GPT, one thread, median of steps {WARMUP + 1}-{args.steps}")
    print(f"{'recipe':<14} {'s/step':>8} {'tokens/s':>9} {'/ bf16':>7}")
    baseline = None
    for name, flags in RECIPE_FLAGS.items():
        seconds = step_seconds(flags, args.steps)
        baseline = baseline or seconds
        print(f"{name:<14} {seconds:8.3f} {tokens / seconds:9,.0f} {seconds / baseline:7.2f}",
              flush=True)


if __name__ == "__main__":
    main()
