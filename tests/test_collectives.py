"""minimp/distributed/collectives.py pinned value by value on the simulated world: the algorithm
`auto`'s rule picks and the one a policy given picks (a model's: FastestPredicted of a Network, a
MachineModel or the shipped one), which one then runs (seen in the message trace), `op` and `out`
reaching it, the naive all-reduce's float32 sum, root and NaN bits, the
error messages, and the defaults of the algorithms' bodies (op, root) called alone."""

import ml_dtypes
import numpy as np
import pytest

from minimp import distributed as dist
from minimp.measure.costmodel import Network, fastest_allreduce
from minimp.distributed.collectives import (
    ALGORITHMS,
    RING_FROM_BYTES,
    choose_algorithm,
    naive_allreduce_into,
    recursive_doubling_into,
)
from minimp.distributed.protocol import Tag
from minimp.distributed.ring import ring_allreduce_into
from minimp.measure.machinemodel import FastestPredicted, Line, MachineModel, shipped_model

# Which tags each algorithm's messages carry (at p = 4, a power of two: no folding).
TAGS = {
    "ring": {Tag.RING_REDUCE_SCATTER, Tag.RING_ALL_GATHER},
    "naive": {Tag.NAIVE_TO_ROOT, Tag.BROADCAST},
    "recursive_doubling": {Tag.DOUBLING_EXCHANGE},
}
# alpha = beta = 1 s: a latency as dear as a byte. At p = 4 and 10 bytes the textbook formulas give
# ring 2(p-1) + 2(p-1)/p * 10 = 21, recursive doubling log2(p) (1 + 10) = 22, naive
# 2(p-1)(1 + 10) = 66 (and Rabenseifner, which minimp does not implement, 2 log2(p) + 15 = 19).
COSTLY_LATENCY = Network(alpha=1.0, beta=1.0)


def model_of(python: dict[str, float], ranks: int = 4) -> MachineModel:
    """A MachineModel whose only costs are fixed Python overheads (messages and adds are free)."""
    lines = {name: Line(seconds, 0.0) for name, seconds in python.items()}
    return MachineModel(
        ranks=ranks, agree=0.0, python=lines, message=Line(0.0, 0.0), reduce=Line(0.0, 0.0)
    )


def test_auto_runs_recursive_doubling_below_512_kib_and_the_ring_from_there_at_any_p():
    assert RING_FROM_BYTES == 512 * 1024
    for p in (1, 2, 3, 4, 8, 16):
        assert choose_algorithm(0, p) == choose_algorithm(RING_FROM_BYTES - 1, p)
        assert choose_algorithm(RING_FROM_BYTES - 1, p) == "recursive_doubling"
        assert choose_algorithm(RING_FROM_BYTES, p) == choose_algorithm(2**30, p) == "ring"


def test_the_rule_chooses_as_the_shipped_model_at_powers_of_two():
    # The rule replaced the shipped model's choice (issue 34). At p = 4 and 256 KiB the model
    # predicted the ring while it charged recursive doubling an agreement all-reduce, and the
    # launches measured recursive doubling faster (0.91-0.96x); since recursive doubling checks in
    # its messages' headers (issue 38) the model pays it no agreement and agrees with the rule.
    for p in (2, 4, 8, 16):
        for k in range(12, 27):  # 4 KiB to 64 MiB
            modelled = shipped_model(p).fastest(2**k, tuple(ALGORITHMS))
            assert choose_algorithm(2**k, p) == modelled, (p, k)


def test_a_network_given_decides_among_the_algorithms_minimp_implements():
    assert FastestPredicted(COSTLY_LATENCY)(10, 4) == "ring"
    # what the two mutants that drop the network or the candidates would return instead:
    assert fastest_allreduce(10, 4, COSTLY_LATENCY) == "rabenseifner"
    assert FastestPredicted()(10, 4) == shipped_model(4).fastest(10) == "recursive_doubling"


def test_a_machine_model_given_replaces_the_shipped_one():
    cheapest_naive = model_of({"ring": 1.0, "recursive_doubling": 1.0, "naive": 0.0})
    assert FastestPredicted(cheapest_naive)(10, 4) == "naive"
    assert shipped_model(4).fastest(10) != "naive"  # so the model given is what decided


def test_a_tie_goes_to_the_algorithm_collectives_lists_first():
    tied = model_of({"ring": 1.0, "recursive_doubling": 0.0, "naive": 0.0})
    first = next(name for name in ALGORITHMS if name in ("recursive_doubling", "naive"))
    assert FastestPredicted(tied)(10, 4) == first


