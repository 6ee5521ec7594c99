"""Pipeline schedules you can see: GPipe, 1F1B, interleaved 1F1B and ZB-H1 as Gantt charts from
real timelines; the bubble measured, its formula, and the step simulated from measured parts.

    python mpirun_examples/pipeline_timeline.py      # P = 2 or 4 (the cores), M = 8 -> a .png
    python mpirun_examples/pipeline_timeline.py --stages 4 --micro-batches 4 --png four_stages.png
    python mpirun_examples/pipeline_timeline.py --sweep      # the table: P = 2, 4 and M = 1..16

It launches `mpirun -n P python -m minimp.train --pp P --schedule S --timeline ...` for each
schedule (interleaved with --virtual-stages 2), reads each stage's forward/backward times from the
trace (the Chrome trace-event file that Perfetto opens, minimp/measure/trace.py), and measures the
bubble of a step as 1 - (mean busy time of a stage) / (time from the first forward to the last
backward), beside the formula of minimp.parallel.pipeline.schedules (with a backward twice a
forward). The model (8 hidden layers of 512) splits into stages of nearly equal parameter count. The
schedule simulator (minimp/parallel/pipeline/simulator.py), fed with the run's median times of each
compute per stage and the shipped machine model's time for one activation message, predicts the
measured step.

The default number of stages P is what this machine can show: 4 where 4 cores are free to this
process, else 2. With more ranks than cores the ranks take turns on the cores, and waiting MPICH
ranks spin, which slows the computing ones: the measured bubble then grows far past the formula's,
a property of the machine more than of the schedule. Other jobs busy on the same cores do the
same. `--stages` still chooses P.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from minimp.backend import available_cores
from minimp.checkpoints.errors import ConfigError
from minimp.checkpoints.files import PLOT_FORMATS, atomic_write, check_output
from minimp.lessons.timelines import (  # lesson 7's measurements and model
    BATCH,
    HIDDEN,
    bubble,
    simulate_parts,
    span,
)
from minimp.parallel.pipeline.schedules import CHOICES, schedule_problem
from minimp.measure.trace import read_timeline

MODEL = [
    *("--hidden", str(HIDDEN), "--layers", "8"),
    *("--batch-size", str(BATCH), "--precision", "fp32"),
]
WARM_UP = 2  # steps left out of every measurement: the first ones pay for imports and allocation
SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved", 2), ("zb-h1", 1)]  # (name, chunks)
COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "backward_input": "#dd8452"}
COLORS["backward_weight"] = "#55a868"


def simulated(timeline):
    """The step simulated from this run's measured parts (lesson 7's helpers)."""
    return simulate_parts(timeline, skip_steps=WARM_UP)


def formula(timeline):
    stages, micro_batches = timeline["stages"], timeline["micro_batches"]
    choice = CHOICES[timeline["schedule"]]
    return choice.bubble(stages, micro_batches, timeline["virtual_stages"])


def measure(stages, micro_batches, schedule, steps, folder, chunks=1):
    path = os.path.join(folder, f"{schedule}-{stages}-{micro_batches}.json")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    subprocess.run(
        [
            mpirun,
            "-n",
            str(stages),
            sys.executable,
            "-m",
            "minimp.train",
            *MODEL,
            "--pp",
            str(stages),
            "--schedule",
            schedule,
            "--virtual-stages",
            str(chunks),
            "--micro-batches",
            str(micro_batches),
            "--steps",
            str(steps),
            "--log-every",
            "100000",
            "--timeline",
            path,
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return read_timeline(path)


def draw(timelines, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    figure, axes = pyplot.subplots(
        len(timelines), 1, figsize=(11, 1.2 + 0.6 * timelines[0]["stages"] * 2), sharex=True
    )
    for axis, timeline in zip(axes, timelines):
        last_step = max(e["step"] for e in timeline["events"])
        events = [e for e in timeline["events"] if e["step"] == last_step]
        origin = min(e["start"] for e in events)
        for e in events:
            color = COLORS[e["op"]]
            axis.barh(
                e["stage"],
                (e["end"] - e["start"]) * 1e3,
                left=(e["start"] - origin) * 1e3,
                color=color,
                edgecolor="black",
                linewidth=0.4,
            )
            axis.text(
                (e["start"] + e["end"] - 2 * origin) / 2 * 1e3,
                e["stage"],
                str(e["micro_batch"]),
                ha="center",
                va="center",
                fontsize=7,
                color="white",
            )
        axis.set_yticks(range(timeline["stages"]))
        axis.set_yticklabels([f"stage {s}" for s in range(timeline["stages"])])
        axis.invert_yaxis()
        axis.set_title(
            f"{timeline['schedule']}: P={timeline['stages']}, M={timeline['micro_batches']}, "
            f"V={timeline['virtual_stages']}, bubble measured "
            f"{bubble(timeline, skip_steps=WARM_UP):.2f}, formula {formula(timeline):.2f}, "
            f"peak stored micro-batches per stage {timeline['peak_stored_micro_batches']}",
            fontsize=9,
        )
    axes[-1].set_xlabel(
        "ms since the step's first forward (blue: forward, orange: backward, split into B and "
        "W, green, in zb-h1)"
    )
    figure.tight_layout()
    image_format = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    atomic_write(path, lambda file: figure.savefig(file, dpi=110, format=image_format))


def default_stages(cores):
    """4 stages where 4 cores are free, else 2: one core per rank, or the bubble measured is the
    machine's (ranks taking turns on a core) more than the schedule's; a pipeline needs 2."""
    return 4 if cores >= 4 else 2


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cores = available_cores()
    parser.add_argument(
        "--stages", type=int, default=default_stages(cores),
        help=f"pipeline stages P, one rank each (default: {default_stages(cores)}, for the "
        f"{cores} cores here: 4 where 4 cores are free, else 2; more ranks than cores take turns "
        "on them and the measured bubble becomes the machine's, not the schedule's)",
    )  # fmt: skip
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="at least 3: 2 warm up")
    parser.add_argument("--png", default="pipeline_timeline.png")
    parser.add_argument(
        "--sweep", action="store_true", help="P = 2, 4 and M = 1, 2, 4, 8, 16: print the table"
    )
    args = parser.parse_args(argv)
    if args.steps < WARM_UP + 1:
        parser.exit(2, f"{parser.prog}: error: --steps {args.steps}: the first {WARM_UP} steps "
                       f"warm up, so at least {WARM_UP + 1} are needed to measure one\n")
    try:  # before minutes of measuring: the image can be written and replaces no other kind
        check_output("--png", args.png, "plot", force=None, suffixes=PLOT_FORMATS)
    except ConfigError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    with tempfile.TemporaryDirectory() as folder:
        if args.sweep:
            return sweep(args.steps, folder)
        timelines = [
            measure(args.stages, args.micro_batches, name, args.steps, folder, chunks)
            for name, chunks in SCHEDULES
            if not schedule_problem(name, args.stages, args.micro_batches, chunks)
        ]
        draw(timelines, args.png)
        for timeline in timelines:
            predicted, measured = simulated(timeline).span, span(timeline, skip_steps=WARM_UP)
            print(
                f"{timeline['schedule']:>11}: bubble {bubble(timeline, skip_steps=WARM_UP):.3f} "
                f"(formula {formula(timeline):.3f}), peak stored micro-batches per stage "
                f"{timeline['peak_stored_micro_batches']}; step {measured * 1e3:.1f} ms, "
                f"simulated from its parts {predicted * 1e3:.1f} ms "
                f"({predicted / measured - 1:+.1%})"
            )
        print(f"saved {args.png}")


def sweep(steps, folder):
    """Per P and M, each schedule's measured bubble / its formula, and the simulated step's error
    against the measured one ('-' where the schedule cannot run those sizes)."""
    print(f"{'P':>2} {'M':>3}  " + "  ".join(f"{name:>19}" for name, _ in SCHEDULES))
    print(f"{'':>7}" + "  ".join(f"{'bubble/formula sim':>19}" for _ in SCHEDULES))
    for stages in (2, 4):
        for micro_batches in (1, 2, 4, 8, 16):
            cells = []
            for name, chunks in SCHEDULES:
                if schedule_problem(name, stages, micro_batches, chunks):
                    cells.append(f"{'-':>19}")
                    continue
                timeline = measure(stages, micro_batches, name, steps, folder, chunks)
                error = simulated(timeline).span / span(timeline, skip_steps=WARM_UP) - 1
                measured = bubble(timeline, skip_steps=WARM_UP)
                cells.append(f"{measured:.3f}/{formula(timeline):.3f} {error:+6.1%}")
            print(f"{stages:>2} {micro_batches:>3}  " + "  ".join(cells))


if __name__ == "__main__":
    main()
