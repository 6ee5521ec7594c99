"""The lessons' figures, so a notebook cell reads as the idea and not as matplotlib: each function
draws one figure and shows it (inline in a notebook; nothing under a non-interactive backend)."""

import math
from typing import Any, Callable, Mapping, Sequence

import matplotlib.pyplot as plt
import matplotlib.ticker as ticker
import ml_dtypes
import numpy as np

# float16's smallest subnormal, smallest normal and largest number, as log2 of the magnitude
FLOAT16_LINES = ((-24, "2^-24"), (-14, "2^-14"), (math.log2(65504), "65504"))


def number_line(formats: dict[str, Any], points: int = 400,
                xlim: tuple[float, float] | None = None) -> None:
    """The gap to the next representable number against the magnitude, for each format over its
    whole range: from its smallest subnormal to its largest finite number (dots at both ends);
    `xlim` shows only the magnitudes between its two ends."""
    figure, axis = plt.subplots(figsize=(8, 4))
    for name, dtype in formats.items():
        info = ml_dtypes.finfo(dtype)
        low, high = float(info.smallest_subnormal), float(info.max)
        values = np.unique(np.logspace(math.log10(low), math.log10(high), points).astype(dtype))
        values = values[(values > 0) & np.isfinite(values)]
        # The largest number has no next one: give it the gap of its binade.
        below_top = np.spacing(np.nextafter(values, np.array(0, dtype)))
        with np.errstate(over="ignore"):  # np.spacing(largest) overflows to inf
            gaps = np.where(values == info.max, below_top, np.spacing(values))
        line = axis.loglog(values.astype(np.float64), gaps.astype(np.float64), label=name)[0]
        ends = [0, -1]
        axis.plot(values[ends].astype(np.float64), gaps[ends].astype(np.float64), "o",
                  color=line.get_color())
    if xlim:
        axis.set_xlim(*xlim)
    axis.set_xlabel("magnitude")
    axis.set_ylabel("gap to the next number (ulp)")
    axis.set_title("spacing of representable numbers, each format over its whole range")
    axis.legend()
    plt.show()


def central_differences(steps: np.ndarray, errors: np.ndarray,
                        models: dict[str, np.ndarray]) -> None:
    """|central difference - exact derivative| against the step h, with the model lines."""
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.loglog(steps, errors, "o-", label="measured error")
    for (label, values), style in zip(models.items(), ("--", ":")):
        axis.loglog(steps, values, style, label=label)
    axis.set_ylim(bottom=float(np.min(errors)) / 100)  # the models' far ends are not the point
    axis.set_xlabel("step h")
    axis.set_ylabel("|error| of (f(x+h) - f(x-h)) / 2h")
    axis.legend()
    plt.show()


def lines(series: dict[str, Sequence[float]], xlabel: str, ylabel: str, title: str = "",
          styles: dict[str, dict] | None = None, logy: bool = False, first: int = 0) -> None:
    """One line per named series, over its index (steps, updates) counted from `first`."""
    figure, axis = plt.subplots(figsize=(8, 3.5))
    for name, values in series.items():
        x = np.arange(first, first + len(values))
        (axis.semilogy if logy else axis.plot)(x, values, label=name,
                                               **(styles or {}).get(name, {}))
    axis.set_xlabel(xlabel)
    axis.set_ylabel(ylabel)
    if title:
        axis.set_title(title)
    axis.legend(fontsize=8)
    plt.show()


def fp16_range_histograms(panels: list[tuple[str, dict[str, np.ndarray]]]) -> None:
    """Histograms of log2 |value|, one panel each, against float16's range; the range's lines are
    labelled above the top panel, off the bars."""
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels) + 0.6),
                                sharex=True, squeeze=False)
    bins = np.arange(-50, 20, 1.0)
    for axis, (title, histograms) in zip(axes[:, 0], panels):
        for label, values in histograms.items():
            axis.hist(np.log2(values), bins=bins, alpha=0.6, label=label)
        for number, (x, _) in enumerate(FLOAT16_LINES):
            label = "float16: smallest subnormal, normal, largest" if number == 0 else None
            axis.axvline(x, color="red", ls="--", lw=1, label=label)
        axis.set_title(title, fontsize=9, loc="left", pad=14)
        axis.set_ylabel("count")
        axis.legend(loc="upper left", fontsize=8)
    top = axes[0, 0]
    for x, text in FLOAT16_LINES:
        top.text(x, 1.03, text, transform=top.get_xaxis_transform(), ha="center", fontsize=8,
                 color="red")
    axes[-1, 0].set_xlabel("log2 |activation gradient|")
    figure.tight_layout()
    plt.show()


