"""measure/accounts.py by value: held_bytes counts each block of memory once, in the first kind that
names it, and PeakMemory keeps the first breakdown of a tied peak."""

import numpy as np

from minimp.measure.accounts import KINDS, PeakMemory, held_bytes


def kinds(**held):
    return {kind: held.get(kind, 0) for kind in KINDS}


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
