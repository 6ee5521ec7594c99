"""Timelines in the Chrome trace-event format: what PyTorch's profiler writes, and what Perfetto
(https://ui.perfetto.dev, "Open trace file") and chrome://tracing open.

`--timeline run.json` (and the schedule simulator, minimp/parallel/pipeline/simulator.py) writes one
JSON object {"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}: one process per
rank ("rank 2: stage 0, replica 1"), two lanes (threads) in each, "compute" and "communication", and
one complete event ("ph": "X") per forward, backward, message and collective, named F3 / B3 / "send
activation 3" / "all-reduce gradients", with the step and the micro-batch in its args. Times are
microseconds from a common origin that every rank takes right after one barrier, so the ranks' lanes
line up (to the barrier's skew). With --experts, counter tracks ("ph": "C", drawn as a graph per
step in rank 0's process) carry each step's expert load, its max/mean and the dropped (token,
choice) pairs, the metrics' figures (`expert_counters`). `read_timeline` turns a file back into
the rows the Gantt chart of mpirun_examples/pipeline_timeline.py draws.
"""

import json
import time
from typing import Sequence

import numpy as np

from minimp.distributed.protocol import Communicator

COMPUTE, COMMUNICATION = 0, 1  # the two lanes (trace "threads") of a rank
LANES = {COMPUTE: "compute", COMMUNICATION: "communication"}  # each lane's name and category
# What each recorded op is called in the trace; its lane follows from it.
NAMES = {
    "forward": ("F{mb}", COMPUTE),
    "backward": ("B{mb}", COMPUTE),
    "backward_input": ("B{mb}", COMPUTE),
    "backward_weight": ("W{mb}", COMPUTE),
    "recv_forward": ("receive activation {mb}", COMMUNICATION),
    "send_forward": ("send activation {mb}", COMMUNICATION),
    "recv_backward": ("receive gradient {mb}", COMMUNICATION),
    "send_backward": ("send gradient {mb}", COMMUNICATION),
    "send_forward_recv_backward": ("send activation {mb}, receive gradient", COMMUNICATION),
    "send_backward_recv_forward": ("send gradient {mb}, receive activation", COMMUNICATION),
    "wait_sends": ("wait for the step's sends", COMMUNICATION),
    "finalize_backward": ("wait for gradient buckets", COMMUNICATION),
    "any_rank": ("agree on overflow", COMMUNICATION),
    "overflowed_ranks": ("find the overflowed ranks", COMMUNICATION),
    "expert_load": ("all-reduce expert load", COMMUNICATION),
    "reduce": ("all-reduce gradients", COMMUNICATION),
    "global_squared_norm": ("sum gradient norms", COMMUNICATION),
    "mean_loss": ("all-reduce loss", COMMUNICATION),
    "check_replicas": ("compare replicas", COMMUNICATION),
    "check_replicated": ("compare tensor-parallel copies", COMMUNICATION),
    "fp8_statistics": ("all-reduce fp8 statistics", COMMUNICATION),
    "fp8_amax": ("agree on fp8 amax", COMMUNICATION)}
OPS = sorted(NAMES)


class TraceRecorder:
    """This rank's events: [op, step, micro-batch, start, end] rows, seconds from the origin."""

    def __init__(self, origin: float):
        self.origin = origin
        self.rows: list[list[float]] = []

    def record(self, op: str, step: int, micro_batch: int, start: float, end: float) -> None:
        self.rows.append([OPS.index(op), step, micro_batch, start - self.origin, end - self.origin])

    def array(self) -> np.ndarray:
        return np.array(self.rows, np.float64).reshape(-1, 5)


def common_origin(comm: Communicator) -> float:
    """time.perf_counter() right after a barrier: the same moment on every rank, to the
    barrier's skew (perf_counter is the system's monotonic clock, shared by a machine's ranks)."""
    comm.barrier()
    return time.perf_counter()


