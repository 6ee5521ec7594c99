"""Calibration: the sizes it measures, and the terms it measures, on the simulated world."""

import pytest

from minimp.distributed.calibrate import (
    PRETENDED_RANKS,
    calibrate,
    calibration_sizes,
    repeats_for,
)
from minimp.distributed.simulated import simulate


def test_calibration_sizes_bracket_the_range_and_skip_every_power_of_two():
    sizes = calibration_sizes(1024, 64 * 2**20)
    assert sizes[0] <= 1024 < sizes[1] and sizes[-2] < 64 * 2**20 <= sizes[-1]
    assert all(b == 2 * a for a, b in zip(sizes, sizes[1:]))
    assert all(n % 4 == 0 and n & (n - 1) != 0 for n in sizes)


def test_small_sizes_are_timed_at_least_fifty_times():
    assert repeats_for(4096) >= 50 and repeats_for(2**20) >= 50 and repeats_for(2**26) >= 7


@pytest.mark.parametrize("ranks", [2, 3])
def test_calibrate_measures_every_term_on_every_rank_alike(ranks):
    sizes = calibration_sizes(1024, 16384)
    results = simulate(ranks, lambda comm: calibrate(comm, sizes))
    for model, terms in results:
        assert model.ranks == ranks and terms["sizes"] == sizes
        assert len(terms["message"]) == len(terms["reduce"]) == len(sizes)
        assert terms["agree"] > 0 and all(t > 0 for t in terms["message"] + terms["reduce"])
        for name, seconds in terms["python"].items():
            assert len(seconds) == len(PRETENDED_RANKS) and min(seconds) > 0, name
        assert model.ring_allreduce(4096) > model.agree
    # each time is the slowest rank's, agreed by all-reduce: every rank holds the same numbers
    assert all(terms == results[0][1] for _, terms in results)
