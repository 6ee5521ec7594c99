"""ZeroDataParallel's values on the simulated world: each rank's chunk of the mean gradient
(averaged before or after the reduce-scatter), the buffers of a stage with no parameters, and
gather_state's whole masters under a parameter name that holds an "@"."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn
from minimp.distributed.ring import chunk_bounds
from minimp.optim import SGD
from minimp.parallel.zero import zero_data_parallel
from minimp.tensor import Tensor


def rank_batch(rank):
    """Small integers, a different batch on each rank: every sum below is exact in float32."""
    return np.arange(12, dtype=np.float32).reshape(4, 3) * (rank + 1) - 5


def _stage_2_pieces(comm, average, overlap):
    layer = nn.Linear(3, 2)
    optimizer = SGD(layer.parameters(), lr=0.1)
    sync = zero_data_parallel(2, optimizer, [layer], comm, average=average, overlap=overlap)
    layer(Tensor(rank_batch(comm.rank))).sum().backward()
    sync.after_backward()
    return np.concatenate(sync.optimizer.gradient_pieces())


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("average", ["before", "after"])
def test_stage_2_leaves_each_rank_its_chunk_of_the_mean_gradient(average, overlap):
    """loss = sum(x W^T + b): each row of dL/dW is the batch's sum of x, each element of dL/db
    the batch size (4). The one unit [W (2 x 3), b (2)] has 8 elements, cut 4 and 4."""
    results = dist.simulate(2, _stage_2_pieces, average, overlap)
    gradients = [
        np.concatenate([np.tile(rank_batch(rank).sum(0), 2), np.full(2, 4.0, np.float32)])
        for rank in (0, 1)
    ]
    mean = (gradients[0] + gradients[1]) * np.float32(0.5)
    for rank, pieces in enumerate(results):
        start, stop = chunk_bounds(mean.size, 2)[rank]
        assert pieces.tolist() == mean[start:stop].tolist()


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_a_stage_with_no_parameters_holds_nothing_not_even_buffers(stage):
    """A pipeline stage can own no parameters: its largest unit, and so every buffer, is empty
    (zero_accounts.memory_formula says 0 bytes of every kind for it)."""

    def body(comm):
        return zero_data_parallel(stage, SGD([], lr=0.1), [], comm).held()

    for held in dist.simulate(2, body):
        assert held == dict.fromkeys(held, 0)


def _gathered(comm, names):
    layer = nn.Linear(3, 3, rng=np.random.default_rng(0))
    masters = [parameter.data.copy() for parameter in layer.parameters()]
    sync = zero_data_parallel(1, SGD(layer.parameters(), lr=0.1), [layer], comm)
    return sync.optimizer.gather_state(names), masters


def test_gather_state_stitches_pieces_whose_parameter_name_holds_an_at_sign():
    """The pieces travel as "master/<name>@<start>", so the start is what follows the last "@".
    Linear(3, 3) is one unit of 12: rank 0 sends W@0 (6 elements), rank 1 W@6 and b@0."""
    names = ["w@1", "b"]
    (whole, masters), (other, _) = dist.simulate(2, _gathered, names)
    assert other is None
    assert list(whole) == ["master/w@1", "master/b"]
    for name, master in zip(names, masters):
        assert whole[f"master/{name}"].tobytes() == master.tobytes()