def fp16_range_grid(panels: dict[str, dict[str, np.ndarray]], xlabel: str,
                    marks: dict[str, tuple[float, str]] | None = None) -> None:
    """Histograms of log2 |value| (zeros left out), a panel per title and a colour per label
    (the layers), two panels a row, against float16's range (smallest subnormal, smallest
    normal, largest); `marks` adds a labelled line (a value, not its log2) to a panel."""
    drawn = {title: [(x, text, "red") for x, text in FLOAT16_LINES] for title in panels}
    for title, (value, text) in (marks or {}).items():
        drawn[title].append((math.log2(value), text, "purple"))
    range_grid(panels, xlabel, drawn, np.arange(-50, 20, 1.0))


def range_grid(panels: dict[str, dict[str, np.ndarray]], xlabel: str,
               lines: dict[str, list[tuple[float, str, str]]], bins: np.ndarray,
               staggered: bool = False) -> None:
    """Histograms of log2 |value| (zeros left out), a panel per title and a colour per label,
    two panels a row; `lines[title]` draws labelled vertical lines (log2 x, text, colour), their
    labels on two levels when `staggered` (for lines close together)."""
    rows = math.ceil(len(panels) / 2)
    figure, axes = plt.subplots(rows, 2, figsize=(11, 2.3 * rows + 0.4), squeeze=False)
    for axis, (title, histograms) in zip(axes.ravel(), panels.items()):
        for label, values in histograms.items():
            magnitudes = np.abs(values[values != 0]).astype(np.float64)
            counts, _ = np.histogram(np.log2(magnitudes), bins)  # one patch, not a bar per bin
            axis.stairs(counts, bins, fill=True, alpha=0.6, label=label)
        marks = sorted(lines.get(title, []))
        for number, (x, text, color) in enumerate(marks):
            axis.axvline(x, color=color, ls="--", lw=1)
            height = 1.02 + 0.09 * (number % 2 if staggered else 0)  # neighbours on two levels
            axis.text(x, height, text, transform=axis.get_xaxis_transform(), ha="center",
                      fontsize=7, color=color)
        axis.set_xlim(bins[0], bins[-1])
        axis.set_title(title, fontsize=9, loc="left", pad=22 if staggered else 12)
        axis.legend(loc="upper left", fontsize=7)
    for axis in axes.ravel()[len(panels):]:
        axis.axis("off")
    for axis in axes.ravel()[-2:]:
        axis.set_xlabel(xlabel)
    figure.tight_layout()
    plt.show()


def _divided(top: float) -> Callable[[Any], Any]:
    """x -> top / x and back (its own inverse); matplotlib probes it at 0, which gives inf."""

    def divide(x: Any) -> Any:
        with np.errstate(divide="ignore"):
            return top / np.asarray(x, np.float64)

    return divide


