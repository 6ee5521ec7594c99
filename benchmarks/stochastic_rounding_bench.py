"""Benchmark: bf16 weights without masters stall on small updates; stochastic rounding does not.

    python benchmarks/stochastic_rounding_bench.py            # digits MLP, Adam lr 3e-5, 1000 steps
    python benchmarks/stochastic_rounding_bench.py --lr 1e-4 --steps 500

Trains the digits MLP three times in this run, from the same seed and batches, in bf16: with
float32 masters (--master-weights fp32, the reference), without masters rounding each update to
nearest (--master-weights none), and without masters rounding stochastically (--master-weights none
--stochastic-rounding). Adam's steps are about lr per weight (lr g / (|g| + 1e-8) at the first); at
lr 3e-5 that is below half a bf16 ulp for every weight of magnitude 2^-7 = 0.0078 or more (half an
ulp there is at least 2^-15 = 3.05e-5), so to nearest such steps round away. Prints, for each
run, the mean training loss of the last 50 steps, the loss at a few steps, the test accuracy, and
how many weights end the run at their initial bf16 value; then each run's final loss over the
fp32-master run's (1: the same).
"""

import argparse

import numpy as np

from minimp import distributed as dist
from minimp.precision.casting import BFLOAT16
from minimp.train import TrainConfig, train
from minimp.train.tasks import TASKS

RUNS = (("fp32 masters", dict(master_weights="fp32")),
        ("bf16, to nearest", dict(master_weights="none")),
        ("bf16, stochastic", dict(master_weights="none", stochastic_rounding=True)))
TAIL = 50  # steps averaged for the final loss (one batch's loss is noisy)


def initial_weights(config: TrainConfig) -> dict[str, np.ndarray]:
    """The run's weights before its first step: the model built from --seed, rounded to bf16."""
    model = TASKS[config.dataset](config, BFLOAT16).build_model(np.random.default_rng(config.seed))
    return {name: p.data.astype(BFLOAT16) for name, p in model.named_parameters()}


def run(flags: dict) -> dict:
    """One training run on one process; returns its summary (train()'s)."""
    config = TrainConfig(**flags)
    config.validate(1)
    return dist.simulate(1, lambda comm: train(config, log=lambda line: None, comm=comm))[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lr", type=float, default=3e-5)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    base = dict(precision="bf16", optimizer="adam", lr=args.lr, steps=args.steps, seed=args.seed,
                log_every=10**6)
    start = initial_weights(TrainConfig(**base))
    total = sum(weight.size for weight in start.values())
    print(f"digits MLP, bf16, Adam lr {args.lr:g}, {args.steps} steps, seed {args.seed}: "
          f"{total:,} weights")
    checkpoints = [step for step in (1, args.steps // 4, args.steps // 2, args.steps) if step]
    print(f"{'run':<18} {'final loss':>10}  " + " ".join(f"{f'@{s}':>7}" for s in checkpoints)
          + f"  {'test acc':>8}  weights at their initial value")
    finals = {}
    for name, flags in RUNS:
        result = run({**base, **flags})
        losses = [row["loss"] for row in result["history"]]
        finals[name] = float(np.mean(losses[-TAIL:]))
        final = {n: w.astype(BFLOAT16) for n, w in result["master_weights"].items()}
        unchanged = sum(int((final[n] == start[n]).sum()) for n in start)
        at = " ".join(f"{losses[step - 1]:7.4f}" for step in checkpoints)
        print(f"{name:<18} {finals[name]:10.4f}  {at}  {result['test_accuracy']:8.4f}  "
              f"{unchanged:,} ({unchanged / total:.1%})")
    reference = finals[RUNS[0][0]]
    for name, _ in RUNS[1:]:
        print(f"final loss {name} / fp32 masters: {finals[name] / reference:.3f}")


if __name__ == "__main__":
    main()
