"""The --plot figure of a run: its losses, loss scale, rate, communication and fp8 scales."""

import os
from types import ModuleType
from typing import Any

from minimp.checkpoints import files
from minimp.checkpoints.files import PLOT_FORMATS


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
    """The image formats --plot writes: those matplotlib can write whose files say matplotlib
    drew them (files.PLOT_FORMATS: a rerun may replace its own plot, never another image)."""
    pyplot = require_matplotlib()
    figure = pyplot.figure()
    try:
        return tuple(sorted(set(figure.canvas.get_supported_filetypes()) & set(PLOT_FORMATS)))
    finally:
        pyplot.close(figure)


def plot_history(path: str, history: list[dict], units_per_step: int = 0, unit: str = "") -> None:
    """history_figure() written to path (the format from its extension), atomically."""
    pyplot = require_matplotlib()
    figure = history_figure(history, units_per_step, unit)
    image_format = os.path.splitext(path)[1].lstrip(".").lower() or "png"
    files.atomic_write(path, lambda file: figure.savefig(file, dpi=100, format=image_format))
    pyplot.close(figure)


def history_figure(history: list[dict], units_per_step: int = 0, unit: str = "") -> Any:
    """What a reader of a run looks at, per step: the training loss and the validation loss
    (where evaluated); the loss scale on a log axis, a red x on each skipped step; the rate
    (units_per_step `unit` per second of compute and communication); when the run
    communicated, the share of each step spent in communication; and in an fp8 run, the scales of
    the watched tensors with the fractions of their values that underflowed or saturated."""
    pyplot = require_matplotlib()
    steps = [record["step"] for record in history]
    communicated = any(record["communication_seconds"] > 0 for record in history)
    fp8_run = any("fp8" in record for record in history)
    panels = 3 + communicated + fp8_run
    figure, axes = pyplot.subplots(panels, 1, sharex=True, figsize=(8, 2.2 * panels))
    axes[0].plot(steps, [record["loss"] for record in history], lw=1, label="training")
    evaluated = [record for record in history if "val_loss" in record]
    if evaluated:
        axes[0].plot([r["step"] for r in evaluated], [r["val_loss"] for r in evaluated], "o-",
                     label="validation")  # fmt: skip
        axes[0].legend()
    axes[0].set_ylabel("loss")
    _draw_loss_scale(axes[1], history)
    seconds = [r["compute_seconds"] + r["communication_seconds"] for r in history]
    axes[2].plot(steps, [units_per_step / max(s, 1e-9) for s in seconds], lw=1)
    axes[2].set_ylabel(f"{unit}/s" if unit else "steps x units/s")
    if communicated:
        share = [r["communication_seconds"] / max(s, 1e-9) for r, s in zip(history, seconds)]
        axes[3].plot(steps, share, lw=1)
        axes[3].set_ylabel("communication\nshare of step")
        axes[3].set_ylim(0, 1)
    if fp8_run:
        _draw_fp8(axes[-1], history)
    axes[-1].set_xlabel("step")
    figure.tight_layout()
    return figure


def _draw_loss_scale(axis: Any, history: list[dict]) -> None:
    steps = [record["step"] for record in history]
    axis.semilogy(steps, [r["loss_scale"] for r in history], lw=1, drawstyle="steps-post")
    skipped = [record for record in history if record["skipped"]]
    if skipped:
        axis.scatter([r["step"] for r in skipped], [r["loss_scale"] for r in skipped],
                     marker="x", color="red", label="skipped step", zorder=3)  # fmt: skip
        axis.legend()
    axis.set_ylabel("loss scale")


def _draw_fp8(axis: Any, history: list[dict]) -> None:
    """Each watched tensor's scale (solid, log axis on the left) and the fraction of its values
    that underflowed to zero (dashed) or saturated (dotted, where any did) on the right."""
    records = [record for record in history if "fp8" in record]
    steps = [record["step"] for record in records]
    fractions = axis.twinx()
    for index, name in enumerate(records[0]["fp8"]):
        color = f"C{index}"
        series = [record["fp8"][name] for record in records]
        axis.semilogy(steps, [s["scale"] for s in series], lw=1, color=color, label=name)
        fractions.plot(steps, [s["underflow"] for s in series], "--", lw=1, color=color)
        if any(s["saturated"] for s in series):
            fractions.plot(steps, [s["saturated"] for s in series], ":", lw=1, color=color)
    axis.set_ylabel("fp8 scale")
    fractions.set_ylabel("underflowed (--)\nsaturated (:)")
    fractions.set_ylim(0, 1)
    axis.legend(fontsize=6, ncol=2, loc="lower right")