def trace_events(ranks: dict[int, dict]) -> list[dict]:
    """Trace events from each rank's {"rows": array, "name": str}: metadata naming the processes
    and lanes, then one complete event per row."""
    events: list[dict] = []
    for rank, info in sorted(ranks.items()):
        events.append(_metadata("process_name", rank, 0, info["name"]))
        events.append(_metadata("process_sort_index", rank, 0, rank, key="sort_index"))
        for lane, lane_name in LANES.items():
            events.append(_metadata("thread_name", rank, lane, lane_name))
        for op, step, micro_batch, start, end in info["rows"].tolist():
            name = OPS[int(op)]
            label, lane = NAMES[name]
            events.append({
                "name": label.format(mb=int(micro_batch)), "cat": LANES[lane], "ph": "X",
                "ts": round(start * 1e6, 3), "dur": round(max(end - start, 0.0) * 1e6, 3),
                "pid": rank, "tid": lane,
                "args": {"step": int(step), "micro_batch": int(micro_batch), "op": name}})
    return events


# The mixture's counter tracks: (track name, the metrics row's key, the series in the track).
EXPERT_COUNTERS = (("expert load (pairs per expert, before dropping)", "expert_load", "expert {}"),
                   ("expert load max/mean", "expert_load_imbalance", "max/mean"),
                   ("dropped (token, choice) pairs", "dropped_tokens", "dropped"))


def expert_counters(records: list[dict], rows: np.ndarray, pid: int = 0) -> list[dict]:
    """Counter events from the metrics rows of an --experts run (records without expert_load give
    none): each step's figures at the end of that step's last event of process pid (its rows),
    where Perfetto draws the step's value until the next one."""
    ends: dict[int, float] = {}
    for _, step, _, _, end in rows.tolist():
        ends[int(step)] = max(ends.get(int(step), 0.0), end)
    events = []
    for record in records:
        if "expert_load" not in record or record.get("step") not in ends:
            continue
        for track, key, series in EXPERT_COUNTERS:
            values = record[key] if isinstance(record[key], list) else [record[key]]
            args = {series.format(i): value for i, value in enumerate(values)}
            events.append({"name": track, "ph": "C", "pid": pid, "ts":
                           round(ends[record["step"]] * 1e6, 3), "args": args})
    return events


def _metadata(kind: str, pid: int, tid: int, value: str | int, key: str = "name") -> dict:
    return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": {key: value}}


def trace_document(ranks: dict[int, dict], other: dict, counters: Sequence[dict] = ()) -> dict:
    """The whole trace as one JSON-ready object; `other` (schedule, stages, ...) goes in
    "otherData" (the training command writes it with minimp.checkpoints.files.atomic_write);
    `counters`, counter events (expert_counters') after the ranks' events."""
    return {"traceEvents": trace_events(ranks) + list(counters), "displayTimeUnit": "ms",
            "otherData": other}


def read_timeline(path: str) -> dict:
    """A trace file as {schedule, stages, micro_batches, virtual_stages, peak_stored_micro_batches,
    events}, the events being replica 0's forwards and backwards as {stage, step, micro_batch, kind,
    op, start, end} with times in seconds (what a Gantt chart of the pipeline needs); kind is
    forward or backward, op the compute's own name (a split backward's two halves apart)."""
    with open(path) as file:
        return timeline_of(json.load(file))


def timeline_of(document: dict) -> dict:
    """A trace document (trace_document's, or a file's) as read_timeline's rows."""
    other = document["otherData"]
    stage_of_rank = {int(rank): stage for rank, stage in other["stage_of_rank"].items()}
    events = []
    for event in document["traceEvents"]:
        if event["ph"] != "X" or event["cat"] != "compute":
            continue
        if event["pid"] not in other["replica_0_ranks"]:
            continue
        args = event["args"]
        events.append({
            "stage": stage_of_rank[event["pid"]], "step": args["step"],
            "micro_batch": args["micro_batch"],
            "kind": "forward" if args["op"] == "forward" else "backward",
            "op": args["op"],  # backward_input and backward_weight stay apart
            "start": event["ts"] / 1e6, "end": (event["ts"] + event["dur"]) / 1e6})
    return {"virtual_stages": 1, **other, "events": events}  # traces before interleaving: 1
