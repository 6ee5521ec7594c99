"""Overlap's values on the simulated world: the seconds it counts, a step without after_backward,
a parameter no backward reaches, the chunks a ZeRO unit's ring is given, and the tags of every
bucket's and unit's messages in the trace (protocol.py: bucket b's reduce-scatter goes under
GRADIENT_BUCKETS + 2b, its all-gather under GRADIENT_BUCKETS + 2b + 1)."""

import time
from collections import Counter

import numpy as np
from conftest import requires_gpu

from minimp import distributed as dist
from minimp import nn, optim
from minimp.distributed.protocol import Tag
from minimp.distributed.ring import chunk_bounds
from minimp.parallel.data.data_parallel import DataParallel
from minimp.measure.accounts import BytesSent
from minimp.parallel.zero.data_parallel import OverlappedUnits
from minimp.precision import NoLossScaler, mixed_precision_step
from minimp.tensor import Tensor

SIZES = [32, 8, 16, 2]  # the parameters of Linear(4, 8) and Linear(8, 2): weight, bias, ...


def mlp(extra=None):
    """A 2-layer MLP and its SGD; `extra`, a Parameter the forward never uses, goes last."""
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(4, 8, rng=rng), nn.ReLU(), nn.Linear(8, 2, rng=rng))
    params = model.parameters() + ([] if extra is None else [extra])
    return model, optim.SGD(params, lr=0.1)


def rank_batch(comm):
    """Each replica's own batch, so that the mean differs from every replica's gradient."""
    return Tensor(np.random.default_rng(1 + comm.rank).normal(size=(5, 4)).astype(np.float32))


def one_step(comm, overlap, extra=False, after_backward=True):
    """One step of the MLP (every parameter its own bucket); returns the float32 masters."""
    unused = nn.Parameter(np.full(3, 0.5, np.float32)) if extra else None
    model, optimizer = mlp(unused)
    sync = DataParallel(comm, optimizer, bucket_mb=1e-6, overlap=overlap)
    model(rank_batch(comm)).sum().backward()
    if after_backward:
        sync.after_backward()
    mixed_precision_step(optimizer, NoLossScaler(), sync=sync)
    return [master.tobytes() for master in optimizer.master_weights]


def test_the_seconds_communicating_inside_backward_are_part_of_backward_s_wall_time():
    def body(comm):
        model, optimizer = mlp()
        sync = DataParallel(comm, optimizer, bucket_mb=1e-6, overlap=True)
        before = sync.backward_communication_seconds()
        started = time.perf_counter()
        model(rank_batch(comm)).sum().backward()
        wall = time.perf_counter() - started
        return before, sync.backward_communication_seconds(), wall

    for before, after, wall in dist.simulate(2, body):
        assert before == 0.0 and 0.0 < after <= wall


def test_the_seconds_of_every_start_and_progress_of_a_zero_unit_s_ring_add_up():
    """On one rank a ring is done the moment it starts, so each unit's then() runs inside the
    progress that start calls; each sleeps 50 ms, so the count holds both sleeps, not the last."""
    nap = 0.05

    def body(comm):
        units = OverlappedUnits(comm, BytesSent(), parameters=1, micro_batches=1)
        started = time.perf_counter()
        for unit in (0, 1):
            send, receive = units.new_buffers(np.zeros(1, np.float32), 3)
            send[...] = 1.0
            units.start(unit, send, receive, chunk_bounds(3, 1), lambda out: time.sleep(nap))
        return units.in_flight, units.seconds, time.perf_counter() - started

    [(in_flight, seconds, wall)] = dist.simulate(1, body)
    assert in_flight == {} and 2 * nap <= seconds <= wall


def test_a_step_without_after_backward_still_waits_for_the_buckets_of_its_backward():
    """One micro-batch needs no after_backward (the step accumulates): the hooks themselves
    tell finalize_backward that a backward ran, so the step averages as without overlap."""
    overlap = dist.simulate(2, lambda comm: one_step(comm, True, after_backward=False))
    assert overlap == dist.simulate(2, lambda comm: one_step(comm, False, after_backward=False))
    assert overlap[0] == overlap[1]


def test_a_parameter_no_backward_reached_does_not_hold_back_the_buckets_behind_it():
    """The unused parameter is the last one, so its bucket is the first in plan order and never
    completes in backward: finalize_backward starts it (zeros) and every bucket after it."""
    overlap = dist.simulate(2, lambda comm: one_step(comm, True, extra=True))
    assert overlap == dist.simulate(2, lambda comm: one_step(comm, False, extra=True))
    assert overlap[0] == overlap[1]


