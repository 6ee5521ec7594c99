"""Lesson 14's overlap, timed: a data-parallel step's backward and its gradient buckets as a
compute lane and a communication lane, with and without overlap, on any communicator.

`timed_step` runs the steps on the communicator it is given (the simulated world, or MPI's);
`python -m minimp.lessons.overlap_timeline`, under `mpirun -n 2`, times a step both ways (and
again with replica 1 late), trains the trainer's model both ways, and prints one JSON document,
`run_both_ways`'s, on rank 0 (what `measure` runs and returns).
"""

import json
import statistics
import time
from typing import Any

import numpy as np

from minimp import nn, optim
from minimp.backend import limit_cpu_threads
from minimp.parallel.data.data_parallel import DataParallel
from minimp.tensor import Tensor

# The traced MLP: 64 features, 4 hidden layers of 512, 10 classes, 128 rows per replica, fp32;
# 1 MiB buckets (float32 on the wire).
FEATURES, HIDDEN, LAYERS, CLASSES, ROWS, BUCKET_MB = 64, 512, 4, 10, 128, 1.0
# The trainer's run for the metrics: the same model, global batch 256, fp32; 20 steps, so that
# the medians of 19 steps say whether overlap exposes less on a machine other jobs share.
TRAINED: dict[str, Any] = dict(hidden=HIDDEN, layers=LAYERS, batch_size=2 * ROWS, precision="fp32",
               bucket_mb=BUCKET_MB, steps=20, log_every=10**6, straggler_barrier=True)
LATE_SECONDS = 0.02  # how late replica 1 starts its step in the straggler's run


class TracedDataParallel(DataParallel):
    """DataParallel that notes when each bucket is packed (its ring starts) and unpacked (its
    ring is done): `marks`, (what, bucket, seconds) rows."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.marks: list[tuple[str, int, float]] = []
        super().__init__(*args, **kwargs)

    def _pack(self, bucket: int, gradients: list) -> tuple[Any, Any]:
        self.marks.append(("start", bucket, time.perf_counter()))
        return super()._pack(bucket, gradients)

    def _unpack(self, bucket: int, gradients: list) -> None:
        super()._unpack(bucket, gradients)
        self.marks.append(("done", bucket, time.perf_counter()))


def mlp(rng: np.random.Generator) -> nn.Module:
    layers: list[nn.Module] = [nn.Linear(FEATURES, HIDDEN, rng=rng), nn.ReLU()]
    for _ in range(LAYERS - 1):
        layers += [nn.Linear(HIDDEN, HIDDEN, rng=rng), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, CLASSES, rng=rng))


def plan() -> tuple[list[tuple[list[int], int]], list[int]]:
    """(DataParallel's buckets for the traced MLP, [(parameter indices, elements)] in the order
    they start; the elements of each parameter)."""
    from minimp.distributed import simulate

    def buckets(comm: Any) -> tuple[list, list[int]]:
        optimizer = optim.SGD(mlp(np.random.default_rng(0)).parameters(), lr=0.1)
        sizes = [parameter.data.size for parameter in optimizer.params]
        return DataParallel(comm, optimizer, bucket_mb=BUCKET_MB).buckets, sizes

    return simulate(1, buckets)[0]


def timed_step(comm: Any, overlap: bool, late: float = 0.0, steps: int = 2) -> dict:
    """The last of `steps` steps (forward, backward, all-reduce; no update) on this rank, times in
    seconds from its start: {"compute": [(label, start, end)], "communication": [...],
    "backward_end", "end", "hooks": parameter indices in the order backward finished them}.
    Communication rows: each bucket from its start to its end ("bucket b") and the work done
    inside the parameters' hooks ("hook"). late: replica 1 sleeps this long before its forward."""
    model = mlp(np.random.default_rng(0))
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    marks: list[tuple[str, int, float]] = []
    for index, parameter in enumerate(optimizer.params):  # before DataParallel's hooks ...
        parameter.register_post_accumulate_grad_hook(
            lambda p, i=index: marks.append(("arrive", i, time.perf_counter())))
    sync = TracedDataParallel(comm, optimizer, bucket_mb=BUCKET_MB, overlap=overlap)
    for index, parameter in enumerate(optimizer.params):  # ... and after them
        parameter.register_post_accumulate_grad_hook(
            lambda p, i=index: marks.append(("leave", i, time.perf_counter())))
    x = Tensor(np.random.default_rng(1 + comm.rank).standard_normal((ROWS, FEATURES))
               .astype(np.float32))
    for _ in range(steps):
        marks.clear()
        sync.marks.clear()
        optimizer.zero_grad()
        comm.barrier()  # the replicas start together (to the barrier's skew)
        if late and comm.rank == 1:
            time.sleep(late)
        start = time.perf_counter()
        loss = model(x).sum()
        forward_end = time.perf_counter()
        loss.backward()
        backward_end = time.perf_counter()
        sync.after_backward()
        sync.reduce(optimizer.master_gradients)
        end = time.perf_counter()
    return _lanes(marks, sync.marks, start, forward_end, backward_end, end)


