"""The cost model: formulas at their limits, the algorithm switch, bus bandwidth, and fitting."""

import numpy as np
import pytest

from minimp.measure import costmodel
from minimp.measure.costmodel import Network

NET = Network(alpha=1e-5, beta=1e-9, gamma=5e-10)


def test_one_rank_costs_nothing_for_bandwidth_optimal_algorithms():
    assert costmodel.ring_allreduce_time(1e6, 1, NET) == 0.0


def test_ring_bandwidth_term_tends_to_twice_the_message():
    big = 1e9
    for p in (2, 64, 4096):
        time = costmodel.ring_allreduce_time(big, p, Network(alpha=0.0, beta=1e-9))
        assert time == pytest.approx(2 * (p - 1) / p * big * 1e-9)


def test_small_messages_prefer_recursive_doubling_and_large_ones_the_ring():
    assert (
        costmodel.fastest_allreduce(8, 64, NET, ("ring", "recursive_doubling"))
        == "recursive_doubling"
    )
    assert costmodel.fastest_allreduce(1e9, 64, NET, ("ring", "recursive_doubling")) == "ring"


def test_rabenseifner_beats_ring_latency_at_scale():
    assert costmodel.rabenseifner_allreduce_time(1e6, 4096, NET) < costmodel.ring_allreduce_time(
        1e6, 4096, NET
    )


def test_bus_bandwidth_follows_nccl_tests():
    assert costmodel.bus_bandwidth(1e9, 1.0, 4) == pytest.approx(1.5e9)


def test_fit_recovers_alpha_and_beta():
    sizes = np.array([1e3, 1e4, 1e5, 1e6])
    alpha, beta = costmodel.fit_alpha_beta(sizes, 2e-5 + sizes * 3e-10)
    assert alpha == pytest.approx(2e-5) and beta == pytest.approx(3e-10)


def test_bubble_fraction():
    assert costmodel.pipeline_bubble_fraction(4, 1) == 0.75
    assert costmodel.pipeline_bubble_fraction(1, 8) == 0.0


def test_where_the_ring_stops_being_the_right_choice():
    """Lesson 8: on the stated data-centre network, at 1,024 ranks the ring is
    within 15% of the best algorithm for a 1 GiB all-reduce, and more than 10x
    slower for 1 MiB (its 2(p-1) latencies)."""

    def ring_over_best(nbytes, p):
        best = min(
            costmodel.allreduce_time(name, nbytes, p, costmodel.DATACENTER)
            for name in costmodel.ALLREDUCE_MODELS
        )
        return costmodel.ring_allreduce_time(nbytes, p, costmodel.DATACENTER) / best

    assert ring_over_best(2**30, 1024) < 1.15
    assert ring_over_best(2**20, 1024) > 10


def test_an_all_to_all_sends_p_minus_1_chunks_of_n_over_p():
    assert costmodel.alltoall_time(1e6, 1, NET) == 0.0  # its own chunk stays home
    for p in (2, 8):
        expected = (p - 1) * NET.alpha + (p - 1) / p * 1e6 * NET.beta
        assert costmodel.alltoall_time(1e6, p, NET) == pytest.approx(expected, rel=1e-12)
    # half the bytes of a ring all-reduce's wire traffic, none of its reduction, half its alphas
    ring = costmodel.ring_allreduce_time(1e6, 8, Network(NET.alpha, NET.beta))
    assert costmodel.alltoall_time(1e6, 8, NET) == pytest.approx(ring / 2, rel=1e-12)


def test_a_hop_slower_than_its_block_exposes_the_difference_and_a_faster_one_nothing():
    assert costmodel.exposed_behind_compute(hop_seconds=3.0, compute_seconds=1.0, hops=4) == 8.0
    assert costmodel.exposed_behind_compute(hop_seconds=1.0, compute_seconds=3.0, hops=4) == 0.0
    assert costmodel.exposed_behind_compute(hop_seconds=2.0, compute_seconds=2.0, hops=4) == 0.0