def algorithm_that_ran(trace) -> str:
    tags = {message.tag for message in trace}
    (name,) = [name for name, expected in TAGS.items() if tags == expected]
    return name


def test_allreduce_auto_is_the_default_and_a_policy_given_decides_instead():
    inputs = [np.arange(4, dtype=np.float32) * (rank + 1) for rank in range(4)]
    # 4 float32 = 16 bytes: ring 6 + 1.5 * 16 = 30 s against recursive doubling 2 (1 + 16) = 34 s;
    # at 4 / 4 = 1 "byte" recursive doubling would win (4 s against 7.5 s), as the rule picks at
    # 16 bytes.
    policy = FastestPredicted(COSTLY_LATENCY)
    results = dist.simulate(
        4, lambda comm: dist.allreduce(comm, inputs[comm.rank], algorithm=policy)
    )
    assert algorithm_that_ran(results.trace) == "ring"
    for result in results:
        np.testing.assert_array_equal(result, np.arange(4, dtype=np.float32) * 10)
    plain = dist.simulate(4, lambda comm: dist.allreduce(comm, inputs[comm.rank]))
    assert algorithm_that_ran(plain.trace) == choose_algorithm(16, 4) == "recursive_doubling"
    np.testing.assert_array_equal(plain[3], results[3])
    asked = []

    def naive(nbytes, ranks):
        asked.append((nbytes, ranks))
        return "naive"

    named = dist.simulate(4, lambda comm: dist.allreduce(comm, inputs[comm.rank], algorithm=naive))
    assert algorithm_that_ran(named.trace) == "naive" and asked == [(16, 4)] * 4
    tree = lambda nbytes, ranks: "tree"  # noqa: E731
    with pytest.raises(ValueError, match="unknown all-reduce algorithm 'tree'"):
        dist.simulate(1, lambda comm: dist.allreduce(comm, inputs[0], algorithm=tree))


@pytest.mark.parametrize("algorithm", sorted(ALGORITHMS))
def test_allreduce_passes_op_and_out_to_the_algorithm(algorithm):
    def max_into_buffer(comm):
        x = np.array([[comm.rank, -comm.rank], [10 - comm.rank, 0.5]], np.float32)
        out = np.full((2, 2), np.nan, np.float32)
        result = dist.allreduce(comm, x, op="max", algorithm=algorithm, out=out)
        assert np.shares_memory(result, out) and result.shape == (2, 2)
        return out

    for out in dist.simulate(3, max_into_buffer):
        np.testing.assert_array_equal(out, [[2, 0], [10, 0.5]])


@pytest.mark.parametrize("world_size", [1, 3])
def test_naive_allreduce_writes_into_out_in_the_input_shape(world_size):
    def into_buffer(comm):
        x = np.arange(6, dtype=np.float32).reshape(2, 3) + comm.rank
        out = np.empty((2, 3), np.float32)
        result = dist.naive_allreduce(comm, x, out=out)
        assert result.shape == (2, 3) and np.shares_memory(result, out)
        return out

    offsets = sum(range(world_size))  # rank r adds r to every element
    expected = np.arange(6, dtype=np.float32).reshape(2, 3) * world_size + offsets
    for out in dist.simulate(world_size, into_buffer):
        np.testing.assert_array_equal(out, expected)


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16])
def test_naive_allreduce_sums_16_bit_arrays_in_float32_and_rounds_once(dtype):
    # 1 + u/2 + u/2 with u the dtype's spacing at 1: in float32 the sum is 1 + u, exact in the
    # dtype; rounded into the dtype after each addition, 1 + u/2 is a tie that goes to the even 1,
    # twice, and the sum stays 1.
    u = float(ml_dtypes.finfo(dtype).eps)
    inputs = [np.array([1.0], dtype), np.array([u / 2], dtype), np.array([u / 2], dtype)]
    results = dist.simulate(3, lambda comm: dist.naive_allreduce(comm, inputs[comm.rank]))
    for result in results:
        assert result.dtype == np.dtype(dtype) and float(result[0]) == 1.0 + u


