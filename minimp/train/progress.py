"""What a run says as it goes: the per-step records, the --metrics file, progress lines (or, on a
terminal a person watches, one updating bar), the lines of skipped steps, and the final summary."""

import json
import time
from typing import Callable

from tqdm import tqdm

from minimp.checkpoints import files
from minimp.parallel.context.layout import ContextLayout


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
        self.records, self.skipped = [], 0
        self.window_start, self.window_steps = time.perf_counter(), 0
        self.bar = None
        if interactive:  # one updating bar on a terminal; lines for logs, pipes and mpirun
            self.bar = tqdm(total=steps, initial=resume_step or 0, unit="step", dynamic_ncols=True)
        self.metrics_path, self.write_error = metrics_path, ""
        self.metrics = None
        if metrics_path:
            try:
                if resume_step is not None:
                    files.keep_metrics_up_to(metrics_path, resume_step)
                self.metrics = open(metrics_path, "w" if resume_step is None else "a")
            except OSError as error:
                self._metrics_failed(error)

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

    def say(self, line: str) -> None:
        """A line between the progress lines (above the bar, on a terminal)."""
        if self.bar is None:
            self.log(line)
        else:
            self.bar.write(line)

    def close(self, final_record: dict) -> None:
        if self.bar is not None:
            self.bar.close()
        self._write(final_record)
        if self.metrics:
            try:
                self.metrics.close()
            except OSError as error:
                self._metrics_failed(error)

    def _write(self, record: dict) -> None:
        """One JSON object per line of --metrics, flushed at once (nothing without a path)."""
        if self.metrics:
            try:
                self.metrics.write(json.dumps(record) + "\n")
                self.metrics.flush()
            except OSError as error:
                self._metrics_failed(error)

    def _metrics_failed(self, error: OSError) -> None:
        """A full disk or a lost mount must not cost the run: say it once, write no more rows
        (write_error keeps the reason for the exit status), let the training and --save go on."""
        self.write_error = error.strerror or str(error)
        self.say(f"--metrics {self.metrics_path}: a write failed ({self.write_error}); no more "
                 "rows are written, the run and its --save go on")
        if self.metrics is not None:
            try:
                self.metrics.close()
            except OSError:
                pass  # the rows it held are lost with the write that failed
        self.metrics = None


def progress_line(entry: dict, steps: int, loss_scale: float, skipped_so_far: int, rate: float,
                  unit: str, seconds_left: float) -> str:
    """`step   250/2000  loss 2.1034  val 2.1240  lr 9.7e-04  loss scale 65536  skipped 0
    9,876 tokens/s  ETA 3m05s` (val only at evaluations)."""
    validation = f"  val {entry['val_loss']:.4f}" if "val_loss" in entry else ""
    minutes, seconds = divmod(int(round(seconds_left)), 60)
    return (f"step {entry['step']:>5}/{steps}  loss {entry['loss']:.4f}{validation}  "
            f"lr {entry['lr']:.1e}  loss scale {loss_scale:g}  skipped {skipped_so_far}  "
            f"{rate:,.0f} {unit}/s  ETA {minutes}m{seconds:02d}s")


def summary(history: History, wall_seconds: float, bytes_per_step: list[float],
            held: dict, context: ContextLayout | None = None, cp_mode: str = "ring") -> str:
    """The lines under `done: ...`: the wall time (from the run's setup to its last file) and the
    steps' own, the throughput over the steps, the skipped steps, the bytes each rank sent per
    step (the meter's bytes_sent, averaged over the steps) and the peak memory the meter
    measured (model state and activations, on the rank that held the most); with --cp (context,
    the layout) the attention work each rank measured in the last step."""
    records = history.records
    if not records:  # a resume at its last step: nothing was trained
        return f"  wall time     {_seconds(wall_seconds)}, no step to run"
    seconds = sum(r["compute_seconds"] + r["communication_seconds"] + r.get("straggler_seconds", 0)
                  for r in records)
    rate = len(records) * history.units_per_step / max(seconds, 1e-9)
    activations = max(r["peak_activation_bytes"] for r in records)
    model_state = max(held.get("peak_model_state_bytes", [0]))
    return "\n".join([
        f"  wall time     {_seconds(wall_seconds)} in all; the {len(records)} steps took "
        f"{_seconds(seconds)}",
        f"  throughput    {rate:,.0f} {history.unit}/s over the steps",
        f"  skipped       {history.skipped} of {len(records)} steps",
        f"  sent          {_bytes_by_rank(bytes_per_step)}",
        f"  peak memory   {size_text(model_state)} model state, {size_text(activations)} "
        "activations (the most any rank held)",
        *([_context_work(records[-1], context, cp_mode)] if context is not None else []),
    ])  # fmt: skip


def _context_work(record: dict, layout: ContextLayout, cp_mode: str) -> str:
    """`  attention     blocks per call by rank 4, 4: max/min 1.00 (contiguous shards: 3.00)`:
    the causal work each rank measured (parallel/context/models.py), beside what the other
    layout's formula gives the ring, or why Ulysses has none."""
    work = ", ".join(f"{blocks:g}" for blocks in record["context_work"])
    if cp_mode == "ulysses":
        other = "Ulysses: every rank all T positions of H/N heads"
    else:
        kind = "contiguous" if layout.kind == "zigzag" else "zigzag"
        ratio = ContextLayout(layout.size, kind).work_imbalance()
        other = f"{kind.replace('zigzag', 'zig-zag')} shards: {ratio:.2f}"
    return (f"  attention     blocks per call by rank {work}: max/min "
            f"{record['context_work_imbalance']:.2f} ({other})")


def _bytes_by_rank(bytes_per_step: list[float]) -> str:
    """`nothing (one rank)`, `1.2 MiB per step by each of 4 ranks`, or one figure per rank."""
    if len(bytes_per_step) <= 1:
        return "nothing (one rank)"
    shown = [size_text(sent) for sent in bytes_per_step]
    if len(set(shown)) == 1:  # a ring's chunks may differ by a few bytes: equal as shown
        return f"{shown[0]} per step by each of {len(shown)} ranks"
    return "per step: " + ", ".join(f"rank {rank} {sent}" for rank, sent in enumerate(shown))


def _seconds(seconds: float) -> str:
    """3 significant digits (`0.0123 s`, `37.4 s`), whole seconds from 100 (`1,234 s`)."""
    return f"{seconds:,.0f} s" if seconds >= 100 else f"{seconds:.3g} s"


def size_text(count: float) -> str:
    """1,536 -> `1.5 KiB`; below 1 KiB, whole bytes."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{count:.0f} B"
