"""fp8's amax agreement over the replicas: the elementwise MAX, as float32."""

import numpy as np

from minimp import distributed as dist
from minimp.parallel.amax import AmaxReduction


def test_the_replicas_agree_on_the_elementwise_max_as_float32():
    """float32, as the quantizers' amax history holds it (the all-reduce itself is float64)."""

    def body(comm):
        last = np.inf if comm.rank == 1 else 7.0
        amaxes = np.array([1.5, 2.0 + comm.rank, 3.0 - comm.rank, last], np.float32)
        return AmaxReduction(comm)(amaxes)

    for agreed in dist.simulate(2, body):
        assert agreed.dtype == np.float32
        np.testing.assert_array_equal(agreed, np.array([1.5, 3.0, 3.0, np.inf], np.float32))


def test_one_rank_returns_its_own_amaxes():
    amaxes = np.array([0.25, 4.0], np.float32)
    assert AmaxReduction(dist.simulate(1, lambda comm: comm)[0])(amaxes) is amaxes
