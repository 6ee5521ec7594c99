"""What a run says as it goes: the per-step records, the --metrics file, and progress lines (or,
on a terminal a person watches, one updating bar)."""

import json
import time
from typing import Callable

from tqdm import tqdm

from minimp.checkpoints import files


class History:
    """The per-step records: kept in memory, written to --metrics, summed up in progress lines."""

    records: list[dict]

    def __init__(self, log: Callable[[str], None], metrics_path: str, resume_step: int | None,
                 steps: int, log_every: int, units_per_step: int, unit: str = "samples",
                 interactive: bool = False):
        """resume_step: the step a resumed run continues after; the metrics file then keeps its
        rows up to that step and the new ones are appended (None: a new file). units_per_step and
        unit: what a step processes, for the rate (64 samples, or 768 tokens). interactive: show
        a tqdm bar instead of progress lines (only where a person watches a terminal)."""
        self.log, self.steps, self.log_every = log, steps, log_every
        self.units_per_step, self.unit = units_per_step, unit
        if metrics_path and resume_step is not None:
            files.keep_metrics_up_to(metrics_path, resume_step)
        mode = "w" if resume_step is None else "a"
        self.metrics = open(metrics_path, mode) if metrics_path else None
        self.records, self.skipped = [], 0
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.bar = None
        if interactive:  # one updating bar on a terminal; lines for logs, pipes and mpirun
            self.bar = tqdm(total=steps, initial=resume_step or 0, unit="step", dynamic_ncols=True)

    def add(self, entry: dict, loss_scale: float) -> None:
        """Keep and write one step's record; print a progress line every log_every steps (and at
        the last), with the rate and the time left at that rate."""
        self.records.append(entry)
        self._write(entry)
        self.skipped += entry["skipped"]
        self.window_steps += 1
        self.window_start += entry.get("eval_seconds", 0.0)  # the rate is the training's alone
        step = entry["step"]
        if step % self.log_every == 0 or step == self.steps or "val_loss" in entry:
            seconds_per_step = (time.perf_counter() - self.window_start) / self.window_steps
            rate = self.units_per_step / max(seconds_per_step, 1e-9)
            left = (self.steps - step) * seconds_per_step
            line = progress_line(entry, self.steps, loss_scale, self.skipped, rate, self.unit, left)
            self._show(entry, line, rate)
            self.window_start, self.window_steps = time.perf_counter(), 0
        elif self.bar is not None:
            self.bar.update(1)

    def _show(self, entry: dict, line: str, rate: float) -> None:
        if self.bar is None:
            self.log(line)
            return
        self.bar.update(1)
        summary = f"loss {entry['loss']:.4f}, {rate:,.0f} {self.unit}/s"
        self.bar.set_postfix_str(summary, refresh=True)
        if "val_loss" in entry:  # evaluations stay on the screen above the bar
            self.bar.write(line)

    def close(self, final_record: dict) -> None:
        if self.bar is not None:
            self.bar.close()
        self._write(final_record)
        if self.metrics:
            self.metrics.close()

    def _write(self, record: dict) -> None:
        """One JSON object per line of --metrics, flushed at once (nothing without a path)."""
        if self.metrics:
            self.metrics.write(json.dumps(record) + "\n")
            self.metrics.flush()


def progress_line(entry: dict, steps: int, loss_scale: float, skipped_so_far: int, rate: float,
                  unit: str, seconds_left: float) -> str:
    """`step   250/2000  loss 2.1034  val 2.1240  lr 9.7e-04  loss scale 65536  skipped 0
    9,876 tokens/s  ETA 3m05s` (val only at evaluations)."""
    validation = f"  val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
    minutes, seconds = divmod(int(round(seconds_left)), 60)
    return (f"step {entry['step']:>5}/{steps}  loss {entry['loss']:.4f}{validation}  "
            f"lr {entry['lr']:.1e}  loss scale {loss_scale:g}  skipped {skipped_so_far}  "
            f"{rate:,.0f} {unit}/s  ETA {minutes}m{seconds:02d}s")
