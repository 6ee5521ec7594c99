"""--timeline writes the Chrome trace-event format (what Perfetto and chrome://tracing open),
checked here against the format's rules rather than by a viewer (Perfetto's trace processor
downloads a binary at run time)."""

import json

import pytest

from minimp import distributed as dist
from minimp.train import TrainConfig, train
from minimp.parallel.trace import NAMES, read_timeline

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