def tags_in(trace):
    """tag -> (messages, bytes) over every message of a trace."""
    count, nbytes = Counter(m.tag for m in trace), Counter()
    for message in trace:
        nbytes[message.tag] += message.nbytes
    return {tag: (count[tag], nbytes[tag]) for tag in count}


def test_each_bucket_s_messages_go_under_the_two_tags_of_that_bucket():
    """Over p ranks, a ring sends p(p - 1) messages in each half, each chunk p - 1 times: the
    bucket's float32 bytes times (p - 1). Buckets go from the last parameter to the first."""
    p = 3

    def body(comm):
        model, optimizer = mlp()
        sync = DataParallel(comm, optimizer, bucket_mb=1e-6, overlap=True)
        model(rank_batch(comm)).sum().backward()
        sync.finalize_backward()

    trace = dist.simulate(p, body, eager_limit=0).trace
    expected = {}
    for bucket, size in enumerate(reversed(SIZES)):
        for half in (0, 1):
            expected[Tag.GRADIENT_BUCKETS + 2 * bucket + half] = (p * (p - 1), (p - 1) * size * 4)
    assert tags_in(trace) == expected


def test_each_zero_unit_s_reduce_scatter_goes_under_its_own_tag():
    p, sizes = 3, [5, 7, 2]

    def body(comm):
        units = OverlappedUnits(comm, BytesSent(), parameters=1, micro_batches=1)
        chunks = {}

        def keep(unit, start, stop):
            return lambda out: chunks.update({unit: out[start:stop].copy()})

        for unit, size in enumerate(sizes):
            send, receive = units.new_buffers(np.zeros(1, np.float32), size)
            send[...] = np.arange(size) + 10.0 * comm.rank
            bounds = chunk_bounds(size, p)
            start, stop = bounds[comm.rank]
            units.start(unit, send, receive, bounds, keep(unit, start, stop))
        units.wait()
        return chunks

    results = dist.simulate(p, body, eager_limit=0)
    expected = {
        Tag.GRADIENT_BUCKETS + 2 * unit: (p * (p - 1), (p - 1) * size * 4)
        for unit, size in enumerate(sizes)
    }
    assert tags_in(results.trace) == expected
    for rank, chunks in enumerate(results):  # the sum over ranks 0, 1, 2 of arange + 10 rank
        for unit, size in enumerate(sizes):
            start, stop = chunk_bounds(size, p)[rank]
            assert chunks[unit].tolist() == (3 * np.arange(start, stop) + 30.0).tolist()


def test_a_unit_s_reduce_scatter_leaves_the_sum_in_the_chunks_it_was_given():
    """start's bounds are the chunks of the ring, not chunk_bounds' cut (ZeroDataParallel passes
    its layout's, which are that cut today): rank r finds the sum in receive[bounds[r]]."""
    p, size, bounds = 3, 7, ((0, 4), (4, 5), (5, 7))  # chunk_bounds(7, 3) is 0-3, 3-5, 5-7

    def body(comm):
        units = OverlappedUnits(comm, BytesSent(), parameters=1, micro_batches=1)
        send, receive = units.new_buffers(np.zeros(1, np.float32), size)
        send[...] = np.arange(size) + 10.0 * comm.rank
        start, stop = bounds[comm.rank]
        mine = []
        units.start(0, send, receive, bounds, lambda out: mine.append(out[start:stop].copy()))
        units.wait()
        return mine

    for rank, mine in enumerate(dist.simulate(p, body)):  # the sum of arange + 10 rank, r < 3
        start, stop = bounds[rank]
        assert len(mine) == 1 and mine[0].tolist() == (3 * np.arange(start, stop) + 30.0).tolist()


@requires_gpu
def test_a_ring_s_buffers_live_where_the_array_they_are_like_lives():
    """On the GPU, a unit's send and receive buffers must be device memory: the ring adds into
    them with the gradients' own array module. (Skipped without CuPy and a CUDA device.)"""
    import cupy

    units = OverlappedUnits(comm=None, sent=None, parameters=1, micro_batches=1)
    for array in units.new_buffers(cupy.zeros(4, cupy.float16), 7):
        assert isinstance(array, cupy.ndarray) and array.shape == (7,)
        assert array.dtype == cupy.float16
