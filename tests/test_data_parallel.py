"""Data parallelism on the simulated world: gradient averaging, the float16 wire, one skip decision,
replica checks, and the trainer's equivalence with one process."""

import zlib

import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn, optim
from minimp.parallel.data.data_parallel import DataParallel, shard
from minimp.parallel.replicas import ReplicaMismatchError, ranks_differing_from_rank_0
from minimp.train import TrainConfig, train


def replica_optimizer(sizes=(3, 5)):
    parameters = [nn.Parameter(np.zeros(size, np.float32)) for size in sizes]
    return optim.SGD(parameters, lr=0.1)


@pytest.mark.parametrize("average", ["before", "after"])
@pytest.mark.parametrize("comm_dtype", [np.float32, np.float16])
def test_gradients_become_the_mean_over_replicas(average, comm_dtype):
    def body(comm):
        optimizer = replica_optimizer()
        replicas = DataParallel(
            comm, optimizer, bucket_mb=1e-5, comm_dtype=comm_dtype, average=average
        )
        grads = [
            np.full(3, comm.rank + 1.0, np.float32),
            np.full(5, 10.0 * (comm.rank + 1), np.float32),
        ]
        replicas.reduce(grads)
        return grads, len(replicas.buckets)

    results = dist.simulate(4, body)
    for grads, buckets in results:
        np.testing.assert_allclose(grads[0], 2.5, rtol=1e-3)
        np.testing.assert_allclose(grads[1], 25.0, rtol=1e-3)
        assert buckets == 2  # a 10-byte bucket limit puts each parameter in its own bucket



@pytest.mark.parametrize(
    "elements, buckets",
    [
        (7, [([2, 1], 7), ([0], 3)]),  # 2 + 5 elements fill 28 bytes exactly: one bucket
        (6, [([2], 2), ([1], 5), ([0], 3)]),  # a parameter never splits: 5 is alone
        (100, [([2, 1, 0], 10)]),
        (1, [([2], 2), ([1], 5), ([0], 3)]),  # each parameter past the limit: one bucket each
    ],
)
def test_buckets_take_the_parameters_last_to_first_up_to_the_byte_limit(elements, buckets):
    """float32 on the wire: 4 bytes an element; parameters of 3, 5 and 2 elements."""
    comm = dist.simulate(1, lambda comm: comm)[0]
    replicas = DataParallel(comm, replica_optimizer((3, 5, 2)), bucket_mb=elements * 4 / 2**20)
    assert replicas.buckets == buckets

def test_a_float16_wire_overflows_when_averaging_after_but_not_before():
    """Four replicas with gradient 30000 each: the sum 120000 is past float16's 65504."""

    def body(comm, average):
        replicas = DataParallel(
            comm, replica_optimizer((4,)), comm_dtype=np.float16, average=average
        )
        grads = [np.full(4, 30000.0, np.float32)]
        replicas.reduce(grads)
        return grads[0]

    after = dist.simulate(4, body, "after")[0]
    before = dist.simulate(4, body, "before")[0]
    assert np.all(np.isinf(after))
    np.testing.assert_array_equal(before, 30000.0)


@pytest.mark.parametrize("world_size", [2, 4])
def test_one_rank_overflowing_is_everyone_s_overflow(world_size):
    def body(comm):
        replicas = DataParallel(comm, replica_optimizer())
        return replicas.any_rank(comm.rank == 1), replicas.any_rank(False)

    assert dist.simulate(world_size, body) == [(True, False)] * world_size


def test_check_replicas_names_the_rank_that_drifted():
    def body(comm):
        optimizer = replica_optimizer()
        if comm.rank == 1:
            optimizer.master_weights[1][0] = 1e-7
        try:
            DataParallel(comm, optimizer).check_replicas()
        except ReplicaMismatchError as error:
            return str(error)

    messages = dist.simulate(3, body)
    assert all(
        m == "master weights of rank(s) [1] differ from rank 0's (replicas drifted apart)"
        for m in messages
    )


