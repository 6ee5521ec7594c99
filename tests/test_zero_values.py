"""ZeroDataParallel's values on the simulated world: each rank's chunk of the mean gradient
(averaged before or after the reduce-scatter), the buffers of a stage with no parameters, and
gather_state's whole masters under a parameter name that holds an "@"; with overlap, the seconds
backward spends on the rings; gradients no hook saw; and the peak memory of stage 3's forward."""

import time

import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn
from minimp.distributed.ring import chunk_bounds
from minimp.optim import SGD
from minimp.parallel.zero.data_parallel import zero_data_parallel
from minimp.tensor import Tensor, no_grad


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
    (formulas.memory_formula says 0 bytes of every kind for it)."""

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


def _backward_seconds(comm, stage, overlap):
    """(the seconds overlap counted inside one backward, that backward's wall time)."""
    layer = nn.Linear(3, 2)
    optimizer = SGD(layer.parameters(), lr=0.1)
    sync = zero_data_parallel(stage, optimizer, [layer], comm, overlap=overlap)
    started = time.perf_counter()
    layer(Tensor(rank_batch(comm.rank))).sum().backward()
    return sync.backward_communication_seconds(), time.perf_counter() - started


@pytest.mark.parametrize("stage", [1, 2])
def test_with_overlap_two_replicas_start_their_rings_inside_backward(stage):
    """Overlap on two replicas (and micro_batches left at its default, one): the unit's ring
    starts from backward's hook once W and b are complete, so backward counts its seconds."""
    for seconds, wall in dist.simulate(2, _backward_seconds, stage, True):
        assert 0.0 < seconds <= wall


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("stage", [1, 2])
def test_one_replica_sends_nothing_so_backward_spends_no_seconds_communicating(stage, overlap):
    """One replica has nothing to send: overlap is off whatever was asked, and the count is 0."""
    [(seconds, _)] = dist.simulate(1, _backward_seconds, stage, overlap)
    assert seconds == 0.0


def _pieces_of_gradients_set_by_hand(comm):
    parameter = nn.Parameter(np.zeros(6, np.float32))
    sync = zero_data_parallel(2, SGD([parameter], lr=0.1), [], comm)  # a unit of its own
    parameter.grad = np.arange(6, dtype=np.float32) * (comm.rank + 1)  # no backward, no hook
    sync.after_backward()
    return np.concatenate(sync.optimizer.gradient_pieces()), parameter.grad


def test_after_backward_reduces_gradients_no_hook_saw_arrive():
    """A gradient written into .grad by hand reaches no post-accumulate hook; after_backward
    still finds it and leaves each rank its chunk of the mean, (1 + 2)/2 * arange(6)."""
    mean = np.arange(6, dtype=np.float32) * np.float32(1.5)
    for rank, (pieces, grad) in enumerate(dist.simulate(2, _pieces_of_gradients_set_by_hand)):
        start, stop = chunk_bounds(6, 2)[rank]
        assert grad is None and pieces.tolist() == mean[start:stop].tolist()


def _peak_of_a_forward(comm):
    layer = nn.Linear(3, 2)
    sync = zero_data_parallel(3, SGD(layer.parameters(), lr=0.1), [layer], comm)
    with no_grad():
        sync.run_group([layer], Tensor(rank_batch(comm.rank)), lambda ls, x: ls[0](x))
    return sync.peak.by_kind, sync.held()


def test_stage_3_s_peak_holds_the_unit_its_forward_gathered():
    """The gathered unit lives only during the forward, so the peak must be sampled there: W and
    b, 8 float32 numbers, on each rank; once the forward is done nothing gathered is held."""
    for peak, held in dist.simulate(2, _peak_of_a_forward):
        assert peak["gathered"] == 8 * 4 and held["gathered"] == 0
