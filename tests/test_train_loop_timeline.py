"""A training run without --timeline keeps no trace and hears no communication; with it, it
records the communication on its timeline."""

import re

from minimp import distributed as dist
from minimp.train import TrainConfig
from minimp.train.loop import Run


TINY = dict(hidden=16, layers=1, batch_size=32, lr=0.01, log_every=1000)


def one_rank():
    return dist.simulate(1, lambda comm: comm)[0]


def test_a_run_without_timeline_keeps_no_trace_and_hears_no_communication():
    config = TrainConfig(steps=1, **TINY)
    config.validate()
    run = Run(config, one_rank(), log=lambda line: None)
    assert run.meter.trace is None
    assert run.meter.stopwatch.listener is None
    assert run.meter.recorder() is None


def test_a_run_with_timeline_records_its_communication(tmp_path):
    config = TrainConfig(steps=1, timeline=str(tmp_path / "trace.json"), **TINY)
    config.validate()
    run = Run(config, one_rank(), log=lambda line: None)
    assert run.meter.trace is not None
    assert re.search("_record_communication", repr(run.meter.stopwatch.listener))
    assert callable(run.meter.recorder())
