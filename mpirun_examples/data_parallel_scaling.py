"""Data-parallel scaling: samples/s and communication share at p = 1, 2, 4, measured and predicted.

    python mpirun_examples/data_parallel_scaling.py          # launches mpirun itself, 1-2 minutes
    python mpirun_examples/data_parallel_scaling.py --json

For two model sizes and both gradient wire dtypes it runs `mpirun -n p python -m minimp.train` (fp16
training, global batch 256), reads each run's metrics (compute seconds, communication seconds, bytes
sent per step), and prints them beside the cost models: the ring all-reduce time the machine model
predicts for the same run on this machine (measure/machinemodel.py), and for p = 1,024 replicas on a
stated data-centre network (weak scaling: each replica keeps the local batch of the p = 4 run). On a
2-core machine 4 ranks are oversubscribed: each rank gets half a core, and MPICH's waiting ranks
spin, so compute slows down too. The table says so rather than hiding it.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from minimp.measure import costmodel
from minimp.measure.machinemodel import shipped_model

MODELS = {
    "small": ["--hidden", "128", "--layers", "4"],
    "large": ["--hidden", "1024", "--layers", "4"],
}
FEATURES, CLASSES = 64, 10
WARM_UP = 5  # steps left out of the medians (the first steps allocate and fill caches)


def parameter_count(hidden, layers):
    return (
        (FEATURES * hidden + hidden)
        + (layers - 1) * (hidden * hidden + hidden)
        + hidden * CLASSES
        + CLASSES
    )


def run(ranks, model, wire, steps, folder):
    metrics = os.path.join(folder, f"{model}-{wire}-{ranks}.jsonl")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    command = [
        mpirun,
        "-n",
        str(ranks),
        sys.executable,
        "-m",
        "minimp.train",
        *MODELS[model],
        "--batch-size",
        "256",
        "--steps",
        str(steps),
        "--log-every",
        "100000",
        "--grad-comm-dtype",
        wire,
        "--no-overlap",  # the all-reduce after backward, timed whole (overlap_bench.py: overlap)
        "--metrics",
        metrics,
    ]
    subprocess.run(command, check=True, capture_output=True, text=True, timeout=600)
    # drop warm-up steps and the summary
    records = [json.loads(line) for line in open(metrics)][WARM_UP:-1]
    compute = statistics.median(r["compute_seconds"] for r in records)
    communication = statistics.median(r["communication_seconds"] for r in records)
    return {
        "ranks": ranks,
        "model": model,
        "wire": wire,
        "compute_s": compute,
        "communication_s": communication,
        "bytes_sent": statistics.median(r["bytes_sent"] for r in records),
        "samples_per_s": 256 / (compute + communication),
        "communication_share": communication / (compute + communication),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="at least 7: 5 warm up, 2 measured")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.steps < WARM_UP + 2:
        parser.exit(2, f"{parser.prog}: error: --steps {args.steps}: the first {WARM_UP} steps "
                       f"warm up, so at least {WARM_UP + 2} are needed for a median\n")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for model in MODELS:
            hidden, layers = int(MODELS[model][1]), int(MODELS[model][3])
            parameters = parameter_count(hidden, layers)
            for wire in ("fp32", "fp16"):
                for ranks in args.ranks:
                    row = run(ranks, model, wire, args.steps, folder)
                    gradient_bytes = parameters * (2 if wire == "fp16" else 4)
                    row["parameters"] = parameters
                    # the shipped machine model (measure/machinemodel.py): this machine's terms
                    row["predicted_communication_s"] = (
                        shipped_model(ranks).ring_allreduce(gradient_bytes) if ranks > 1 else 0.0
                    )
                    # per replica, with the local batch of this run
                    local_compute = row["compute_s"]
                    at_scale = costmodel.ring_allreduce_time(
                        gradient_bytes, 1024, costmodel.DATACENTER
                    )
                    row["predicted_1024_communication_s"] = at_scale
                    row["predicted_1024_samples_per_s"] = (
                        1024 * (256 // ranks) / (local_compute + at_scale)
                    )
                    rows.append(row)
    if args.json:
        print(json.dumps({"rows": rows, "network_1024": vars(costmodel.DATACENTER)}))
        return
    print("fp16 training, global batch 256, median per step. 2 cores: 4 ranks are oversubscribed.")
    print(
        f"{'model':>6} {'params':>9} {'wire':>5} {'p':>2} {'samples/s':>10} {'compute ms':>11} "
        f"{'comm ms':>8} {'comm %':>7} {'bytes/step':>11} {'model comm ms':>14} "
        f"{'p=1024 comm ms':>15}"
    )
    for r in rows:
        print(
            f"{r['model']:>6} {r['parameters']:>9,} {r['wire']:>5} {r['ranks']:>2} "
            f"{r['samples_per_s']:>10,.0f} "
            f"{r['compute_s'] * 1e3:>11.2f} {r['communication_s'] * 1e3:>8.2f} "
            f"{100 * r['communication_share']:>6.1f}% {r['bytes_sent']:>11,.0f} "
            f"{r['predicted_communication_s'] * 1e3:>14.2f} "
            f"{r['predicted_1024_communication_s'] * 1e3:>15.2f}"
        )
    print(
        f"p=1024 network: {costmodel.DATACENTER.name} "
        f"(alpha {costmodel.DATACENTER.alpha * 1e6:g} us, "
        f"{1 / costmodel.DATACENTER.beta / 1e9:g} GB/s)"
    )


if __name__ == "__main__":
    main()