def test_check_replicas_sees_drift_in_any_array_and_names_the_fp8_state():
    """Drift in the first master (the checksum chains every array, not just the last), with fp8
    state passed as `extra`: the message names both kinds of state."""

    def body(comm):
        optimizer = replica_optimizer()
        if comm.rank == 2:
            optimizer.master_weights[0][2] = 1e-7
        try:
            DataParallel(comm, optimizer).check_replicas([np.ones(4, np.float32)])
        except ReplicaMismatchError as error:
            return str(error)

    expected = (
        "master weights or fp8 state of rank(s) [2] differ from rank 0's (replicas drifted apart)"
    )
    assert dist.simulate(3, body) == [expected] * 3


class RecordingComm:
    """One rank of a 2-rank group that records the scalar table it contributes."""

    size, rank = 2, 1

    def allreduce_scalars(self, values, op="max"):
        self.sent = np.array(values)
        return np.array([self.sent[1], self.sent[1]])


def test_each_rank_contributes_the_crc32_of_its_arrays_bytes_chained_in_order():
    arrays = [np.arange(3, dtype=np.float32), np.full(2, 0.5, np.float16)]
    comm = RecordingComm()
    assert ranks_differing_from_rank_0(comm, arrays) == []
    expected = zlib.crc32(arrays[1].tobytes(), zlib.crc32(arrays[0].tobytes()))
    assert expected == zlib.crc32(arrays[0].tobytes() + arrays[1].tobytes())
    np.testing.assert_array_equal(comm.sent, [0.0, float(expected)])


def test_broadcast_makes_replicas_identical():
    def body(comm):
        optimizer = replica_optimizer()
        optimizer.master_weights[0][...] = comm.rank
        DataParallel(comm, optimizer).broadcast_parameters()
        return optimizer.params[0].data.copy()

    assert all(np.array_equal(r, np.zeros(3)) for r in dist.simulate(3, body))


def test_broadcast_from_another_root_gives_everyone_that_root_s_masters():
    def body(comm):
        optimizer = replica_optimizer()
        for master in optimizer.master_weights:
            master[...] = comm.rank
        DataParallel(comm, optimizer).broadcast_parameters(root=2)
        return [m.copy() for m in optimizer.master_weights], optimizer.params[1].data.copy()

    for masters, compute in dist.simulate(3, body):
        assert [m.tolist() for m in masters] == [[2.0] * 3, [2.0] * 5]
        assert compute.tolist() == [2.0] * 5


def test_shards_tile_the_global_batch():
    indices = np.arange(12)
    assert np.array_equal(np.concatenate([shard(indices, r, 3) for r in range(3)]), indices)


def run_simulated(world_size, **overrides):
    config = TrainConfig(hidden=32, layers=2, batch_size=32, log_every=1000, **overrides)
    config.validate(world_size)
    return dist.simulate(world_size, lambda comm: train(config, log=lambda line: None, comm=comm))


def test_simulated_data_parallel_training_matches_one_process_in_fp32():
    one = run_simulated(1, precision="fp32", steps=10)[0]["master_weights"]
    for world_size, micro_batches in ((2, 1), (4, 2)):
        results = run_simulated(world_size, precision="fp32", steps=10, micro_batches=micro_batches)
        for result in results:
            for name, array in result["master_weights"].items():
                np.testing.assert_allclose(array, one[name], rtol=1e-5, atol=1e-7, err_msg=name)
                assert array.tobytes() == results[0]["master_weights"][name].tobytes()


def test_every_replica_holds_every_parameter():
    """Lesson 9: data parallelism replicates the parameters; reduce_scatter is what shards."""
    from minimp.train import build_model

    def held(comm):
        model = build_model(64, 10, 32, 2, np.random.default_rng(0))
        optimizer = optim.Adam(model.parameters())
        shard_size = dist.reduce_scatter(comm, np.ones(1000, np.float32)).size
        return sum(m.size for m in optimizer.master_weights), shard_size

    full = sum(p.size for p in build_model(64, 10, 32, 2, np.random.default_rng(0)).parameters())
    assert dist.simulate(4, held) == [(full, 250)] * 4
