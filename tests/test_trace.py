"""--timeline writes the Chrome trace-event format (what Perfetto and chrome://tracing open),
checked here against the format's rules rather than by a viewer (Perfetto's trace processor
downloads a binary at run time)."""

import json

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.train import TrainConfig, train
from minimp.measure.trace import (
    NAMES, OPS, TraceRecorder, read_timeline, timeline_of, trace_document, trace_events,
)  # fmt: skip

REQUIRED = {"X": {"name", "ph", "ts", "dur", "pid", "tid"}, "M": {"name", "ph", "pid", "args"}}


def traced(tmp_path, world_size, **flags):
    path = tmp_path / "trace.json"
    config = TrainConfig(
        hidden=32, layers=3, batch_size=32, steps=3, precision="fp32", log_every=1000,
        timeline=str(path), **flags,
    )  # fmt: skip
    config.validate(world_size)
    dist.simulate(world_size, lambda comm: train(config, log=lambda line: None, comm=comm))
    return json.loads(path.read_text()), path


@pytest.mark.parametrize("layout", [dict(pp=2, micro_batches=4), dict(dp=2, pp=2, micro_batches=2)])
def test_the_trace_follows_the_trace_event_format(tmp_path, layout):
    ranks = layout.get("dp", 1) * layout["pp"]
    document, _ = traced(tmp_path, ranks, **layout)
    events = document["traceEvents"]
    assert document["displayTimeUnit"] == "ms"
    for event in events:
        assert REQUIRED[event["ph"]] <= set(event), event  # only complete and metadata events
        if event["ph"] == "X":
            assert event["dur"] >= 0 and event["ts"] >= 0
            assert event["cat"] in ("compute", "communication") and event["tid"] in (0, 1)
    names = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert sorted(names) == list(range(ranks))  # one process per rank, each named
    assert names[ranks - 1].startswith(f"rank {ranks - 1}: stage")
    lanes = {}
    for event in (e for e in events if e["ph"] == "X"):
        lanes.setdefault((event["pid"], event["tid"]), []).append(event)
    for lane in lanes.values():  # the events of one lane never overlap
        lane.sort(key=lambda e: e["ts"])
        for earlier, later in zip(lane, lane[1:]):
            assert earlier["ts"] + earlier["dur"] <= later["ts"] + 1e-3, (earlier, later)
    computes = [e for e in events if e.get("cat") == "compute"]
    assert {e["name"][0] for e in computes} == {"F", "B"}
    assert all({"step", "micro_batch"} <= set(e["args"]) for e in computes)
    communication = {e["name"] for e in events if e.get("cat") == "communication"}
    expected = {
        "send activation 0", "wait for gradient buckets", "agree on overflow", "all-reduce loss",
    }  # fmt: skip
    assert expected <= communication


def test_the_gantt_rows_come_back_from_the_same_file(tmp_path):
    _, path = traced(tmp_path, 2, pp=2, micro_batches=4, schedule="gpipe")
    timeline = read_timeline(str(path))
    assert (timeline["schedule"], timeline["stages"], timeline["micro_batches"]) == ("gpipe", 2, 4)
    assert timeline["peak_stored_micro_batches"] == [4, 4]
    assert len(timeline["events"]) == 3 * 2 * 4 * 2  # steps x stages x micro-batches x F/B


def test_a_steps_own_communication_belongs_to_no_micro_batch(tmp_path):
    # what the sync does once per step (all-reduce, overflow agreement, ...) is recorded with
    # micro-batch -1; only a pipeline's sends and receives carry a micro-batch number
    document, _ = traced(tmp_path, 2, dp=2)
    per_step = {op for op, (label, _) in NAMES.items() if "{mb}" not in label}
    events = [e for e in document["traceEvents"] if e["ph"] == "X" and e["args"]["op"] in per_step]
    assert {e["name"] for e in events} >= {"all-reduce gradients", "agree on overflow"}
    assert {e["args"]["micro_batch"] for e in events} == {-1}


def test_the_recorder_keeps_float64_seconds_from_its_origin():
    recorder = TraceRecorder(origin=100)
    assert recorder.array().shape == (0, 5)  # no event yet: still five columns
    recorder.record("forward", 2, 1, 101, 103)
    assert recorder.array().dtype == np.float64  # integers in, float64 out
    recorder.record("reduce", 2, -1, 103.5, 104.25)
    rows = recorder.array()
    assert rows.tolist() == [
        [OPS.index("forward"), 2, 1, 1.0, 3.0], [OPS.index("reduce"), 2, -1, 3.5, 4.25],
    ]  # fmt: skip


def pinned_ranks():
    """Two ranks, given out of order, with times that need all three decimals of a microsecond."""
    forward, reduce = OPS.index("forward"), OPS.index("reduce")
    return {
        1: {"rows": np.array([[reduce, 0, -1, 0.0012345678, 0.0013580245]]), "name": "rank 1"},
        0: {"rows": np.array([[forward, 3, 2, 0.0012345678, 0.001]]), "name": "rank 0"},
    }


