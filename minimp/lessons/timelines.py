"""Pipeline timelines for lessons 7 and 13: record them with the training command, measure the
bubble, replay a schedule with given compute times, and simulate a run from its measured parts.

`measure` runs `mpirun -n P python -m minimp.train --pp P --timeline ...` (the same command
mpirun_examples/pipeline_timeline.py runs) and returns the timeline it wrote.
"""

import os
import statistics
import tempfile
from typing import Any, Callable

from minimp.lessons.checking import Failed
from minimp.lessons.processes import run_job
from minimp.measure.machinemodel import shipped_model
from minimp.parallel.pipeline.schedules.dependencies import with_messages
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.parallel.pipeline.simulator import (
    Costs,
    SimulatedStep,
    simulate_schedule,
    simulated_trace,
)
from minimp.measure.trace import read_timeline, timeline_of

# The model mpirun_examples/pipeline_timeline.py uses: 8 hidden layers of 512, batch 256, fp32.
HIDDEN, BATCH = 512, 256
MODEL = ["--hidden", str(HIDDEN), "--layers", "8", "--batch-size", str(BATCH), "--precision",
         "fp32"]


def measure(stages: int, micro_batches: int, schedule: str, steps: int = 4,
            virtual_stages: int = 1) -> dict:
    """Train `steps` steps with --pp stages and return the --timeline trace read back as rows:
    each stage's forward and backward of every step, in seconds from the run's common origin
    (minimp.measure.trace.read_timeline)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        run_job(stages, ["-m", "minimp.train", *MODEL, "--pp", str(stages), "--schedule", schedule,
                         "--virtual-stages", str(virtual_stages),
                         "--micro-batches", str(micro_batches), "--steps", str(steps),
                         "--log-every", "100000", "--timeline", path])
        return read_timeline(path)


def simulate_parts(timeline: dict, skip_steps: int = 1) -> SimulatedStep:
    """The schedule simulator's step, fed with this run's median seconds of each compute per
    stage (a chunk's, with interleaving) and the shipped machine model's time for one activation
    message (float32 rows of HIDDEN): a prediction of the measured span from measured parts."""
    stages, micro_batches = timeline["stages"], timeline["micro_batches"]
    chunks, name = timeline["virtual_stages"], timeline["schedule"]

    def per_chunk(op: str) -> list[float]:  # every chunk of a rank costs that rank's median
        times = op_times(timeline, op, skip_steps)
        return [times[stage % stages] for stage in range(stages * chunks)]

    if name == "zb-h1":
        b, w = per_chunk("backward_input"), per_chunk("backward_weight")
        costs = Costs(per_chunk("forward"), [x + y for x, y in zip(b, w)], 0.0, b, w)
    else:
        costs = Costs(per_chunk("forward"), per_chunk("backward"))
    costs.message = shipped_model(stages).message(BATCH // micro_batches * HIDDEN * 4)
    schedule = build_schedule(name, stages, micro_batches, chunks)
    return simulate_schedule(schedule, costs)


def simulated_timeline(step: SimulatedStep, name: str, micro_batches: int) -> dict:
    """A simulated step as the rows `read_timeline` gives (for the same Gantt chart)."""
    return timeline_of(simulated_trace(step, name, micro_batches))


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
    messages taking no time: minimp's schedule simulator (minimp/parallel/pipeline/simulator.py).
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
