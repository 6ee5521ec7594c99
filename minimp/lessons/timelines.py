"""Pipeline timelines for lesson 7: record them with the training command, measure the bubble, and
replay a schedule with given compute times to see what the bubble would be without messages.

`measure` runs `mpirun -n P python -m minimp.train --pp P --timeline ...` (the same command
mpirun_examples/pipeline_timeline.py runs) and returns the timeline it wrote.
"""

import os
import statistics
import tempfile
from typing import Any, Callable

from minimp.lessons.checking import Failed
from minimp.lessons.processes import run_job
from minimp.parallel.dependencies import with_messages
from minimp.parallel.simulator import Costs, simulate_schedule
from minimp.parallel.trace import read_timeline

# The model mpirun_examples/pipeline_timeline.py uses: 8 hidden layers of 512, batch 256, fp32.
MODEL = ["--hidden", "512", "--layers", "8", "--batch-size", "256", "--precision", "fp32"]


def measure(stages: int, micro_batches: int, schedule: str, steps: int = 4) -> dict:
    """Train `steps` steps with --pp stages and return the --timeline trace read back as rows:
    each stage's forward and backward of every step, in seconds from the run's common origin
    (minimp.parallel.trace.read_timeline)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        run_job(stages, ["-m", "minimp.train", *MODEL, "--pp", str(stages), "--schedule", schedule,
                         "--micro-batches", str(micro_batches), "--steps", str(steps),
                         "--log-every", "100000", "--timeline", path])
        return read_timeline(path)


def steps_of(timeline: dict, skip_steps: int = 1) -> list[list[dict]]:
    """The events of each step, the first `skip_steps` (warm-up) left out."""
    by_step: dict[int, list[dict]] = {}
    for event in timeline["events"]:
        by_step.setdefault(event["step"], []).append(event)
    return [events for _, events in sorted(by_step.items())[skip_steps:]]


def bubble_of_step(events: list[dict], stages: int) -> float:
    """1 - (mean busy time of a stage) / (first forward's start to last backward's end)."""
    span = max(e["end"] for e in events) - min(e["start"] for e in events)
    busy = [sum(e["end"] - e["start"] for e in events if e["stage"] == s) for s in range(stages)]
    return 1 - statistics.mean(busy) / span


def span(timeline: dict, skip_steps: int = 1) -> float:
    """Seconds from a step's first forward to its last backward: the median over the steps."""
    return statistics.median(
        max(e["end"] for e in events) - min(e["start"] for e in events)
        for events in steps_of(timeline, skip_steps)
    )


def bubble(timeline: dict, skip_steps: int = 1) -> float:
    """The measured bubble: its median over the steps after warm-up."""
    return statistics.median(
        bubble_of_step(events, timeline["stages"]) for events in steps_of(timeline, skip_steps)
    )


def op_times(timeline: dict, op: str, skip_steps: int = 1) -> list[float]:
    """Seconds of one `op` (forward, backward, backward_input, backward_weight) of one
    micro-batch on one chunk, per stage: medians over the steps after warm-up."""
    return _medians(timeline, lambda e: e["op"] == op, skip_steps)


def compute_times(timeline: dict, skip_steps: int = 1) -> tuple[list[float], list[float]]:
    """(forward seconds, backward seconds) of one micro-batch on each stage: medians."""
    forward = _medians(timeline, lambda e: e["kind"] == "forward", skip_steps)
    return forward, _medians(timeline, lambda e: e["kind"] == "backward", skip_steps)


def _medians(timeline: dict, keep: Callable[[dict], bool], skip_steps: int) -> list[float]:
    events = [e for step in steps_of(timeline, skip_steps) for e in step if keep(e)]
    return [
        statistics.median(e["end"] - e["start"] for e in events if e["stage"] == s)
        for s in range(timeline["stages"])
    ]


def replay(schedule: list, forward: Any, backward: Any) -> tuple[float, list[float]]:
    """Run each stage's compute actions in its order, each as early as its stage is free and its
    inputs exist (F(s, m) after F(s - 1, m); B(s, m) after F(s, m) and B(s + 1, m)), with
    messages taking no time: minimp's schedule simulator (minimp/parallel/simulator.py).
    forward / backward: seconds, one number or one per stage.
    Returns (step time, busy seconds per stage); Failed says who waits if no stage can go on."""
    computes = [[a for a in actions if a.op in ("forward", "backward")] for actions in schedule]
    try:  # the messages each compute needs, at no cost: only the order of the computes counts
        step = simulate_schedule(
            with_messages(computes, len(schedule), 1), Costs(forward=forward, backward=backward)
        )
    except RuntimeError as error:
        raise Failed(str(error)) from None
    return step.span, step.busy


def replayed_bubble(schedule: list, forward: Any, backward: Any) -> float:
    """The bubble of `replay`: 1 - mean busy / step time."""
    span, busy = replay(schedule, forward, backward)
    return 1 - statistics.mean(busy) / span
