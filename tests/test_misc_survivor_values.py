"""Values a few small helpers promise, pinned where mutation testing found nothing checking them:
the wire's refusal message, held_bytes counting each block of memory once, PeakMemory keeping the
first sample of a tied peak, and a run without --timeline keeping no trace."""

import re

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.distributed.protocol import contiguous_for_wire
from minimp.parallel.zero_accounts import KINDS, PeakMemory, held_bytes
from minimp.train import TrainConfig
from minimp.train.loop import Run


def kinds(**held):
    return {kind: held.get(kind, 0) for kind in KINDS}


# ----- contiguous_for_wire ---------------------------------------------------------------------
def test_the_wire_refuses_a_strided_array_with_the_whole_message():
    """The message names the fix and the array's shape and strides, and nothing else."""
    strided = np.zeros(8, np.float32)[::2]
    with pytest.raises(ValueError) as caught:
        contiguous_for_wire(strided)
    assert str(caught.value) == (
        "communication needs a C-contiguous array (use numpy.ascontiguousarray); "
        "got one of shape (4,) with strides (8,)"
    )


def test_the_wire_hands_back_a_contiguous_array_itself():
    array = np.zeros((2, 3), np.float32)
    assert contiguous_for_wire(array) is array


# ----- held_bytes ------------------------------------------------------------------------------
def test_held_bytes_counts_an_array_named_twice_once():
    """The same array twice in one kind is one block of memory."""
    a = np.zeros(10, np.float32)
    assert held_bytes({"parameters": [a, a]}) == kinds(parameters=40)


def test_held_bytes_counts_a_view_once_with_its_base_in_the_first_kind_naming_it():
    """A float32 model's compute copy is (a view of) its master: counted as parameters only."""
    master = np.zeros(6, np.float32)
    assert held_bytes({"parameters": [master[:3]], "masters": [master]}) == kinds(parameters=24)


def test_held_bytes_goes_on_past_a_missing_or_repeated_array_in_a_kind():
    """None (a gradient not yet made) and an array already counted are skipped, and the arrays
    after them in the same kind still count."""
    a, b, c = np.zeros(2, np.float64), np.zeros(3, np.float32), np.zeros(5, np.float16)
    held = held_bytes({"gradients": [None, a], "optimizer_state": [b, b, c]})
    assert held == kinds(gradients=16, optimizer_state=22)


def test_held_bytes_counts_two_distinct_arrays_of_one_kind_both():
    a, b = np.zeros(4, np.float32), np.zeros(4, np.float32)
    assert held_bytes({"buffers": [a, b], "gathered": [b]}) == kinds(buffers=32)


# ----- PeakMemory ------------------------------------------------------------------------------
def test_peak_memory_keeps_the_first_breakdown_of_a_tied_total():
    """Only a larger total replaces the peak: a later sample of the same total, split otherwise,
    leaves the first sample's kinds."""
    peak = PeakMemory()
    peak.sample(kinds(parameters=5))
    peak.sample(kinds(gathered=5))
    assert (peak.total, peak.by_kind) == (5, kinds(parameters=5))
    peak.sample(kinds(gathered=6))
    assert (peak.total, peak.by_kind) == (6, kinds(gathered=6))


def test_peak_memory_of_empty_samples_stays_zero_of_every_kind():
    peak = PeakMemory()
    peak.sample({})
    assert (peak.total, peak.by_kind) == (0, kinds())


# ----- Run: --timeline -------------------------------------------------------------------------
TINY = dict(hidden=16, layers=1, batch_size=32, lr=0.01, log_every=1000)


def one_rank():
    return dist.simulate(1, lambda comm: comm)[0]


def test_a_run_without_timeline_keeps_no_trace_and_hears_no_communication():
    config = TrainConfig(steps=1, **TINY)
    config.validate()
    run = Run(config, one_rank(), log=lambda line: None)
    assert run.trace is None
    assert run.communication.listener is None
    assert run._timeline_recorder(1) is None


def test_a_run_with_timeline_records_its_communication(tmp_path):
    config = TrainConfig(steps=1, timeline=str(tmp_path / "trace.json"), **TINY)
    config.validate()
    run = Run(config, one_rank(), log=lambda line: None)
    assert run.trace is not None
    assert re.search("_record_communication", repr(run.communication.listener))
    assert callable(run._timeline_recorder(1))
