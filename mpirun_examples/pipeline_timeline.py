"""Pipeline schedules you can see: GPipe and 1F1B as Gantt charts from real timelines; the bubble.

    python mpirun_examples/pipeline_timeline.py          # P = 4, M = 8 -> pipeline_timeline.png
    python mpirun_examples/pipeline_timeline.py --stages 2 --micro-batches 4 --png two_stages.png
    python mpirun_examples/pipeline_timeline.py --sweep      # the table: P = 2, 4 and M = 1..16

It launches `mpirun -n P python -m minimp.train --pp P --timeline ...` for each
schedule, reads each stage's forward/backward times from the trace (the Chrome trace-event file
that Perfetto opens, minimp/train/trace.py), and measures the bubble of a step
as 1 - (mean busy time of a stage) / (time from the first forward to the last backward),
beside the theory (P - 1)/(M + P - 1). The model (8 hidden layers of 512) splits into
stages of nearly equal parameter count. On a 2-core machine P = 4 is oversubscribed and
waiting MPICH ranks spin, which slows the computing ones: the measured bubble is then a
property of this machine as much as of the schedule.
"""

import argparse
import os
import shutil
import subprocess
import sys
import tempfile

from minimp.costmodel import pipeline_bubble_fraction
from minimp.lessons.timelines import bubble, compute_times, span  # lesson 7's measurements
from minimp.machinemodel import shipped_model
from minimp.parallel import SCHEDULES, Costs, simulate_schedule
from minimp.parallel.trace import read_timeline

HIDDEN, BATCH = 512, 256
MODEL = [
    *("--hidden", str(HIDDEN), "--layers", "8"),
    *("--batch-size", str(BATCH), "--precision", "fp32"),
]


def simulated(timeline):
    """The schedule simulator's step, fed with this run's median forward and backward seconds per
    stage and the shipped machine model's time for one activation message (float32 rows of
    HIDDEN): a prediction of the measured span from measured parts."""
    stages, micro_batches = timeline["stages"], timeline["micro_batches"]
    forward, backward = compute_times(timeline, skip_steps=2)
    message = shipped_model(stages).message(BATCH // micro_batches * HIDDEN * 4)
    schedule = SCHEDULES[timeline["schedule"]](stages, micro_batches)
    return simulate_schedule(schedule, Costs(forward, backward, message=message))


def measure(stages, micro_batches, schedule, steps, folder):
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
            color = "#4c72b0" if e["kind"] == "forward" else "#dd8452"
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
        theory = pipeline_bubble_fraction(timeline["stages"], timeline["micro_batches"])
        axis.set_title(
            f"{timeline['schedule']}: P={timeline['stages']}, M={timeline['micro_batches']}, "
            f"bubble measured {bubble(timeline, skip_steps=2):.2f}, theory {theory:.2f}, "
            f"peak stored micro-batches per stage {timeline['peak_stored_micro_batches']}",
            fontsize=9,
        )
    axes[-1].set_xlabel("ms since the step's first forward (blue: forward, orange: backward)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--micro-batches", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--png", default="pipeline_timeline.png")
    parser.add_argument(
        "--sweep", action="store_true", help="P = 2, 4 and M = 1, 2, 4, 8, 16: print the table"
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        if not args.sweep:
            timelines = [
                measure(args.stages, args.micro_batches, s, args.steps, folder)
                for s in ("gpipe", "1f1b")
            ]
            draw(timelines, args.png)
            for timeline in timelines:
                predicted, measured = simulated(timeline).span, span(timeline, skip_steps=2)
                print(
                    f"{timeline['schedule']:>5}: "
                    f"bubble {bubble(timeline, skip_steps=2):.3f} (theory "
                    f"{pipeline_bubble_fraction(args.stages, args.micro_batches):.3f}), "
                    f"peak stored micro-batches per stage {timeline['peak_stored_micro_batches']}; "
                    f"step {measured * 1e3:.1f} ms, simulated from its parts "
                    f"{predicted * 1e3:.1f} ms ({predicted / measured - 1:+.1%})"
                )
            print(f"saved {args.png}")
            return
        print(
            f"{'P':>2} {'M':>3} {'theory':>7} {'gpipe':>7} {'1f1b':>7}   "
            "peak stored per stage (gpipe | 1f1b)"
        )
        for stages in (2, 4):
            for micro_batches in (1, 2, 4, 8, 16):
                gpipe = measure(stages, micro_batches, "gpipe", args.steps, folder)
                one = measure(stages, micro_batches, "1f1b", args.steps, folder)
                print(
                    f"{stages:>2} {micro_batches:>3} "
                    f"{pipeline_bubble_fraction(stages, micro_batches):>7.3f} "
                    f"{bubble(gpipe, skip_steps=2):>7.3f} {bubble(one, skip_steps=2):>7.3f}   "
                    f"{gpipe['peak_stored_micro_batches']} | "
                    f"{one['peak_stored_micro_batches']}"
                )


if __name__ == "__main__":
    main()
