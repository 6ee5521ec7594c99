"""Who holds what: bytes per rank by kind for ZeRO stages 0-3 at N = 1, 2, 4, measured against the
formulas, the bytes a step sends, the paper's 7.5B-parameter example, and recomputation's trade.

    python mpirun_examples/zero_memory.py     # launches mpirun itself, about 20 s on 2 quiet cores
    python mpirun_examples/zero_memory.py --ranks 1 2 --steps 3 --rounds 1 --json

1. For each stage and N it runs `mpirun -n N python -m minimp.train --zero S` (an MLP of 8 hidden
   layers of 256, fp16, Adam) and reads the metrics: the final row's bytes held by every rank, by
   kind, at the end of the last step (and the peak inside a step), and every step's bytes sent by
   collective and time. Beside them, minimp/parallel/zero/formulas.py's formulas for the same rank.
2. The formulas for a 7.5B-parameter model: ZeRO's (section 5.1 of the paper: 120 GB replicated,
   31.4 / 16.6 / 1.9 GB at N = 64) and minimp's (float32 gradient accumulators), N = 8, 64, 1,024.
3. A GPT on one process with and without --recompute: the bytes kept for backward against the
   formula (each block's 34 sbh + 5 as^2 b becomes one input, 2 sbh), and the time of forward and
   backward (recomputation reruns every block's forward inside backward).
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from minimp import distributed as dist
from minimp.models import block_activation_bytes
from minimp.measure.trace import OPS
from minimp.measure.accounts import KINDS
from minimp.parallel.zero.formulas import (
    bytes_sent_formula,
    memory_formula,
    paper_per_parameter,
    peak_formula,
    per_parameter,
)
from minimp.train import TrainConfig
from minimp.train.loop import Run
from minimp.train.sizes import zero_unit_sizes

MLP = ["--hidden", "256", "--layers", "8", "--batch-size", "64"]
UNITS = zero_unit_sizes(TrainConfig(hidden=256, layers=8))[0]  # one stage: its layers' sizes


def run_zero(ranks: int, stage: int, steps: int, folder: str) -> dict:
    """One mpirun: every rank's bytes by kind (measured and formula), bytes sent, step time."""
    metrics = os.path.join(folder, f"zero{stage}-{ranks}.jsonl")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    command = [mpirun, "-n", str(ranks), sys.executable, "-m", "minimp.train", *MLP]
    command += ["--zero", str(stage), "--steps", str(steps), "--log-every", "100000"]
    # The formulas' (and the paper's) peaks are those without overlap: in stage 0 every 16-bit
    # gradient alive at the end of backward (overlap frees each one as backward completes it), in
    # stages 1-3 one send and one receive buffer (overlap gives each ring in flight its own pair).
    command += ["--no-overlap"]
    subprocess.run([*command, "--metrics", metrics], check=True, capture_output=True, timeout=600)
    records = [json.loads(line) for line in open(metrics)]
    final, steps_run = records[-1], records[1:-1]  # the first step creates Adam's slots
    common = dict(world_size=ranks, compute_bytes=2, wire_bytes=4)
    formulas = [
        memory_formula(stage, unit_sizes=UNITS, rank=rank, slots=2, **common)
        for rank in range(ranks)
    ]
    sizes = [sum(UNITS)] if stage == 0 else UNITS
    sent = bytes_sent_formula(stage, sizes=sizes, rank=0, micro_batches=1, **common)
    return {
        "stage": stage,
        "ranks": ranks,
        "measured": final["model_state_by_kind"],
        "formula": formulas,
        "peak": final["peak_model_state_bytes"],
        "peak_formula": sum(formulas[0].values()) + peak_formula(
            stage, unit_sizes=UNITS, compute_bytes=2
        ),
        "largest_difference": max(
            abs(measured[kind] - formula[kind])
            for measured, formula in zip(final["model_state_by_kind"], formulas)
            for kind in KINDS
        ),
        "bytes_sent": statistics.median(r["bytes_sent"] for r in steps_run),
        "bytes_sent_formula": sum(sent.values()),
        "step_ms": 1e3 * statistics.median(
            r["compute_seconds"] + r["communication_seconds"] for r in steps_run
        ),
    }


def predictions(parameters: float = 7.5e9) -> list[dict]:
    """GB per rank (1e9 bytes, as the paper) by stage: the paper's formula and minimp's."""
    return [
        {
            "ranks": n,
            "paper": [paper_per_parameter(stage, n) * parameters / 1e9 for stage in range(4)],
            "minimp": [per_parameter(stage, n) * parameters / 1e9 for stage in range(4)],
        }
        for n in (8, 64, 1024)
    ]