def _lanes(hooks: list, buckets: list, start: float, forward_end: float, backward_end: float,
           end: float) -> dict:
    """timed_step's rows from the marks: backward's compute is what lies between the hooks."""
    compute = [("forward", 0.0, forward_end - start)]
    communication = []
    last = forward_end
    for (_, index, arrive), (_, _, leave) in zip(hooks[0::2], hooks[1::2]):
        compute.append(("backward", last - start, arrive - start))
        communication.append(("hook", arrive - start, leave - start))
        last = leave
    compute.append(("backward", last - start, backward_end - start))
    started = {bucket: t for what, bucket, t in buckets if what == "start"}
    for what, bucket, t in buckets:
        if what == "done":
            communication.append((f"bucket {bucket}", started[bucket] - start, t - start))
    return {"compute": compute, "communication": communication,
            "backward_end": backward_end - start, "end": end - start,
            "hooks": [index for _, index, _ in hooks[0::2]]}


def bucket_events(timeline: dict) -> list[tuple[str, str]]:
    """For each bucket, in plan order, (where its ring started, where it ended): "in the hook of
    parameter i" or "after backward", from a timed step's rows."""
    hooks = [row for row in timeline["communication"] if row[0] == "hook"]

    def where(seconds: float) -> str:
        for index, (_, start, end) in zip(timeline["hooks"], hooks):
            if start <= seconds <= end:
                return f"in the hook of parameter {index}"
        return "after backward" if seconds >= timeline["backward_end"] else "during backward"

    rows = [row for row in timeline["communication"] if row[0].startswith("bucket")]
    rows.sort(key=lambda row: int(row[0].split()[1]))
    return [(where(start), where(end)) for _, start, end in rows]


def trained(comm: Any, overlap: bool) -> tuple[dict, dict]:
    """The trainer's metrics, medians over the steps after the first, and its float32 masters."""
    from minimp.train import TrainConfig, train  # the lessons' helpers need not load the trainer

    config = TrainConfig(**TRAINED, overlap=overlap)
    config.validate(comm.size)
    result = train(config, log=lambda line: None, comm=comm)
    fields = ("compute_seconds", "communication_seconds", "exposed_communication_seconds",
              "straggler_seconds")
    history = result["history"][1:]
    medians = {field: statistics.median(r[field] for r in history) for field in fields}
    return medians, result["master_weights"]


def run_both_ways(comm: Any) -> dict:
    """Everything the lesson shows, as one JSON-ready dict (on every rank)."""
    result: dict[str, Any] = {"timeline": {}, "late": {}, "metrics": {}}
    for overlap, mode in ((True, "overlap"), (False, "no_overlap")):
        result["timeline"][mode] = timed_step(comm, overlap)
        result["late"][mode] = timed_step(comm, overlap, late=LATE_SECONDS)
    weights = {}
    for overlap, mode in ((True, "overlap"), (False, "no_overlap")):
        result["metrics"][mode], weights[mode] = trained(comm, overlap)
    result["identical"] = sorted(weights["overlap"]) == sorted(weights["no_overlap"]) and all(
        array.tobytes() == weights["no_overlap"][name].tobytes()
        for name, array in weights["overlap"].items())
    return result


def measure() -> dict:
    """`mpirun -n 2 python -m minimp.lessons.overlap_timeline`, read back."""
    from minimp.lessons.processes import run_job

    return json.loads(run_job(2, ["-m", "minimp.lessons.overlap_timeline"]))


def lanes(timelines: list[dict], titles: list[str]) -> None:
    """Each timed step as two lanes: compute (forward blue, backward orange) and communication
    (each bucket's ring from start to end, green, a thin row each; the hooks' work dark); a red
    line at backward's end, after which communication is exposed."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(len(timelines), 1, figsize=(11, 1.0 + 1.2 * len(timelines)),
                                sharex=True, squeeze=False)
    colors = {"forward": "#4c72b0", "backward": "#dd8452", "hook": "#333333"}
    for axis, timeline, title in zip(axes[:, 0], timelines, titles):
        for lane, rows in enumerate((timeline["compute"], timeline["communication"])):
            for label, start, end in rows:
                if label.startswith("bucket"):  # a thin row of its own per bucket, 0 on top
                    bucket = int(label.split()[1])
                    row, height, color = lane - 0.35 + 0.11 * bucket, 0.09, "#55a868"
                    axis.text(start * 1e3, row, label.split()[1] + " ", fontsize=6,
                              va="center", ha="right")
                else:
                    row, height, color = lane, 0.8, colors[label]
                axis.barh(row, (end - start) * 1e3, left=start * 1e3, height=height,
                          color=color, edgecolor="black", linewidth=0.3)
        axis.axvline(timeline["backward_end"] * 1e3, color="red", linewidth=0.8)
        axis.set_yticks([0, 1])
        axis.set_yticklabels(["compute", "communication"])
        axis.invert_yaxis()
        axis.set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("ms since the step's start (red: backward's end; green: each bucket's "
                           "ring from start to end, bucket 0 on top; dark: work in the hooks)")
    figure.tight_layout()
    plt.show()


if __name__ == "__main__":
    from minimp.distributed import world

    communicator = world()
    with limit_cpu_threads(1):  # a core per rank, as the trainer's default on 2 cores
        document = run_both_ways(communicator)
    if communicator.rank == 0:
        print(json.dumps(document))
