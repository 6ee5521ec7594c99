"""minimp.distributed on the simulated world: all-reduce correctness, bit-identity, bandwidth
from the trace, deadlock detection, sub-groups, and clear errors for mismatched arrays."""

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minimp import distributed as dist

DTYPES = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
# Relative tolerance of a p-rank sum against float64: p - 1 roundings of the storage dtype at most.
UNIT_ROUNDOFF = {
    np.float16: 2.0**-11,
    ml_dtypes.bfloat16: 2.0**-8,
    np.float32: 2.0**-24,
    np.float64: 2.0**-53,
}


def rank_inputs(world_size, length, dtype, seed):
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1, 1, length).astype(dtype) for _ in range(world_size)]


def all_reduce_on(world_size, inputs, algorithm):
    return dist.simulate(
        world_size, lambda comm: dist.allreduce(comm, inputs[comm.rank], algorithm=algorithm)
    )


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 8),
    st.integers(0, 2000),
    st.sampled_from(DTYPES),
    st.integers(0, 2**31 - 1),
    st.sampled_from(["ring", "naive", "recursive_doubling", "auto"]),
)
def test_allreduce_matches_the_float64_sum_and_is_bit_identical(
    world_size, length, dtype, seed, algorithm
):
    inputs = rank_inputs(world_size, length, dtype, seed)
    results = all_reduce_on(world_size, inputs, algorithm)
    exact = np.sum([x.astype(np.float64) for x in inputs], axis=0)
    magnitude = np.sum([np.abs(x.astype(np.float64)) for x in inputs], axis=0)
    for result in results:
        assert result.dtype == np.dtype(dtype) and result.shape == (length,)
        assert result.tobytes() == results[0].tobytes(), "replicas must agree bit for bit"
    # each of at most p roundings (p - 1 partial sums and the stored result)
    # errs by u times its value
    bound = world_size * UNIT_ROUNDOFF[dtype] * magnitude * (1 + 1e-9) + 1e-300
    assert np.all(np.abs(results[0].astype(np.float64) - exact) <= bound)


