"""What training tells people: progress lines, metrics (.jsonl), timings, timelines, the plot."""

import json
import os
import time
from types import ModuleType
from typing import Any, Callable

import numpy as np

from minimp.train import files


class Stopwatch:
    """Seconds spent inside wrapped calls, summed (the communication time of a step's metrics)."""

    def __init__(self) -> None:
        self.seconds = 0.0

    def wrap(self, function: Callable) -> Callable:
        def timed(*args):
            start = time.perf_counter()
            try:
                return function(*args)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


class TimedCalls:
    """Stands in for an object and adds the seconds spent in each of its method calls to a
    Stopwatch (the trainer times its GradientSync this way: that is the step's communication)."""

    def __init__(self, target: Any, stopwatch: Stopwatch):
        self._target, self._stopwatch = target, stopwatch

    def __getattr__(self, name: str) -> Any:
        return self._stopwatch.wrap(getattr(self._target, name))


class History:
    """The per-step records: kept in memory, written to --metrics, summed up in progress lines."""

    records: list[dict]

    def __init__(
        self,
        log: Callable[[str], None],
        metrics_path: str,
        resume_step: int | None,
        steps: int,
        log_every: int,
        units_per_step: int,
        unit: str = "samples",
    ):
        """resume_step: the step a resumed run continues after; the metrics file then keeps its
        rows up to that step and the new ones are appended (None: a new file). units_per_step and
        unit: what a step processes, for the rate (64 samples, or 768 tokens)."""
        self.log, self.steps, self.log_every = log, steps, log_every
        self.units_per_step, self.unit = units_per_step, unit
        if metrics_path and resume_step is not None:
            files.keep_metrics_up_to(metrics_path, resume_step)
        self.metrics = MetricsWriter(metrics_path, append=resume_step is not None)
        self.records, self.skipped = [], 0
        self.window_start, self.window_steps = time.perf_counter(), 0

    def add(self, entry: dict, loss_scale: float) -> None:
        """Keep and write one step's record; print a progress line every log_every steps (and at
        the last), with the rate and the time left at that rate."""
        self.records.append(entry)
        self.metrics.write(entry)
        self.skipped += entry["skipped"]
        self.window_steps += 1
        self.window_start += entry.get("eval_seconds", 0.0)  # the rate is the training's alone
        step = entry["step"]
        if step % self.log_every == 0 or step == self.steps or "val_loss" in entry:
            seconds_per_step = (time.perf_counter() - self.window_start) / self.window_steps
            rate = self.units_per_step / max(seconds_per_step, 1e-9)
            left = (self.steps - step) * seconds_per_step
            line = progress_line(entry, self.steps, loss_scale, self.skipped, rate, self.unit, left)
            self.log(line)
            self.window_start, self.window_steps = time.perf_counter(), 0

    def close(self, final_record: dict) -> None:
        self.metrics.write(final_record)
        self.metrics.close()


class Timeline:
    """Every forward and backward of this rank, as [step, is_backward, micro-batch, start, end]
    rows in seconds from the step's start (for --timeline)."""

    def __init__(self) -> None:
        self.rows: list[list[float]] = []

    def recorder(self, step: int, step_start: float) -> Callable[[str, int, float, float], None]:
        """The callback a PipelineStage calls after each compute action of this step."""

        def record(op, micro_batch, start, end):
            is_backward = op != "forward"
            self.rows.append([step, is_backward, micro_batch, start - step_start, end - step_start])

        return record

    def array(self) -> np.ndarray:
        return np.array(self.rows, np.float64).reshape(-1, 5)


class MetricsWriter:
    """One JSON object per line; a no-op when no path is given."""

    def __init__(self, path: str, append: bool = False):
        self.file = open(path, "a" if append else "w") if path else None

    def write(self, record: dict) -> None:
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self) -> None:
        if self.file:
            self.file.close()


def progress_line(
    entry: dict,
    steps: int,
    loss_scale: float,
    skipped_so_far: int,
    rate: float,
    unit: str,
    seconds_left: float,
) -> str:
    """`step   250/2000  loss 2.1034  val 2.1240  lr 9.7e-04  loss scale 65536  skipped 0
    9,876 tokens/s  ETA 3m05s` (val only at evaluations)."""
    validation = f"  val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
    minutes, seconds = divmod(int(round(seconds_left)), 60)
    return (
        f"step {entry['step']:>5}/{steps}  loss {entry['loss']:.4f}{validation}  "
        f"lr {entry['lr']:.1e}  loss scale {loss_scale:g}  skipped {skipped_so_far}  "
        f"{rate:,.0f} {unit}/s  ETA {minutes}m{seconds:02d}s"
    )


def require_matplotlib() -> ModuleType:
    """Import matplotlib (headless) or raise ImportError with the install command."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'minimp[lessons]'") from None
    return pyplot


def plot_formats() -> tuple[str, ...]:
    """The file extensions matplotlib can write (png, pdf, svg, ...)."""
    pyplot = require_matplotlib()
    figure = pyplot.figure()
    try:
        return tuple(sorted(figure.canvas.get_supported_filetypes()))
    finally:
        pyplot.close(figure)


def plot_history(path: str, history: list[dict]) -> None:
    """Loss (top) and loss scale on a log axis (bottom) per step; a red x marks skipped steps."""
    pyplot = require_matplotlib()
    steps = [record["step"] for record in history]
    figure, (loss_axis, scale_axis) = pyplot.subplots(2, 1, sharex=True, figsize=(8, 5))
    loss_axis.plot(steps, [record["loss"] for record in history], lw=1)
    loss_axis.set_ylabel("loss")
    scale_axis.semilogy(
        steps, [record["loss_scale"] for record in history], lw=1, drawstyle="steps-post"
    )
    skipped = [record for record in history if record["skipped"]]
    if skipped:
        scale_axis.scatter(
            [r["step"] for r in skipped],
            [r["loss_scale"] for r in skipped],
            marker="x",
            color="red",
            label="skipped step",
            zorder=3,
        )
        scale_axis.legend()
    scale_axis.set_ylabel("loss scale")
    scale_axis.set_xlabel("step")
    figure.tight_layout()
    image_format = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    files.atomic_write(path, lambda file: figure.savefig(file, dpi=100, format=image_format))
    pyplot.close(figure)


def write_timeline(
    path: str, schedule: str, stages: int, micro_batches: int, events: dict[str, np.ndarray]
) -> None:
    """One JSON file: every forward and backward of replica 0, per stage, in seconds from its
    step's start. `events` holds each stage's [step, is_backward, micro-batch, start, end] rows
    (as "stage<s>") and its peak of stored micro-batches (as "peak<s>")."""
    rows, peaks = [], {}
    for key, array in sorted(events.items()):
        if key.startswith("peak"):
            peaks[int(key[len("peak") :])] = int(array[0])
            continue
        for step, backward, mb, start, end in array.tolist():
            rows.append(
                {
                    "stage": int(key[len("stage") :]),
                    "step": int(step),
                    "micro_batch": int(mb),
                    "kind": "backward" if backward else "forward",
                    "start": start,
                    "end": end,
                }
            )
    document = {
        "schedule": schedule,
        "stages": stages,
        "micro_batches": micro_batches,
        "peak_stored_micro_batches": [peaks[s] for s in sorted(peaks)],
        "events": rows,
    }
    files.atomic_write(path, lambda file: file.write(json.dumps(document).encode()))