def test_trace_events_pins_every_field():
    def metadata(kind, pid, tid, args):
        return {"name": kind, "ph": "M", "pid": pid, "tid": tid, "args": args}

    expected = []
    for rank in (0, 1):  # sorted by rank, whatever the dict's order
        expected += [
            metadata("process_name", rank, 0, {"name": f"rank {rank}"}),
            metadata("process_sort_index", rank, 0, {"sort_index": rank}),
            metadata("thread_name", rank, 0, {"name": "compute"}),
            metadata("thread_name", rank, 1, {"name": "communication"}),
        ]
        if rank == 0:  # 1234.5678 us rounds to the nanosecond; a negative duration is 0
            expected.append({
                "name": "F2", "cat": "compute", "ph": "X", "ts": 1234.568, "dur": 0.0,
                "pid": 0, "tid": 0, "args": {"step": 3, "micro_batch": 2, "op": "forward"},
            })  # fmt: skip
        else:  # 1358.0245 - 1234.5678 us = 123.4567 us
            expected.append({
                "name": "all-reduce gradients", "cat": "communication", "ph": "X",
                "ts": 1234.568, "dur": 123.457, "pid": 1, "tid": 1,
                "args": {"step": 0, "micro_batch": -1, "op": "reduce"},
            })  # fmt: skip
    assert trace_events(pinned_ranks()) == expected


def test_timeline_of_pins_every_field():
    forward, backward = OPS.index("forward"), OPS.index("backward_weight")
    ranks = {
        0: {"rows": np.array([[forward, 1, 0, 0.25, 0.5]]), "name": "rank 0"},
        1: {"rows": np.array([[backward, 2, 3, 0.75, 1.5]]), "name": "rank 1"},
        2: {"rows": np.array([[forward, 1, 0, 0.25, 0.5]]), "name": "rank 2"},  # replica 1
    }
    other = {"schedule": "gpipe", "stage_of_rank": {"0": 0, "1": 1, "2": 0},
             "replica_0_ranks": [0, 1]}  # fmt: skip
    timeline = timeline_of(trace_document(ranks, other))
    assert timeline == {
        "virtual_stages": 1, **other,
        "events": [
            {"stage": 0, "step": 1, "micro_batch": 0, "kind": "forward", "op": "forward",
             "start": 0.25, "end": 0.5},
            {"stage": 1, "step": 2, "micro_batch": 3, "kind": "backward", "op": "backward_weight",
             "start": 0.75, "end": 1.5},
        ],
    }  # fmt: skip


def test_every_event_of_a_traced_run_carries_its_step(tmp_path):
    """Compute and communication alike: steps 1, 2, 3 of the run, nothing else."""
    document, _ = traced(tmp_path, 2, pp=2, micro_batches=2)
    events = [e for e in document["traceEvents"] if e["ph"] == "X"]
    for lane in ("compute", "communication"):
        assert {e["args"]["step"] for e in events if e["cat"] == lane} == {1, 2, 3}


@pytest.mark.parametrize(
    "flags, names",
    [
        (dict(precision="fp8"), {"all-reduce fp8 statistics", "agree on fp8 amax"}),
        (dict(tp=2, layers=4, check_replicas=1), {"compare tensor-parallel copies"}),
    ],
    ids=["fp8", "tp-check-replicas"],
)
def test_every_collective_the_loop_times_has_a_name_in_the_trace(tmp_path, flags, names):
    """fp8's agreements and tensor parallelism's replica check are timed like the others: a
    --timeline run with them writes them (it once stopped with "'fp8_amax' is not in list")."""
    path = tmp_path / "trace.json"
    config = TrainConfig(**dict(dict(hidden=32, layers=3, batch_size=32, steps=2, log_every=1000,
                                     timeline=str(path)), **flags))  # fmt: skip
    config.validate(flags.get("tp", 1))
    dist.simulate(flags.get("tp", 1), lambda comm: train(config, log=lambda line: None, comm=comm))
    events = json.loads(path.read_text())["traceEvents"]
    assert names <= {e["name"] for e in events if e.get("cat") == "communication"}


def test_every_named_collective_of_the_trainer_has_a_trace_name():
    """A meter.timed(..., "name") call whose name the trace does not know stops the run at its
    first such call with --timeline ("expert_load" and "overflowed_ranks" once did): every name the
    package passes is one of NAMES."""
    import pathlib
    import re
    package = pathlib.Path(__file__).parents[1] / "minimp"
    names = {name for path in package.rglob("*.py")
             for name in re.findall(r"timed\([^()]*?,\s*\"(\w+)\"\)", path.read_text())}
    assert {"expert_load", "overflowed_ranks", "mean_loss"} <= names  # the scan finds them
    assert names - set(NAMES) == set()


def test_an_expert_run_draws_its_load_and_drops_as_counters_per_step(tmp_path):
    """With --experts, counter tracks carry each step's metrics: the load per expert, max/mean,
    the dropped pairs (Perfetto draws a "C" event as a graph), at the end of the step's events."""
    path = tmp_path / "trace.json"
    config = TrainConfig(dataset="shakespeare", layers=1, hidden=16, heads=2, context=8,
                         batch_size=4, steps=2, eval_every=0, log_every=1000, experts=4,
                         capacity_factor=1.0, timeline=str(path))
    config.validate(2)
    result = dist.simulate(2, lambda comm: train(config, log=lambda line: None, comm=comm))[0]
    events = json.loads(path.read_text())["traceEvents"]
    counters = [event for event in events if event["ph"] == "C"]
    assert len(counters) == 3 * 2  # three tracks, two steps
    rows = [row for row in result["history"] if "step" in row]
    for step, row in enumerate(rows):
        load, ratio, dropped = counters[3 * step : 3 * step + 3]
        assert list(load["args"].values()) == row["expert_load"]
        assert ratio["args"] == {"max/mean": row["expert_load_imbalance"]}
        assert dropped["args"] == {"dropped": row["dropped_tokens"]}
        last = max(e["ts"] + e["dur"] for e in events
                   if e["ph"] == "X" and e["pid"] == 0 and e["args"]["step"] == row["step"])
        assert load["ts"] == pytest.approx(last, abs=1e-3) and load["pid"] == 0