@settings(max_examples=40, deadline=None)
@given(st.integers(2, 8), st.integers(0, 2000), st.sampled_from([np.float16, np.float32]))
def test_ring_sends_2_p_minus_1_messages_and_2_p_minus_1_over_p_of_the_data(
    world_size, length, dtype
):
    inputs = rank_inputs(world_size, length, dtype, seed=0)
    trace = all_reduce_on(world_size, inputs, "ring").trace
    itemsize = np.dtype(dtype).itemsize
    chunk = -(-length // world_size)  # the largest chunk, in elements
    for rank in range(world_size):
        sent = [m for m in trace if m.source == rank]
        assert len(sent) == 2 * (world_size - 1)
        assert all(m.dest == (rank + 1) % world_size for m in sent)
        optimal = 2 * (world_size - 1) / world_size * length * itemsize
        assert abs(sum(m.nbytes for m in sent) - optimal) <= 2 * chunk * itemsize  # chunk rounding


def test_naive_allreduce_funnels_everything_through_the_root():
    trace = all_reduce_on(4, rank_inputs(4, 1000, np.float32, 0), "naive").trace
    assert all(m.dest == 0 or m.source == 0 for m in trace)
    assert sum(m.nbytes for m in trace if m.source == 0) == 3 * 4000


def test_reduce_scatter_and_all_gather_are_the_two_halves():
    inputs = rank_inputs(3, 10, np.float64, 1)

    def halves(comm):
        chunk = dist.reduce_scatter(comm, inputs[comm.rank])
        return chunk, dist.all_gather(comm, chunk, length=10)

    results = dist.simulate(3, halves)
    bounds = dist.chunk_bounds(10, 3)
    exact = np.sum(inputs, axis=0)
    for rank, (chunk, gathered) in enumerate(results):
        start, stop = bounds[rank]
        np.testing.assert_allclose(chunk, exact[start:stop])
        np.testing.assert_array_equal(gathered, results[0][1])
    np.testing.assert_allclose(results[0][1], exact)


def test_max_and_min_reductions():
    results = dist.simulate(
        3, lambda c: dist.ring_allreduce(c, np.array([c.rank, -c.rank], np.float32), op="max")
    )
    np.testing.assert_array_equal(results[1], [2, 0])


def naive_send_then_recv_ring(comm, length):
    outgoing, incoming = np.ones(length, np.float32), np.empty(length, np.float32)
    comm.send(outgoing, (comm.rank + 1) % comm.size)
    comm.recv(incoming, (comm.rank - 1) % comm.size)
    return incoming


def test_send_then_recv_ring_works_below_the_eager_limit():
    assert dist.simulate(4, naive_send_then_recv_ring, 100)[2].sum() == 100


def test_send_then_recv_ring_deadlocks_past_the_eager_limit_and_we_say_who_waits():
    with pytest.raises(dist.DeadlockError) as caught:
        dist.simulate(4, naive_send_then_recv_ring, 100_000)
    message = str(caught.value)
    for rank in range(4):
        assert f"rank {rank} waits to send 400000 bytes to rank {(rank + 1) % 4}" in message


def test_the_ring_allreduce_does_not_deadlock_past_the_eager_limit():
    inputs = [np.ones(200_000, np.float32)] * 4
    assert all_reduce_on(4, inputs, "ring")[3][0] == 4.0


def test_a_rank_that_raises_is_reported_not_hung():
    def one_rank_fails(comm):
        if comm.rank == 1:
            raise RuntimeError("rank 1 failed")
        return dist.ring_allreduce(comm, np.ones(4, np.float32))

    with pytest.raises(RuntimeError, match="rank 1 failed"):
        dist.simulate(3, one_rank_fails)


@pytest.mark.parametrize("algorithm", ["ring", "naive", "recursive_doubling"])
def test_mismatched_lengths_or_dtypes_are_an_error_on_every_rank(algorithm):
    def mismatched(comm, by):
        x = np.ones(
            8 + (comm.rank if by == "length" else 0),
            np.float16 if (by == "dtype" and comm.rank == 2) else np.float32,
        )
        try:
            dist.allreduce(comm, x, algorithm=algorithm)
        except dist.CollectiveMismatchError as error:
            return str(error)
        return None

    for by in ("length", "dtype"):
        messages = dist.simulate(3, mismatched, by)
        assert all(m and "ranks disagree on the array" in m for m in messages)


def test_split_makes_independent_groups():
    def grouped(comm):
        group = comm.split(color=comm.rank % 2, key=comm.rank)
        return (
            group.rank,
            group.size,
            float(dist.ring_allreduce(group, np.array([comm.rank], np.float64))[0]),
        )

    assert dist.simulate(4, grouped) == [(0, 2, 2.0), (0, 2, 4.0), (1, 2, 2.0), (1, 2, 4.0)]


def test_world_of_one_process_and_the_communicator_api():
    comm = dist.world()
    assert comm.size == 1 and comm.rank == 0
    x = np.arange(5, dtype=np.float16)
    for algorithm in ("ring", "naive", "recursive_doubling", "auto"):
        np.testing.assert_array_equal(dist.allreduce(comm, x, algorithm=algorithm), x)
    assert comm.allreduce_scalars([1.0, 2.0], op="max").tolist() == [1.0, 2.0]


def test_the_input_array_is_not_modified():
    inputs = rank_inputs(3, 50, np.float32, 0)
    copies = [x.copy() for x in inputs]
    for algorithm in ("ring", "naive", "recursive_doubling"):
        all_reduce_on(3, inputs, algorithm)
        assert all(np.array_equal(a, b) for a, b in zip(inputs, copies))


def test_out_receives_the_result_and_must_not_overlap_the_input():
    inputs = rank_inputs(3, 30, np.float32, 2)

    def into_buffer(comm):
        out = np.empty(30, np.float32)
        result = dist.ring_allreduce(comm, inputs[comm.rank], out=out)
        assert result.base is out or result is out
        with pytest.raises(ValueError, match="must not overlap"):
            dist.ring_allreduce(comm, out, out=out)
        return out

    results = dist.simulate(3, into_buffer)
    np.testing.assert_allclose(results[0], np.sum(inputs, axis=0), rtol=1e-6)


def test_the_simulated_world_forgets_finished_collectives():
    world = dist.SimulatedWorld(3)
    world.run(lambda comm: [comm.allreduce_scalars([1.0]) for _ in range(50)])
    assert world.collectives == {} and world.collective_reads == {}


@pytest.mark.parametrize("algorithm", sorted(dist.ALGORITHMS))
@pytest.mark.parametrize("world_size", [2, 3, 4, 5, 8])
def test_every_rank_ends_bit_identical_even_with_nan_payloads(algorithm, world_size):
    """x86 returns the first operand's NaN (payload and sign), so a + b and b + a differ in bits
    when both are NaN: the algorithms must fix the order of every addition."""

    def body(comm):
        x = np.zeros(16, np.float32)
        bits = x.view(np.uint32)
        bits[:] = 0x7FC00000 | (comm.rank + 1)  # a NaN whose payload names the rank
        if comm.rank % 2:
            bits |= 0x80000000  # and a negative one on odd ranks
        return dist.allreduce(comm, x, algorithm=algorithm).view(np.uint32).copy()

    results = dist.simulate(world_size, body)
    assert all(np.array_equal(result, results[0]) for result in results)
    assert np.isnan(results[0].view(np.float32)).all()


def test_the_simulated_world_refuses_a_non_contiguous_array_as_mpi_does():
    def body(comm):
        strided = np.zeros(8, np.float32)[::2]
        if comm.rank == 0:
            comm.send(strided, 1)
        else:
            comm.recv(np.zeros(4, np.float32), 0)

    # rank 1 then waits for a message that never comes: a short timeout ends it soon
    with pytest.raises(ValueError, match="C-contiguous"):
        dist.simulate(2, body, timeout=5)
