"""The planner against this machine: predicted and measured step time of every grid on 4 ranks.

    python mpirun_examples/plan_check.py                  # launches mpirun itself, 6-11 minutes
    python mpirun_examples/plan_check.py --steps 6 --json

1. One process with one BLAS thread trains the GPT (python -m minimp.train --dataset shakespeare:
   4 blocks of 128, context 64, fp16, AdamW) on batches of 16 in 4 micro-batches of 4 rows; its
   median step time and the step's FLOPs (plan/steptime.py's count, Narayanan et al.'s Eq. 3
   without recomputation) give the compute rate of one process.
2. Every layout of 4 ranks with dp x tp x pp = 4 (and each ZeRO stage when dp > 1) trains the same
   model on the same batch of 16 in micro-batches of 4 rows (M = 16 / (4 dp) per replica), and
   its median step time (compute + communication seconds of the metrics, after the first
   `--skip` steps) is the measurement.
3. The planner predicts each one with `presets.this_machine`: the machine model minimp ships
   for 4 ranks prices every collective (machinemodel.shipped_model), and each rank computes at
   the measured rate x 2 cores / 4 ranks. Four ranks on this machine's two cores are
   oversubscribed: they take turns on the cores, so each computes at about half of one process's
   rate, and MPI's waiting ranks spin rather than sleep, so a pipeline stage that waits does not
   lend its core. Other jobs on the machine move every measurement.

Tensor parallelism joins as soon as the trainer has it: `layouts()` lists tp > 1 layouts when
`python -m minimp.train --help` offers --tp, and `train_command` passes it on.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from minimp.backend import available_memory
from minimp.plan.inputs import Job, Layout, divisors
from minimp.plan.presets import SHAKESPEARE, this_machine
from minimp.plan.steptime import step_flops, step_time

RANKS, CORES = 4, os.cpu_count() or 2
BATCH, ROWS = 16, 4  # samples per step, rows per micro-batch
# minimp keeps the embedding and the head whole on every tensor-parallel rank
JOB = Job(BATCH, (ROWS,), precision="fp16", optimizer="adamw", grad_comm_bytes=4,
          vocabulary_parallel=False)
COMMON = ["--dataset", "shakespeare", "--batch-size", str(BATCH), "--log-every", "100000"]
COMMON += ["--eval-every", "0", "--eval-batches", "1"]


def trainer_has_tensor_parallelism() -> bool:
    """Whether `python -m minimp.train` takes --tp yet (the seam for tp grids)."""
    command = [sys.executable, "-m", "minimp.train", "--help"]
    return "--tp" in subprocess.run(command, capture_output=True, text=True, check=True).stdout


def layouts(ranks: int, tensor_parallel: bool) -> list[Layout]:
    """Every (dp, tp, pp) of `ranks` the GPT allows (tp only with `tensor_parallel`), each ZeRO
    stage over dp > 1, micro-batches of ROWS rows."""
    found = []
    for tp in divisors(ranks) if tensor_parallel else [1]:
        for pp in divisors(ranks // tp):
            dp = ranks // (tp * pp)
            if SHAKESPEARE.heads % tp or SHAKESPEARE.layers % pp or BATCH % (dp * ROWS):
                continue
            for zero in range(4) if dp > 1 else [0]:
                found.append(Layout(dp, tp, pp, zero, ROWS, BATCH // (dp * ROWS)))
    return found


def train_command(layout: Layout, steps: int, metrics: str) -> list[str]:
    """The mpirun command line that trains with this layout."""
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    ranks = layout.dp * layout.tp * layout.pp
    command = [mpirun, "-n", str(ranks), sys.executable, "-m", "minimp.train", *COMMON]
    command += ["--dp", str(layout.dp), "--pp", str(layout.pp), "--zero", str(layout.zero)]
    command += ["--micro-batches", str(layout.micro_batches), "--steps", str(steps)]
    if layout.tp > 1:
        command += ["--tp", str(layout.tp)]
    return command + ["--metrics", metrics]


def measured(metrics: str, skip: int) -> dict:
    """Median step seconds after the first `skip` steps, and the scalar all-reduces of a step."""
    records = [json.loads(line) for line in open(metrics)]
    steps = [r for r in records if "compute_seconds" in r][skip:]
    seconds = [r["compute_seconds"] + r["communication_seconds"] for r in steps]
    return {"seconds": statistics.median(seconds), "scalars": steps[-1]["scalar_allreduces"]}


def compute_rate(steps: int, skip: int, folder: str) -> float:
    """FLOP/s of one process with one thread, micro-batches of ROWS rows (step 1 above)."""
    metrics = os.path.join(folder, "one.jsonl")
    command = [sys.executable, "-m", "minimp.train", *COMMON, "--threads", "1", "--steps"]
    command += [str(steps), "--micro-batches", str(BATCH // ROWS), "--metrics", metrics]
    subprocess.run(command, check=True, capture_output=True, timeout=900)
    return step_flops(SHAKESPEARE, BATCH, recompute=False) / measured(metrics, skip)["seconds"]


def check(steps: int, skip: int) -> dict:
    """The rate, then every layout's predicted and measured step (the module docstring)."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        rate = compute_rate(steps, skip, folder)
        cluster = this_machine(RANKS, rate, available_memory(), CORES)
        for layout in layouts(RANKS, trainer_has_tensor_parallelism()):
            name = f"{layout.dp}-{layout.tp}-{layout.pp}-zero{layout.zero}.jsonl"
            metrics = os.path.join(folder, name)
            command = train_command(layout, steps, metrics)
            subprocess.run(command, check=True, capture_output=True, timeout=900)
            predicted = step_time(SHAKESPEARE, cluster, JOB, layout)
            found = measured(metrics, skip)
            rows.append(
                {
                    "layout": vars(layout),
                    "predicted": predicted.total,
                    "predicted_by_part": vars(predicted),
                    "measured": found["seconds"],
                    "measured_scalar_allreduces": found["scalars"],
                    "ratio": predicted.total / found["seconds"],
                }
            )
    return {"flops_per_process": rate, "ranks": RANKS, "cores": CORES, "rows": rows}


def print_table(result: dict) -> None:
    rate, ranks, cores = result["flops_per_process"], result["ranks"], result["cores"]
    print(
        f"one process, one thread: {rate / 1e9:.2f} GFLOP/s; {ranks} ranks on {cores} cores: "
        f"{rate * min(1, cores / ranks) / 1e9:.2f} GFLOP/s each"
    )
    print("| dp | tp | pp | ZeRO | M | predicted s | compute | bubble | dp comm | tp comm "
          "| measured s | predicted / measured |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for row in result["rows"]:
        layout, parts = row["layout"], row["predicted_by_part"]
        communication = parts["data_parallel"] + parts["zero_in_step"]
        print(
            f"| {layout['dp']} | {layout['tp']} | {layout['pp']} | {layout['zero']} "
            f"| {layout['micro_batches']} | {row['predicted']:.3f} | {parts['compute']:.3f} "
            f"| {parts['bubble']:.3f} | {communication:.3f} | {parts['tensor_parallel']:.3f} "
            f"| {row['measured']:.3f} "
            f"| {row['ratio']:.2f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10, help="steps of each run")
    parser.add_argument("--skip", type=int, default=2, help="first steps left out of the median")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    if args.steps <= args.skip:
        parser.error(f"--steps {args.steps} must be more than --skip {args.skip}")
    result = check(args.steps, args.skip)
    if args.json:
        print(json.dumps(result))
    else:
        print_table(result)


if __name__ == "__main__":
    main()
