"""Fit the machine models minimp ships (minimp/measure/machine_models.json) from benchmark runs.

    for i in 1 2 3 4 5; do   # e*: held out by launch too, the rows of fresh processes
        for p in 2 4; do
            mpirun -bind-to core -n $p python mpirun_examples/allreduce_bench.py --json \
                > runs/p$p-$i.json
            mpirun -bind-to core -n $p python mpirun_examples/allreduce_bench.py \
                --no-calibration --json > runs/e$p-$i.json
        done
    done
    python scripts/fit_machine_models.py runs/p*.json runs/e*.json

Each run measured the model's terms at sizes of 3 x 2^k bytes; this takes, per number of ranks,
the median of every term across the runs and fits the lines through those medians (the same
fit as a run's own), so one noisy run moves the shipped constants less than it moves its own fit.
The benchmark's measured all-reduce times (at powers of two) are not fitted: they are held out,
and the file records, per algorithm, the band of the shipped model's median and worst
|model/measured - 1| over the runs' held-out sizes (lesson 8 draws it). Runs made with
--no-calibration carry no terms: they are only evaluated, and where a number of ranks has such
runs its band is theirs (sizes and launches the fit never saw, in processes that timed nothing
else first, as a training job all-reduces); otherwise the band is over the fitted runs' rows.
"""

import argparse
import datetime
import json
import os
import platform
import sys

import numpy as np

from minimp.checkpoints.errors import ConfigError
from minimp.checkpoints.files import atomic_write, check_output
from minimp.measure.calibrate import fit_model, join_rounds
from minimp.measure.machinemodel import ALGORITHMS, SHIPPED_PATH, MachineModel, relative_errors


def fit_from_runs(runs: list[dict]) -> MachineModel:
    """One model from the terms of several runs at the same number of ranks (medians per term)."""
    sizes = runs[0]["terms"]["sizes"]
    if any(run["terms"]["sizes"] != sizes for run in runs):
        raise SystemExit("fit_machine_models: runs measured different sizes; use one command")
    terms = join_rounds([run["terms"] for run in runs], np.median)
    return fit_model(runs[0]["ranks"], terms, f"shipped: medians of {len(runs)} runs")


def held_out_band(model: MachineModel, runs: list[dict]) -> dict:
    """{algorithm: {"median": [lowest, highest], "worst": [lowest, highest]}} over the runs, of
    the model's error on each run's measured sizes."""
    band = {}
    for algorithm in ALGORITHMS:
        found = [
            relative_errors(
                model, [r["bytes"] for r in run["rows"]], [r[algorithm] for r in run["rows"]],
                algorithm,
            )
            for run in runs
        ]  # fmt: skip
        band[algorithm] = {
            key: [min(f[key] for f in found), max(f[key] for f in found)]
            for key in ("median", "worst")
        }
    return band


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", help="allreduce_bench.py --json outputs")
    parser.add_argument("--out", default=SHIPPED_PATH)
    args = parser.parse_args(argv)
    try:  # before any work: the file can be written and replaces no other kind
        check_output("--out", args.out, "json", force=None)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    by_ranks: dict[int, list[dict]] = {}
    evaluated: dict[int, list[dict]] = {}  # --no-calibration runs: rows only
    for path in args.runs:
        with open(path) as file:
            run = json.load(file)
        group = by_ranks if run["terms"] is not None else evaluated
        group.setdefault(int(run["ranks"]), []).append(run)
    if set(evaluated) - set(by_ranks):
        raise SystemExit(
            "fit_machine_models: runs without calibration at "
            f"{sorted(set(evaluated) - set(by_ranks))} ranks have no calibrated runs to fit"
        )
    document = {
        "fitted": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "command": "scripts/fit_machine_models.py over mpirun_examples/allreduce_bench.py --json",
        "runs": {str(p): len(runs) for p, runs in sorted(by_ranks.items())},
        "evaluated_runs": {str(p): len(runs) for p, runs in sorted(evaluated.items())},
    }
    models = {p: fit_from_runs(runs) for p, runs in sorted(by_ranks.items())}
    document["models"] = {str(p): model.as_dict() for p, model in models.items()}
    document["held_out"] = {
        str(p): held_out_band(models[p], evaluated.get(p, by_ranks[p])) for p in models
    }
    text = json.dumps(document, indent=1)
    atomic_write(args.out, lambda file: file.write(text.encode()))
    print(f"wrote {args.out}: models at {sorted(by_ranks)} ranks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
