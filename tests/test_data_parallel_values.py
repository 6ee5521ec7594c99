"""DataParallel's gradient averaging value by value on the simulated world, against means written
out in NumPy."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn, optim
from minimp.parallel.data_parallel import DataParallel


@pytest.mark.parametrize("average", ["before", "after"])
def test_a_parameter_no_loss_reached_on_one_replica_takes_part_with_zeros(average):
    """Rank 0's loss did not reach the (2, 3) weight, rank 1's did: the mean is half of rank 1's
    gradient, on both ranks, and rank 0's missing gradient becomes a float32 array of that mean."""
    reached = np.arange(6, dtype=np.float32).reshape(2, 3)

    def body(comm):
        weight, bias = np.zeros((2, 3), np.float32), np.zeros(4, np.float32)
        parameters = [nn.Parameter(weight), nn.Parameter(bias)]
        replicas = DataParallel(comm, optim.SGD(parameters, lr=0.1), average=average)
        grads = [None if comm.rank == 0 else reached.copy(), np.full(4, comm.rank, np.float32)]
        replicas.reduce(grads)
        return grads

    for grads in dist.simulate(2, body):
        assert grads[0].dtype == np.float32 and grads[0].shape == (2, 3)
        np.testing.assert_array_equal(grads[0], (np.zeros((2, 3)) + reached) / 2)
        np.testing.assert_array_equal(grads[1], np.full(4, 0.5))
