"""The persistent all-reduce: the same bits as the checked call, the ranks' agreement made once at
construction (none per call), a wrong array refused on its rank before any message."""

import ml_dtypes
import numpy as np
import pytest

from minimp import distributed as dist
from minimp.measure.costmodel import Network
from minimp.measure.machinemodel import FastestPredicted
from minimp.distributed.collectives import PersistentAllreduce

ALGORITHMS = ["ring", "naive", "recursive_doubling", "auto"]


def rank_data(rank, size, dtype, call):
    rng = np.random.default_rng(1000 * rank + call)
    return rng.normal(0, 3, size).astype(np.float32).astype(dtype)


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_each_call_equals_the_checked_allreduce_bit_for_bit(ranks, algorithm, dtype):
    def run(comm):
        plan = PersistentAllreduce(comm, (3, 7), dtype, algorithm=algorithm)
        out = np.empty((3, 7), dtype)
        pairs = []
        for call in range(3):  # reused step after step, with and without `out`
            x = rank_data(comm.rank, 21, dtype, call).reshape(3, 7)
            expected = dist.allreduce(comm, x, algorithm=algorithm)
            given = plan(x, out=out) if call % 2 else plan(x)
            pairs.append((expected.view(np.uint8).copy(), given.view(np.uint8).copy()))
            assert given.shape == (3, 7) and given.dtype == np.dtype(dtype)
            assert np.shares_memory(given, out) == bool(call % 2)
        return pairs

    for pairs in dist.simulate(ranks, run):
        for expected, given in pairs:
            np.testing.assert_array_equal(given, expected)


def test_the_ranks_agree_once_at_construction_and_never_per_call():
    def run(comm):
        plan = PersistentAllreduce(comm, (64,), np.float32, algorithm="recursive_doubling")
        after_construction = comm.scalar_allreduces
        x = np.ones(64, np.float32)
        for _ in range(5):
            plan(x)
        after_plan = comm.scalar_allreduces
        # the checked ring agrees at every call (checked recursive doubling carries its check in
        # its messages instead: tests/test_headers.py)
        dist.allreduce(comm, x, algorithm="ring")
        return after_construction, after_plan, comm.scalar_allreduces

    for constructed, planned, checked in dist.simulate(4, run):
        assert (constructed, planned, checked) == (1, 1, 2)


@pytest.mark.parametrize("by", ["length", "dtype"])
def test_ranks_planning_different_arrays_fail_together_at_construction(by):
    def run(comm):
        length = 8 + (comm.rank if by == "length" else 0)
        dtype = np.float16 if (by == "dtype" and comm.rank == 1) else np.float32
        try:
            PersistentAllreduce(comm, (length,), dtype)
        except dist.CollectiveMismatchError as error:
            return str(error)
        return None

    messages = dist.simulate(3, run)
    assert all(m and "PersistentAllreduce: ranks disagree on the array" in m for m in messages)


def test_an_array_other_than_the_planned_one_is_refused_before_any_message():
    def run(comm):
        plan = PersistentAllreduce(comm, (4, 2), np.float32)
        refusals = []
        for wrong in (np.ones((8,), np.float32), np.ones((4, 2), np.float16)):
            with pytest.raises(ValueError, match="planned for float32 arrays of shape \\(4, 2\\)"):
                plan(wrong)
            refusals.append(True)
        return refusals

    results = dist.simulate(2, run)
    assert results == [[True, True]] * 2
    assert results.trace == []  # nothing was sent: the agreement is a scalar all-reduce


def test_auto_plans_the_algorithm_allreduce_would_choose():
    def run(comm):
        return [
            PersistentAllreduce(comm, (n,), np.float32).algorithm for n in (1024, 2**20, 2**24)
        ]

    for ranks in (2, 4):
        chosen = dist.simulate(ranks, run)[0]
        assert chosen == [dist.choose_algorithm(4 * n, ranks) for n in (1024, 2**20, 2**24)]


def test_an_unknown_algorithm_or_op_is_refused_in_one_line():
    def run(comm):
        with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
            PersistentAllreduce(comm, (4,), np.float32, algorithm="tree")
        with pytest.raises(ValueError, match="op must be one of"):
            PersistentAllreduce(comm, (4,), np.float32, op="mean")
        for shape in ((-1,), (2.5,), (4, -3)):
            with pytest.raises(ValueError) as refused:
                PersistentAllreduce(comm, shape, np.float32)
            assert str(refused.value) == ("PersistentAllreduce: shape must be non-negative "
                                          f"integers, got {shape}")
        return True

    assert dist.simulate(2, run) == [True, True]


@pytest.mark.parametrize("algorithm", ["ring", "naive", "recursive_doubling"])
def test_each_call_applies_the_op_it_was_planned_with(algorithm):
    def run(comm):
        plan = PersistentAllreduce(comm, (2, 2), np.float32, op="max", algorithm=algorithm)
        return plan(np.array([[comm.rank, -comm.rank], [10 - comm.rank, 0.5]], np.float32))

    for result in dist.simulate(3, run):
        np.testing.assert_array_equal(result, [[2, 0], [10, 0.5]])


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_one_dimensional_plan_returns_the_out_it_is_given_itself(ranks):
    # a flat bucket needs no reshape: the caller gets its own buffer back, not a view of it
    def run(comm):
        plan = PersistentAllreduce(comm, (5,), np.float32)
        out = np.empty(5, np.float32)
        return plan(np.arange(5, dtype=np.float32), out=out) is out, out

    for same, out in dist.simulate(ranks, run):
        assert same
        np.testing.assert_array_equal(out, np.arange(5, dtype=np.float32) * ranks)


def test_a_plan_takes_an_empty_dimension_and_a_policy_given():
    # alpha = beta = 1 s at p = 4 and 16 bytes: the ring (30 s) beats recursive doubling (34 s),
    # which `auto`'s rule picks (the last line; tests/test_collectives.py)
    def run(comm):
        empty = PersistentAllreduce(comm, (0, 3), np.float32)
        policy = FastestPredicted(Network(alpha=1.0, beta=1.0))
        costly = PersistentAllreduce(comm, (4,), np.float32, algorithm=policy)
        return empty(np.zeros((0, 3), np.float32)).shape, costly.algorithm

    assert dist.simulate(4, run) == [((0, 3), "ring")] * 4
    assert dist.choose_algorithm(16, 4) == "recursive_doubling"