def recompute_trade(steps: int, rounds: int = 3) -> dict:
    """A small GPT (4 blocks of width 128, context 64, batch 12, fp16, dropout 0.1), one process
    and one BLAS thread: bytes kept for backward, and the median forward and backward times of
    a micro-batch, the runs without and with recomputation alternated `rounds` times (another
    process on the machine slows whichever runs while it does)."""
    times: dict[bool, list] = {False: [], True: []}
    kept = {}
    for _ in range(rounds):
        for recompute in (False, True):
            config = TrainConfig(
                dataset="shakespeare", precision="fp16", dropout=0.1, steps=steps, threads=1,
                recompute=recompute, timeline="unused.json", log_every=100000,
            )  # fmt: skip
            kept[recompute], forward, backward = dist.simulate(1, _timed_steps, config)[0]
            times[recompute].append((forward, backward))
    s, b, h, a, layers = 64, 12, 128, 4, 4
    block = block_activation_bytes(s, b, h, a, np.float16, dropout=True)
    plain, again = np.median(times[False], axis=0), np.median(times[True], axis=0)
    return {
        "kept_plain": kept[False],
        "kept_recompute": kept[True],
        "kept_recompute_formula": kept[False] - layers * (block - 2 * s * b * h),
        "forward_ms": 1e3 * plain[0],
        "backward_ms": 1e3 * plain[1],
        "forward_recompute_ms": 1e3 * again[0],
        "backward_recompute_ms": 1e3 * again[1],
    }


def _timed_steps(comm, config) -> tuple[int, float, float]:
    """(bytes kept for backward, median forward and backward seconds after the first step)."""
    run = Run(config, comm, log=lambda line: None)
    for step in range(1, config.steps + 1):
        run.step(step)
    rows = run.meter.trace.array()  # op, step, micro-batch, start, end (measure/trace.py)
    later = rows[rows[:, 1] > 1]
    seconds = later[:, 4] - later[:, 3]
    forward = float(np.median(seconds[later[:, 0] == OPS.index("forward")]))
    backward = float(np.median(seconds[later[:, 0] == OPS.index("backward")]))
    return run.history.records[-1]["peak_activation_bytes"], forward, backward


def print_tables(rows: list[dict], scale: list[dict], trade: dict) -> None:
    print(f"MLP {' '.join(MLP)}: {sum(UNITS):,} parameters, fp16, Adam, fp32 gradient wire")
    print("bytes held by rank 0 at the end of a step, by kind (measured = formula to the byte;")
    print("'diff' is the largest difference over every rank and kind)")
    header = "".join(f"{kind[:12]:>13}" for kind in KINDS[:-1])
    print(
        f"{'stage':>5} {'N':>2}{header} {'total':>11} {'formula':>11} {'diff':>5} {'peak':>11} "
        f"{'formula':>11} {'sent/step':>11} {'formula':>11} {'step ms':>8}"
    )
    for r in rows:
        kinds = "".join(f"{r['measured'][0][kind]:>13,}" for kind in KINDS[:-1])
        print(
            f"{r['stage']:>5} {r['ranks']:>2}{kinds} {sum(r['measured'][0].values()):>11,} "
            f"{sum(r['formula'][0].values()):>11,} {r['largest_difference']:>5} "
            f"{r['peak'][0]:>11,} {r['peak_formula']:>11,} {r['bytes_sent']:>11,.0f} "
            f"{r['bytes_sent_formula']:>11,} {r['step_ms']:>8.1f}"
        )
    print("\n7.5B parameters, GB per rank (1e9 bytes), stages 0 / 1 / 2 / 3")
    for row in scale:
        paper = " / ".join(f"{g:.1f}" for g in row["paper"])
        ours = " / ".join(f"{g:.1f}" for g in row["minimp"])
        print(f"N = {row['ranks']:>5}: ZeRO's paper {paper}   minimp {ours}")
    print("\nrecomputation, GPT 4 x 128, context 64, batch 12, fp16, dropout 0.1, one process")
    print(
        f"kept for backward: {trade['kept_plain']:,} bytes without, {trade['kept_recompute']:,} "
        f"with (formula {trade['kept_recompute_formula']:,})"
    )
    extra = trade["backward_recompute_ms"] - trade["backward_ms"]
    print(
        f"without: forward {trade['forward_ms']:.1f} ms, backward {trade['backward_ms']:.1f} ms; "
        f"with: forward {trade['forward_recompute_ms']:.1f} ms (no graph), backward "
        f"{trade['backward_recompute_ms']:.1f} ms = {extra / trade['forward_ms']:.2f} forwards more"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3, help="recomputation timings, alternated")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        rows = [
            run_zero(ranks, stage, args.steps, folder)
            for ranks in args.ranks
            for stage in range(4)
        ]
    scale, trade = predictions(), recompute_trade(args.steps, args.rounds)
    if args.json:
        print(json.dumps({"rows": rows, "scale": scale, "recompute": trade}))
        return
    print_tables(rows, scale, trade)


if __name__ == "__main__":
    main()
