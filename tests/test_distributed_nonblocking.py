"""isend / irecv on the simulated world: the same exchange as under mpirun, MPI's completion rules
(eager sends complete at once, rendezvous ones when taken), and deadlocks named, not hung."""

import importlib.util
import os

import numpy as np
import pytest

from minimp import distributed as dist

spec = importlib.util.spec_from_file_location(
    "nonblocking", os.path.join(os.path.dirname(__file__), "mpi_programs", "nonblocking.py")
)
nonblocking = importlib.util.module_from_spec(spec)
spec.loader.exec_module(nonblocking)


@pytest.mark.parametrize("ranks", [1, 2, 3, 5])
def test_the_mpirun_exchange_runs_alike_on_the_simulated_world(ranks):
    results = dist.simulate(ranks, nonblocking.exchange)
    for rank, received in enumerate(results):
        left = (rank - 1) % ranks
        assert all(v == [left * 10 + 1.0, left * 10 + 2.0] for v in received.values())


def test_an_eager_isend_completes_before_any_receive_and_a_large_one_only_when_taken():
    def body(comm):
        if comm.rank == 0:
            small = comm.isend(np.ones(4, np.float32), 1, tag=1)
            large = comm.isend(np.ones(100_000, np.float32), 1, tag=2)
            states = [small.test(), large.test()]
            comm.barrier()  # rank 1 receives the large one after this
            large.wait()
            return states + [large.test()]
        comm.barrier()
        buffers = [np.empty(4, np.float32), np.empty(100_000, np.float32)]
        comm.recv(buffers[1], 0, tag=2)
        comm.recv(buffers[0], 0, tag=1)
        return [float(b.sum()) for b in buffers]

    sender, receiver = dist.simulate(2, body)
    assert sender == [True, False, True] and receiver == [4.0, 100_000.0]


def test_both_waiting_on_large_isends_before_receiving_is_a_named_deadlock():
    def body(comm):
        other = 1 - comm.rank
        comm.isend(np.ones(100_000, np.float32), other).wait()  # rendezvous: needs the receive
        comm.recv(np.empty(100_000, np.float32), other)

    with pytest.raises(dist.DeadlockError, match="finish a send of 400000 bytes to rank"):
        dist.simulate(2, body)


def test_a_posted_receive_gets_its_message_the_moment_it_is_sent():
    def body(comm):
        if comm.rank == 1:
            inbox = np.zeros(100_000, np.float32)
            request = comm.irecv(inbox, 0)
            comm.barrier()
            comm.barrier()  # rank 0's large send completed between the barriers
            request.wait()
            return float(inbox[0])
        comm.barrier()
        comm.isend(np.full(100_000, 7.0, np.float32), 1).wait()  # taken: the receive was posted
        comm.barrier()

    assert dist.simulate(2, body)[1] == 7.0


def test_a_message_that_does_not_fill_the_receive_buffer_is_named_at_wait():
    def body(comm):
        if comm.rank == 0:
            comm.isend(np.ones(3, np.float32), 1).wait()
        else:
            comm.irecv(np.empty(5, np.float32), 0).wait()

    with pytest.raises(ValueError, match="received 12 bytes from rank 0 into a 20-byte buffer"):
        dist.simulate(2, body)


def test_a_rank_waiting_on_an_irecv_is_named_with_its_source_and_tag():
    """The deadlock report says what each rank's irecv waits for, by world rank and tag: here the
    group of world ranks 1 and 2, where each receives from the other and nobody sends."""

    def body(comm):
        group = comm.split(0 if comm.rank == 0 else 1)
        if comm.rank > 0:
            group.irecv(np.empty(3, np.float32), 1 - group.rank, tag=5).wait()

    with pytest.raises(dist.DeadlockError) as caught:
        dist.simulate(3, body, timeout=5.0)
    assert str(caught.value) == (
        "deadlock: rank 1 waits to receive from rank 2 (tag 5); "
        "rank 2 waits to receive from rank 1 (tag 5); rank 0 has returned"
    )
