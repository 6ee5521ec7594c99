"""minimp/distributed/headers.py: checked recursive doubling carries the ranks' check in its
messages. The same bits as the old path (agree, then the bare messages), no all-reduce unless the
ranks disagree, the same one line on every rank when they do, and the buffers kept per
communicator (reused, bounded). The same under real mpirun: tests/test_distributed_mpi.py."""

import ml_dtypes
import numpy as np
import pytest

from minimp import distributed as dist
from minimp.distributed.buffers import checked_allreduce
from minimp.distributed.collectives import recursive_doubling_into
from minimp.distributed.headers import HEADER_BYTES, LARGEST_KEPT_PAYLOAD, PACKED_BYTES
from minimp.distributed.headers import PlanCache
from minimp.distributed.headers import headed_buffers
from minimp.distributed.protocol import Tag


def nan_heavy(rank, dtype, length=9):
    """Random values, and NaNs whose payload and sign name the rank (a + b and b + a differ in
    bits when both are NaN: the order of every addition shows)."""
    x = np.random.default_rng(rank).normal(0, 3, length).astype(np.float32)
    bits = x.view(np.uint32)
    bits[::3] = 0x7FC00000 | (rank + 1) << 8 | (0x80000000 if rank % 2 else 0)
    return x.astype(dtype)


# 9 elements travel behind their header in one message; this many 16-bit ones (or float32s) are
# more than PACKED_BYTES, and their header travels apart
APART = PACKED_BYTES // 2 + 5


@pytest.mark.parametrize("ranks", [2, 3, 5])  # 3 and 5: a fold and an unfold
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("op", ["sum", "max"])
@pytest.mark.parametrize("length", [9, APART])
def test_the_checked_call_gives_the_old_paths_bits(ranks, dtype, op, length):
    def both(comm):
        x = nan_heavy(comm.rank, dtype, length)
        old = checked_allreduce(recursive_doubling_into, "old", comm, x, op, None)
        new = dist.allreduce(comm, x, op=op, algorithm="recursive_doubling")
        again = dist.allreduce(comm, x, op=op, algorithm="recursive_doubling")  # kept buffers
        return old.tobytes(), new.tobytes(), again.tobytes()

    for old, new, again in dist.simulate(ranks, both):
        assert new == old and again == old


PAYLOADS = (Tag.DOUBLING_FOLD, Tag.DOUBLING_EXCHANGE, Tag.DOUBLING_UNFOLD)


@pytest.mark.parametrize("length, messages", [
    (10, {(tag, HEADER_BYTES + 40) for tag in PAYLOADS}),  # one message: header, payload
    (APART, {(tag, HEADER_BYTES) for tag in PAYLOADS} | {(Tag.DOUBLING_PAYLOADS, 4 * APART)}),
])
def test_a_call_makes_no_all_reduce_and_its_messages_carry_a_header(length, messages):
    def run(comm):
        dist.allreduce(comm, np.ones(length, np.float32), algorithm="recursive_doubling")
        return comm.scalar_allreduces

    results = dist.simulate(3, run)
    assert list(results) == [0, 0, 0]
    assert {(m.tag, m.nbytes) for m in results.trace} == messages
    assert len(results.trace) == 4 * (1 if length == 10 else 2)  # fold, 2 exchanges, unfold


def mismatched(by, odd_rank, length=8):
    """A function for simulate: every rank all-reduces `length` float32s by sum but odd_rank,
    whose array or op differs `by` length (4 elements more: longer messages), dtype or op."""

    def run(comm):
        odd = comm.rank == odd_rank
        length_here = length + 4 if odd and by == "length" else length
        dtype = np.float16 if odd and by == "dtype" else np.float32
        op = "max" if odd and by == "op" else "sum"
        before = comm.scalar_allreduces
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            dist.allreduce(comm, np.ones(length_here, dtype), op=op)
        return str(caught.value), comm.scalar_allreduces - before

    return run


RANGES = {
    "length": "lengths {n}..{n_4}, dtype codes 3..3, ops sum..sum",
    "dtype": "lengths {n}..{n}, dtype codes 1..3, ops sum..sum",  # float16 is 1, float32 3
    "op": "lengths {n}..{n}, dtype codes 3..3, ops sum..max",
}


