"""Exposed gradient communication with overlap against without, measured in the same run (p = 2).

    mpirun -n 2 -bind-to core python mpirun_examples/overlap_bench.py            # about a minute
    mpirun -n 2 -bind-to core python mpirun_examples/overlap_bench.py --json

It trains the 3.2M-parameter MLP (--hidden 1024 --layers 4, fp16, global batch 256, 1 MiB
buckets: 7 of them) in rounds that alternate --overlap and --no-overlap, each with
--straggler-barrier, so the waits for the slower replica are timed apart and left out of the
exposed seconds (from the end of the last backward until the optimizer may step). It prints, per
mode, the median over the steps after the first of the exposed seconds, of all communication
seconds and of the whole step, and the ratio exposed(overlap) / exposed(no overlap).

Then the cost model's prediction of the same ratio for the same buckets on a stated data-centre
network (minimp/measure/costmodel.py DATACENTER, as between GPUs) at four backward times, where the
rings take nothing from the compute, unlike here: on a CPU core each rank also has to copy and add
the messages itself, between its own matrix products.
"""

import argparse
import json
import statistics

from minimp.measure import costmodel
from minimp.distributed import world
from minimp.distributed.launch import run_or_abort
from minimp.train import TrainConfig, train

MODEL = dict(hidden=1024, layers=4, batch_size=256, precision="fp16", bucket_mb=1.0)
FIELDS = ("exposed_communication_seconds", "communication_seconds", "straggler_seconds")


def one_run(overlap: bool, steps: int, comm) -> dict:
    """Medians of the metrics over the steps after the first (which allocates buffers)."""
    config = TrainConfig(
        **MODEL, steps=steps, log_every=10**6, overlap=overlap, straggler_barrier=True
    )
    config.validate(comm.size)
    history = train(config, log=lambda line: None, comm=comm)["history"][1:]
    medians = {field: statistics.median(r[field] for r in history) for field in FIELDS}
    step = [r["compute_seconds"] + r["communication_seconds"] + r["straggler_seconds"]
            for r in history]  # fmt: skip
    medians["step_seconds"] = statistics.median(step)
    return medians


def bucket_bytes() -> list[float]:
    """The buckets DataParallel plans for MODEL (float32 on the wire), in backward's order."""
    features, classes, hidden, layers = 64, 10, MODEL["hidden"], MODEL["layers"]
    sizes = [features * hidden, hidden]
    for _ in range(layers - 1):
        sizes += [hidden * hidden, hidden]
    sizes += [hidden * classes, classes]
    limit, buckets, current = MODEL["bucket_mb"] * 2**20, [], 0.0
    for elements in reversed(sizes):  # as DataParallel._plan_buckets
        if current and (current + elements * 4) > limit:
            buckets.append(current)
            current = 0.0
        current += elements * 4
    return buckets + [current]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=11, help="steps per run (drops the 1st)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each mode, alternating")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead")
    args = parser.parse_args()
    comm = world()
    runs: dict[str, list[dict]] = {"overlap": [], "no_overlap": []}
    for _ in range(args.rounds):
        runs["overlap"].append(one_run(True, args.steps, comm))
        runs["no_overlap"].append(one_run(False, args.steps, comm))
    if comm.rank != 0:
        return
    result = {
        mode: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
        for mode, rounds in runs.items()
    }
    exposed = {mode: result[mode]["exposed_communication_seconds"] for mode in result}
    result["exposed_ratio"] = exposed["overlap"] / exposed["no_overlap"]
    buckets = bucket_bytes()
    result["gpu_prediction"] = {
        f"backward {seconds * 1e3:g} ms": costmodel.overlapped_exposed_time(
            buckets, seconds, comm.size, costmodel.DATACENTER
        ) / sum(costmodel.ring_allreduce_time(b, comm.size, costmodel.DATACENTER) for b in buckets)
        for seconds in (2e-5, 1e-4, 5e-4, 1e-3)
    }
    if args.json:
        print(json.dumps(result))
        return
    print(f"p = {comm.size}, {len(buckets)} buckets, medians over {args.rounds} runs of each mode")
    for mode in ("no_overlap", "overlap"):
        row = result[mode]
        print(
            f"  {mode:10}  exposed {row['exposed_communication_seconds'] * 1e3:7.2f} ms"
            f"  communication {row['communication_seconds'] * 1e3:7.2f} ms"
            f"  straggler {row['straggler_seconds'] * 1e3:7.2f} ms"
            f"  step {row['step_seconds'] * 1e3:7.1f} ms"
        )
    print(f"  exposed(overlap) / exposed(no overlap) = {result['exposed_ratio']:.0%}")
    for label, ratio in result["gpu_prediction"].items():
        print(f"  predicted on {costmodel.DATACENTER.name}, {label}: {ratio:.0%}")


if __name__ == "__main__":
    run_or_abort(main)