def amax_traces(panels: dict[str, dict[str, np.ndarray]], maxima: dict[str, float],
                marked: dict[str, np.ndarray], marked_label: str) -> None:
    """A panel per tensor over the steps (from 1, log axis): the first series as dots, the others
    as lines that hold their value for the step, a red x on the dots where `marked` is True; the
    right axis reads an amax a as the scale maxima[title] / a. The y range is the dots' range
    (times 4 either way): a series far outside it leaves the panel."""
    figure, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.4), squeeze=False)
    for axis, (title, series) in zip(axes[0], panels.items()):
        for number, (label, values) in enumerate(series.items()):
            steps = np.arange(1, len(values) + 1)
            if number == 0:
                axis.plot(steps, values, ".", ms=3, color="black", label=label)
                hit = np.asarray(marked[title], bool)
                axis.scatter(steps[hit], np.asarray(values)[hit], marker="x", color="red",
                             zorder=3, label=marked_label)
                axis.set_ylim(np.min(values) / 4, np.max(values) * 4)
            else:
                axis.plot(steps, values, drawstyle="steps-mid", lw=1.2, label=label)
        axis.set_yscale("log", base=2)
        right = axis.secondary_yaxis("right", functions=(_divided(maxima[title]),) * 2)
        right.yaxis.set_major_locator(ticker.LogLocator(base=2))
        right.yaxis.set_major_formatter(ticker.LogFormatterSciNotation(base=2))
        right.yaxis.set_minor_locator(ticker.NullLocator())
        right.set_ylabel(f"scale = {maxima[title]:g} / amax", fontsize=8)
        axis.set_title(title, fontsize=9, loc="left")
        axis.set_xlabel("step")
    axes[0, 0].set_ylabel("amax")
    axes[0, 0].legend(fontsize=7)
    figure.tight_layout()
    plt.show()


def loss_scale_trace(history: list[dict]) -> None:
    """The loss scale each step used (log axis), a red x on every skipped step."""
    figure, axis = plt.subplots(figsize=(8, 3))
    steps = [r["step"] for r in history]
    axis.plot(steps, [r["loss_scale"] for r in history], drawstyle="steps-post")
    axis.set_yscale("log", base=2)
    skipped = [r for r in history if r["skipped"]]
    axis.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped], color="red",
                 marker="x", label="skipped step", zorder=3)
    axis.set_xlabel("step")
    axis.set_ylabel("loss scale used")
    axis.legend()
    plt.show()


def ring_steps(trace: list, p: int, chunk_sent: Callable[[int, int, int], int]) -> None:
    """One small ring per step of a traced all-reduce: an arrow per message, labelled with the
    chunk it carries (chunk_sent(rank, step, p))."""
    angles = [math.pi / 2 - 2 * math.pi * r / p for r in range(p)]
    positions = [(math.cos(a), math.sin(a)) for a in angles]
    steps = sorted({m.step for m in trace})
    figure, axes = plt.subplots(1, len(steps), figsize=(3 * len(steps), 3), squeeze=False)
    for axis, step in zip(axes[0], steps):
        for rank, (x, y) in enumerate(positions):
            axis.add_patch(plt.Circle((x, y), 0.22, color="#4c72b0"))
            axis.text(x, y, f"r{rank}", color="white", ha="center", va="center")
        for message in (m for m in trace if m.step == step):
            (x0, y0), (x1, y1) = positions[message.source], positions[message.dest]
            axis.annotate("", xy=(x0 + 0.7 * (x1 - x0), y0 + 0.7 * (y1 - y0)),
                          xytext=(x0 + 0.3 * (x1 - x0), y0 + 0.3 * (y1 - y0)),
                          arrowprops=dict(arrowstyle="->", lw=1.5))
            axis.text((x0 + x1) / 2 * 1.25, (y0 + y1) / 2 * 1.25,
                      f"c{chunk_sent(message.source, step, p)}", ha="center", fontsize=9)
        half = "reduce-scatter" if step < p - 1 else "all-gather"
        axis.set_title(f"{half} step {step % (p - 1)}", fontsize=9)
        axis.set_xlim(-1.6, 1.6)
        axis.set_ylim(-1.6, 1.6)
        axis.set_aspect("equal")
        axis.axis("off")
    plt.show()