# Where the ranks' arrays lie on both sides of PACKED_BYTES, one rank's first message has its
# payload behind the header and the other's does not: PACKED_BYTES // 4 float32s against 4 more
# (by length), PACKED_BYTES // 4 + 1 float32s against as many float16s (by dtype).
CROSSING = [PACKED_BYTES // 4, PACKED_BYTES // 4 + 1]


@pytest.mark.parametrize("by", ["length", "dtype", "op"])
@pytest.mark.parametrize("ranks, odd_rank", [(2, 1), (2, 0), (5, 4), (5, 2), (6, 1)])
@pytest.mark.parametrize("length", [8, APART, *CROSSING])
def test_ranks_that_disagree_all_fail_with_the_same_line(by, ranks, odd_rank, length):
    # (5, 4): the odd rank folds into rank 0; (5, 2): rank 2 hears of it only through the rounds;
    # (6, 1): rank 5 hears of it only through its unfold
    ranges = RANGES[by].format(n=length, n_4=length + 4)
    line = (f"recursive_doubling_allreduce: ranks disagree on the array ({ranges}); every "
            "rank must pass the same length, dtype and op")
    results = dist.simulate(ranks, mismatched(by, odd_rank, length))
    assert list(results) == [(line, 1)] * ranks  # one all-reduce: the one that names it


@pytest.mark.parametrize("length", [4, APART, PACKED_BYTES // 4])
def test_a_failed_call_leaves_the_ranks_able_to_all_reduce_again(length):
    # rank 0 all-reduces the same layout twice: what it received the first time must not have
    # changed the header it sends the second
    def run(comm):
        with pytest.raises(dist.CollectiveMismatchError):
            dist.allreduce(comm, np.ones(length + comm.rank, np.float32))
        return dist.allreduce(comm, np.full(length, comm.rank, np.float32))

    for result in dist.simulate(3, run):
        np.testing.assert_array_equal(result, np.full(length, 3.0))


def test_buffers_are_kept_per_layout_and_op_and_reused():
    def run(comm):
        x = np.ones(16, np.float32)
        for _ in range(5):
            dist.allreduce(comm, x)
        reused = comm.allreduce_plans.built
        dist.allreduce(comm, x, op="max")
        dist.allreduce(comm, x.astype(np.float16))
        dist.allreduce(comm, np.ones(17, np.float32))
        return reused, comm.allreduce_plans.built, len(comm.allreduce_plans)

    assert dist.simulate(2, run) == [(1, 4, 4)] * 2


def test_the_cache_is_bounded_and_forgets_the_least_recently_used():
    plans = PlanCache(max_plans=2)
    for key in ("a", "b", "a", "c"):  # "a" used again: "b" is the oldest when "c" comes
        plans.get(key, lambda: object())
    assert len(plans) == 2 and plans.built == 3
    kept = plans.get("a", lambda: "rebuilt")
    assert kept != "rebuilt" and plans.get("b", lambda: "rebuilt") == "rebuilt"


def test_large_payloads_and_communicators_without_a_cache_get_new_buffers():
    def run(comm):
        large = np.ones(LARGEST_KEPT_PAYLOAD // 4 + 1, np.float32)
        small = np.ones(4, np.float32)
        twice = [headed_buffers(comm, large, "sum") for _ in range(2)]
        bare = type("Bare", (), {"rank": comm.rank, "size": comm.size})()
        plain = [headed_buffers(bare, small, "sum") for _ in range(2)]
        kept = [headed_buffers(comm, small, "sum") for _ in range(2)]
        return twice[0] is twice[1], plain[0] is plain[1], kept[0] is kept[1]

    assert dist.simulate(1, run) == [(False, False, True)]


def test_a_split_communicator_keeps_its_own_buffers():
    def run(comm):
        dist.allreduce(comm, np.ones(4, np.float32))
        group = comm.split(color=comm.rank % 2)
        dist.allreduce(group, np.ones(4, np.float32))
        return comm.allreduce_plans.built, group.allreduce_plans.built

    assert dist.simulate(4, run) == [(1, 1)] * 4
