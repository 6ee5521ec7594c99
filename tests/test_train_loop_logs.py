"""What the training loop says, in-process (mutation testing cannot see the subprocess runs):
its progress lines, the layout and replica-check lines on rank 0 only, the progress bar where a
person watches, the --metrics file, and the rate's units."""

import json
import re

import numpy as np
import pytest
from test_train_gpt import TINY as GPT

from minimp import distributed as dist
from minimp.checkpoints.errors import AgreedError
from minimp.train import TrainConfig, train
from minimp.parallel.replicas import ReplicaMismatchError
from minimp.train.loop import Run

MLP = dict(hidden=16, layers=1, batch_size=32)
PROGRESS = r"step +{step}/{steps}  loss \d\.\d{{4}}  lr 1\.0e-03  loss scale 65536  skipped 0  " \
    r"[\d,]+ samples/s  ETA 0m00s"  # fmt: skip


def config(world_size=1, **overrides):
    settings = TrainConfig(**{**MLP, **overrides})
    settings.validate(world_size)
    return settings


def progress(step, steps):
    return re.compile(PROGRESS.format(step=step, steps=steps))


def test_one_rank_logs_a_line_every_log_every_steps_then_the_summary():
    """No layout line and no replica check (one replica, nothing to compare) on one rank."""
    lines = []
    train(config(steps=4, log_every=2, check_replicas=1), log=lines.append)
    assert len(lines) == 3, lines
    assert progress(2, 4).fullmatch(lines[0]) and progress(4, 4).fullmatch(lines[1])
    done = r"done: 4 steps, 0 skipped, test accuracy 0\.\d{4}"  # then the summary's lines
    assert re.fullmatch(done, lines[2].splitlines()[0])


def test_rank_0_alone_logs_the_layout_and_the_replica_checks():
    def body(comm):
        lines = []
        train(config(2, steps=2, log_every=1, check_replicas=1), log=lines.append, comm=comm)
        return lines

    first, second = dist.simulate(2, body)
    layout = (
        "layout: --dp 2 x --tp 1 x --pp 1 = 2 ranks (tensor-parallel ranks adjacent, then "
        "replicas, then stages)\n  rank 0: replica 0\n  rank 1: replica 1"
    )
    said = "step {}: replicas identical (the 2 replicas' float32 masters have the same checksum)"
    assert first[:2] == [layout, said.format(1)] and first[3] == said.format(2)
    assert progress(1, 2).fullmatch(first[2]) and progress(2, 2).fullmatch(first[4])
    assert len(first) == 6 and first[5].startswith("done: 2 steps, 0 skipped, test accuracy ")
    assert second == []


def test_tensor_parallel_shards_say_their_whole_parameters_agree():
    def body(comm):
        lines = []
        settings = config(2, layers=2, tp=2, steps=1, log_every=1, check_replicas=1)
        train(settings, log=lines.append, comm=comm)
        return lines

    first, second = dist.simulate(2, body)
    assert first[1] == "step 1: the 2 shards' whole parameters agree" and len(first) == 4
    assert second == []


def test_a_run_logs_lines_unless_told_a_person_watches_one_rank():
    """interactive: one tqdm bar instead of progress lines, and only on one rank (mpirun's ranks
    share one terminal)."""
    one = dist.simulate(1, lambda comm: comm)[0]
    quiet = Run(config(steps=1), one, log=lambda line: None)
    assert quiet.history.bar is None
    watched = Run(config(steps=1), one, log=lambda line: None, interactive=True)
    assert watched.history.bar is not None
    watched.history.bar.close()

    def body(comm):
        return Run(config(2, steps=1), comm, log=lambda line: None, interactive=True).history.bar

    assert dist.simulate(2, body) == [None, None]


def test_train_passes_interactive_on_so_the_bar_replaces_the_progress_lines():
    lines = []
    train(config(steps=2, log_every=1), log=lines.append, interactive=True)
    assert len(lines) == 1 and lines[0].startswith("done: 2 steps")


@pytest.mark.parametrize(
    "overrides, units, unit",
    [(dict(batch_size=32), 32, "samples"), (GPT, 8 * 16, "tokens")],
    ids=["mlp", "gpt"],
)
def test_the_rate_counts_the_samples_or_tokens_of_a_step(overrides, units, unit):
    one = dist.simulate(1, lambda comm: comm)[0]
    settings = config(**{**overrides, "steps": 3, "log_every": 2})
    history = Run(settings, one, log=lambda line: None).history
    assert (history.units_per_step, history.unit) == (units, unit)
    assert type(history.units_per_step) is int
    assert (history.steps, history.log_every) == (3, 2)


def test_rank_0_alone_writes_the_metrics_file(tmp_path, monkeypatch):
    """Its rows are rank 0's records, to the bit (timings included), then the summary row."""
    monkeypatch.chdir(tmp_path)
    settings = config(2, steps=3, metrics="metrics.jsonl")
    first = dist.simulate(2, lambda comm: train(settings, log=lambda line: None, comm=comm))[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[:3] == json.loads(json.dumps(first["history"]))
    assert len(rows) == 4 and rows[3]["test_accuracy"] == first["test_accuracy"]


@pytest.mark.parametrize("lr", [1.0, 1e4], ids=["overflow", "invalid"])
def test_the_float_errors_of_fp16_overflow_are_silenced_inside_train(lr):
    """lr 1.0 overflows a float16 cast within 10 steps; lr 1e4 makes inf - inf (invalid). numpy
    must neither warn nor raise, whatever the caller set: the skipped steps handle both."""
    settings = TrainConfig(steps=10, lr=lr, hidden=16, layers=2, log_every=1000)
    settings.validate()
    history = []
    with np.errstate(over="raise", invalid="raise"):
        if lr == 1.0:
            history = train(settings, log=lambda line: None)["history"]
        else:  # lr 1e4 ends at a NaN loss: the run's exit 1, after every step ran unraised
            with pytest.raises(AgreedError, match="the run ended at step 10 with loss nan"):
                train(settings, log=lambda line: None)
    assert lr != 1.0 or any(r["skipped"] for r in history)


@pytest.mark.parametrize(
    "layout, said",
    [
        (dict(dp=2), "step 1: replicas identical (the 2 replicas' float32 masters and fp8 scaling "
         "state have the same checksum)"),
        (dict(tp=2), "step 1: the 2 shards' whole parameters and fp8 scaling state agree"),
    ],
    ids=["dp", "tp"],
)  # fmt: skip
def test_fp8_runs_check_their_scaling_state_with_the_masters(layout, said):
    def body(comm):
        lines = []
        settings = config(2, layers=2, precision="fp8", steps=1, check_replicas=1, **layout)
        train(settings, log=lines.append, comm=comm)
        return lines

    first, second = dist.simulate(2, body)
    assert first[1] == said and second == []


def test_the_tensor_parallel_check_compares_the_fp8_scaling_state_too():
    """Shard 1's fp8 state drifts (pretended): the shards' check refuses it on both ranks."""

    def body(comm):
        settings = config(2, layers=2, precision="fp8", steps=1, check_replicas=1, tp=2)
        run = Run(settings, comm, log=lambda line: None)
        run.step(1)
        if comm.rank == 1:
            drifted = {k: v + 1 for k, v in run.fp8.state_arrays().items()}
            run.fp8.state_arrays = lambda: drifted
        try:
            run._check_replicas(1)
        except ReplicaMismatchError as error:
            return str(error)

    said = (
        "the whole (replicated) parameters of tensor-parallel rank(s) [1] differ from rank 0's "
        "(tensor-parallel copies drifted apart)"
    )
    assert dist.simulate(2, body) == [said, said]