def memory_bars(measured: dict[tuple[int, int], dict[str, int]],
                formula: dict[tuple[int, int], int], kinds: Sequence[str]) -> None:
    """Bytes one rank holds, a bar per (N, stage) stacked by kind and grouped by N, with a black
    tick at the formula's total over each bar."""
    figure, axis = plt.subplots(figsize=(9, 4))
    keys = sorted(measured)
    # A gap between the groups of N: bar k of group g sits at g * (stages + 1) + k.
    groups = sorted({n for n, _ in keys})
    stages = max(stage for _, stage in keys) + 1
    positions = [groups.index(n) * (stages + 1) + stage for n, stage in keys]
    bottom = np.zeros(len(keys))
    for kind in kinds:
        heights = np.array([measured[key][kind] for key in keys]) / 1e6
        axis.bar(positions, heights, bottom=bottom, label=kind.replace("_", " "))
        bottom += heights
    axis.scatter(positions, [formula[key] / 1e6 for key in keys], marker="_", s=400,
                 color="black", zorder=3, label="formula (total)")
    axis.set_xticks(positions)
    axis.set_xticklabels([str(stage) for _, stage in keys])
    for index, n in enumerate(groups):  # the group's name under its stage numbers
        axis.text(index * (stages + 1) + (stages - 1) / 2, -0.13, f"N = {n}", ha="center",
                  transform=axis.get_xaxis_transform())
    axis.set_xlabel("ZeRO stage, on N ranks", labelpad=18)
    axis.set_ylabel("MB held by rank 0 (1e6 bytes)")
    axis.set_title("held at the end of a step, by kind: measured (bars) and formula (ticks)")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # off the bars
    figure.tight_layout()
    plt.show()


GANTT_COLORS = {"forward": "#4c72b0", "backward_weight": "#55a868"}  # backwards: orange


def gantt(timelines: list[dict], titles: list[str], unit: str = "ms") -> None:
    """Each timeline's last step as a Gantt chart: a row per stage, forwards blue, backwards
    orange (a split backward's W green), each bar numbered with its micro-batch."""
    stages = timelines[0]["stages"]
    height = 0.9 + 0.7 * stages * len(timelines)  # room for every panel's title and rows
    figure, axes = plt.subplots(len(timelines), 1, figsize=(11, height), sharex=True,
                                squeeze=False)
    for axis, timeline, title in zip(axes[:, 0], timelines, titles):
        last = max(e["step"] for e in timeline["events"])
        events = [e for e in timeline["events"] if e["step"] == last]
        origin = min(e["start"] for e in events)
        for e in events:
            scale = 1e3 if unit == "ms" else 1.0  # "ms": seconds measured; else the costs' unit
            start, width = (e["start"] - origin) * scale, (e["end"] - e["start"]) * scale
            axis.barh(e["stage"], width, left=start, edgecolor="black", linewidth=0.4,
                      color=GANTT_COLORS.get(e["op"], "#dd8452"))
            axis.text(start + width / 2, e["stage"], str(e["micro_batch"]), ha="center",
                      va="center", fontsize=7, color="white")
        axis.set_yticks(range(stages))
        axis.set_yticklabels([f"stage {s}" for s in range(stages)])
        axis.invert_yaxis()
        axis.set_title(title, fontsize=9)
    split = any(e["op"] == "backward_weight" for t in timelines for e in t["events"])
    axes[-1, 0].set_xlabel(unit + " since the step's first forward (blue: forward, orange: "
                           + ("backward; a split one's B orange, W green)" if split
                              else "backward)"))
    figure.tight_layout()
    plt.show()


def grouped_bars(groups: Mapping[str, Sequence[float]], tick: str, ylabel: str,
                 title: str) -> None:
    """A group of bars per item (ticks "`tick` 0", "`tick` 1", ...), a bar in it per series."""
    figure, axis = plt.subplots(figsize=(7, 3))
    names = list(groups)
    items = len(groups[names[0]])
    width = 0.8 / len(names)
    for index, name in enumerate(names):
        axis.bar(np.arange(items) + index * width, groups[name], width, label=name)
    axis.set_xticks(np.arange(items) + width * (len(names) - 1) / 2)
    axis.set_xticklabels([f"{tick} {item}" for item in range(items)])
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend()
    figure.tight_layout()
    plt.show()


def causal_work_bars(work: dict[str, Sequence[float]]) -> None:
    """Lesson 16: each rank's causal work (blocks of the chunk grid), a group of bars per layout."""
    grouped_bars(work, "rank", "blocks computed",
                 "causal attention's work per rank (a diagonal block counts 1/2)")


def expert_load_bars(loads: dict[str, Sequence[int]]) -> None:
    """Lesson 17: the (token, choice) pairs routed to each expert, a group of bars per run."""
    grouped_bars(loads, "expert", "pairs routed (before dropping)",
                 "the load of each expert at the last step (both blocks)")
