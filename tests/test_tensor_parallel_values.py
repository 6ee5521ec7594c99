"""Sequence parallelism's operators, value by value on the simulated world: what a Function does
with its defaults, checked against slices and sums written out in NumPy."""

import sys

import numpy as np
from conftest import DeviceLike, cupy_stand_in

from minimp import Tensor
from minimp import distributed as dist
from minimp.parallel.tensor.mappings import (
    GatherFromSequenceParallelRegion,
    all_gather_sequence,
    all_reduce,
    reduce_scatter_sequence,
    split_sequence,
)

RANKS, BATCH, SLICE, WIDTH = 2, 2, 3, 4  # each rank holds (BATCH, SLICE, WIDTH)


def _upstream(rank):
    """The gradient rank `rank` sends back into the gathered (BATCH, RANKS * SLICE, WIDTH)."""
    shape = (BATCH, RANKS * SLICE, WIDTH)
    return np.arange(np.prod(shape), dtype=np.float64).reshape(shape) * (rank + 1)


def _gather_with_defaults(comm):
    x = Tensor(np.full((BATCH, SLICE, WIDTH), float(comm.rank)), requires_grad=True)
    y = GatherFromSequenceParallelRegion.apply(x, comm=comm)  # tensor_parallel_output_grad left out
    y.backward(_upstream(comm.rank))
    return y.data, x.grad


def test_gather_s_backward_reduce_scatters_unless_told_otherwise():
    """By default every rank's dL/dy is a different part of the loss's gradient: x's gradient is
    this rank's sequence slice of their sum (with the split alone, rank 0 would get 1x, not 3x)."""
    results = dist.simulate(RANKS, _gather_with_defaults)
    total = sum(_upstream(rank) for rank in range(RANKS))
    gathered = np.concatenate([np.full((BATCH, SLICE, WIDTH), float(r)) for r in range(RANKS)], 1)
    for rank, (y, grad) in enumerate(results):
        np.testing.assert_array_equal(y, gathered)
        np.testing.assert_array_equal(grad, total[:, rank * SLICE : (rank + 1) * SLICE])


def test_all_gather_sequence_keeps_a_device_array_on_the_device(monkeypatch):
    """A device slice is gathered with its own array module: the whole sequence is one too."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())

    def gather(comm):
        mine = np.full((BATCH, SLICE, WIDTH), float(comm.rank), np.float32).view(DeviceLike)
        return all_gather_sequence(comm, mine)

    gathered = np.concatenate([np.full((BATCH, SLICE, WIDTH), float(r)) for r in range(RANKS)], 1)
    for whole in dist.simulate(RANKS, gather):
        assert type(whole) is DeviceLike and whole.dtype == np.float32
        np.testing.assert_array_equal(whole, gathered)


def test_reduce_scatter_sequence_keeps_a_device_array_on_the_device(monkeypatch):
    """Device partial sums are reduce-scattered with their own array module (numpy's
    ascontiguousarray would make a host array here and raise TypeError on a CuPy one)."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())

    def reduce_scatter(comm):
        return reduce_scatter_sequence(comm, _upstream(comm.rank).view(DeviceLike))

    total = sum(_upstream(rank) for rank in range(RANKS))
    for rank, mine in enumerate(dist.simulate(RANKS, reduce_scatter)):
        assert type(mine) is DeviceLike and mine.flags.c_contiguous
        np.testing.assert_array_equal(mine, total[:, rank * SLICE : (rank + 1) * SLICE])


def test_split_sequence_keeps_a_device_array_on_the_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())
    whole = _upstream(0)  # (BATCH, RANKS * SLICE, WIDTH)
    slices = dist.simulate(RANKS, lambda comm: split_sequence(comm, whole.view(DeviceLike)))
    for rank, mine in enumerate(slices):
        assert type(mine) is DeviceLike and mine.flags.c_contiguous
        np.testing.assert_array_equal(mine, whole[:, rank * SLICE : (rank + 1) * SLICE])


def test_all_reduce_keeps_a_device_array_on_the_device(monkeypatch):
    """Device partial sums are all-reduced with their own array module, on one rank (the copy)
    and on two (the ring): numpy's ascontiguousarray would make a host array here, and raise
    TypeError on a CuPy one."""
    monkeypatch.setitem(sys.modules, "cupy", cupy_stand_in())

    def reduce(comm):
        return all_reduce(comm, _upstream(comm.rank).view(DeviceLike))

    for ranks in (1, 2):
        results = dist.simulate(ranks, reduce)
        total = sum(_upstream(rank) for rank in range(ranks))
        for summed in results:
            assert type(summed) is DeviceLike and summed.shape == total.shape
            np.testing.assert_array_equal(summed, total)