@pytest.mark.parametrize(
    "allreduce, expected",
    [
        (dist.naive_allreduce, "naive_allreduce: ranks disagree on the array (lengths 4..5"),
        (dist.recursive_doubling_allreduce, "recursive_doubling_allreduce: ranks disagree on"),
    ],
)
def test_a_mismatch_names_the_allreduce_it_happened_in(allreduce, expected):
    def mismatched(comm):
        with pytest.raises(dist.CollectiveMismatchError) as caught:
            allreduce(comm, np.ones(4 + comm.rank, np.float32))
        return str(caught.value)

    for message in dist.simulate(2, mismatched):
        assert message.startswith(expected)


def test_an_unknown_algorithm_is_a_value_error_that_lists_the_known_ones():
    def unknown(comm):
        dist.allreduce(comm, np.ones(4, np.float32), algorithm="tree")

    message = "unknown all-reduce algorithm 'tree': use auto or one of " + str(sorted(ALGORITHMS))
    with pytest.raises(ValueError) as caught:
        dist.simulate(1, unknown)
    assert str(caught.value) == message


def test_naive_allreduce_broadcasts_from_the_root_it_is_given():
    # Rank 0 is not the root here: a broadcast from rank 0 would hand every rank rank 0's input.
    inputs = [np.array([1.0, 2.0], np.float32) * 10**rank for rank in range(3)]
    results = dist.simulate(3, lambda comm: dist.naive_allreduce(comm, inputs[comm.rank], root=2))
    for result in results:
        np.testing.assert_array_equal(result, [111.0, 222.0])


@pytest.mark.parametrize("dtype, nan_bits", [(np.float16, 0x7C01), (np.float32, 0x7F800001)])
def test_naive_allreduce_max_keeps_the_roots_nan_bit_for_bit(dtype, nan_bits):
    # A signalling NaN (quiet bit clear): the float32 total goes back into the array's dtype by
    # minimp's own cast, which keeps its bits; a detour through float64 (a hardware cast) would set
    # the quiet bit on the way.
    unsigned = np.uint16 if dtype == np.float16 else np.uint32
    nan = np.array([nan_bits], unsigned).view(dtype)

    def reduce_max(comm):
        x = nan.copy() if comm.rank == 0 else np.zeros(1, dtype)
        return dist.naive_allreduce(comm, x, op="max")

    for result in dist.simulate(2, reduce_max):
        assert result.view(unsigned)[0] == nan_bits


def test_naive_allreduce_sends_to_and_sums_on_the_root_it_is_given():
    # The sum order shows who reduced: the root starts from its own array and adds the others in
    # rank order. Root 2: (1 + 1e8) rounds to 1e8 in float32, minus 1e8 is 0; root 0 would give
    # (1e8 - 1e8) + 1 = 1. The trace shows where the arrays went.
    inputs = [np.array([value], np.float32) for value in (1e8, -1e8, 1.0)]
    results = dist.simulate(3, lambda comm: dist.naive_allreduce(comm, inputs[comm.rank], root=2))
    to_root = [(m.source, m.dest) for m in results.trace if m.tag == Tag.NAIVE_TO_ROOT]
    assert sorted(to_root) == [(0, 2), (1, 2)]
    for result in results:
        assert result[0] == 0.0


def run_body(body, inputs, **kwargs):
    """Each rank's flat result of body(comm, inputs[rank], out, **kwargs), and the trace."""

    def rank(comm):
        flat = np.full(inputs[comm.rank].shape, np.nan, inputs[comm.rank].dtype)
        body(comm, inputs[comm.rank], flat, **kwargs)
        return flat

    return dist.simulate(len(inputs), rank)


@pytest.mark.parametrize(
    "body", [naive_allreduce_into, recursive_doubling_into, ring_allreduce_into]
)
def test_the_bodies_sum_unless_told_otherwise(body):
    # PersistentAllreduce always passes op; a caller of the body alone gets the default, a sum
    inputs = [np.array([1.0, -2.0], np.float32) * (rank + 1) for rank in range(3)]
    for flat in run_body(body, inputs):
        np.testing.assert_array_equal(flat, [6.0, -12.0])


def test_the_naive_body_reduces_on_rank_0_unless_told_otherwise():
    inputs = [np.array([value], np.float32) for value in (1e8, -1e8, 1.0)]
    results = run_body(naive_allreduce_into, inputs, op="sum")
    to_root = [(m.source, m.dest) for m in results.trace if m.tag == Tag.NAIVE_TO_ROOT]
    assert sorted(to_root) == [(1, 0), (2, 0)]
    for flat in results:  # (1e8 - 1e8) + 1, in rank order from rank 0
        assert flat[0] == 1.0
