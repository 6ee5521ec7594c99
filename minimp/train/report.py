"""What training tells people: progress lines, the metrics .jsonl file, and the loss/scale plot."""

import json


class MetricsWriter:
    """One JSON object per line; a no-op when no path is given."""

    def __init__(self, path, append=False):
        self.file = open(path, "a" if append else "w") if path else None

    def write(self, record):
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()

    def close(self):
        if self.file:
            self.file.close()


def progress_line(step, steps, loss, loss_scale, skipped_so_far, samples_per_second):
    return (
        f"step {step:>5}/{steps}  loss {loss:.4f}  loss scale {loss_scale:g}  "
        f"skipped {skipped_so_far}  {samples_per_second:,.0f} samples/s"
    )


def require_matplotlib():
    """Import matplotlib (headless) or raise ImportError with the install command."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as pyplot
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'minimp[lessons]'") from None
    return pyplot


def plot_history(path, history):
    """Loss (top) and loss scale on a log axis (bottom) per step; skipped steps marked with red
    x."""
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
    figure.savefig(path, dpi=100)
    pyplot.close(figure)
