"""The expert load's balance of an --experts run, from its --metrics file: max/mean over the
experts, as a mean over a range of steps, for the worst block (the metrics' expert_load_imbalance),
for each block, and summed over the blocks; and the run's final validation loss, if it has one.

    python scripts/moe_balance.py m.jsonl               # steps 451-500 (docs/moe.md's table)
    python scripts/moe_balance.py m.jsonl --steps 1-40
"""

import argparse
import json
import sys

import numpy as np


def balance(rows: list[dict], first: int, last: int) -> dict:
    """{worst, blocks, summed, steps} over the metrics rows of steps first..last."""
    chosen = [row for row in rows if "step" in row and first <= row["step"] <= last]
    if not chosen:
        raise ValueError(f"no metrics rows for steps {first}-{last}")
    if "expert_load_by_block" not in chosen[0]:
        raise ValueError("these metrics hold no expert_load_by_block (a run with --experts)")
    loads = np.array([row["expert_load_by_block"] for row in chosen], np.float64)  # (S, L, E)
    summed = loads.sum(axis=1)  # (S, E)
    return {"worst": float(np.mean([row["expert_load_imbalance"] for row in chosen])),
            "blocks": (loads.max(axis=2) / loads.mean(axis=2)).mean(axis=0).tolist(),
            "summed": float((summed.max(axis=1) / summed.mean(axis=1)).mean()),
            "steps": len(chosen)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", help="the run's --metrics file (JSON lines)")
    parser.add_argument("--steps", default="451-500", help="first-last step (default 451-500)")
    args = parser.parse_args(argv)
    try:
        first, last = (int(part) for part in args.steps.split("-"))
        with open(args.metrics) as file:
            rows = [json.loads(line) for line in file if line.strip()]
        result = balance(rows, first, last)
    except (OSError, ValueError) as error:
        print(f"moe_balance: {error}", file=sys.stderr)
        return 2
    blocks = ", ".join(f"{value:.3f}" for value in result["blocks"])
    print(f"steps {first}-{last} ({result['steps']} rows): max/mean worst block "
          f"{result['worst']:.3f}; each block {blocks}; summed over the blocks "
          f"{result['summed']:.3f}")
    summary = [row for row in rows if "val_loss" in row and "step" not in row]
    if summary:
        print(f"final validation loss {summary[-1]['val_loss']:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
