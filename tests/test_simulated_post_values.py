"""What the simulated world counts per message it posts: the trace's per-sender step, each
communicator's messages_sent, and what a simulated rank says about its node."""

import numpy as np

from minimp import distributed as dist


def _several_senders(comm):
    """Rank 0 sends three messages (send, isend, sendrecv), rank 2 two, interleaved with rank 0's;
    rank 1 receives them all. Returns (messages_sent, bytes_sent)."""
    if comm.rank == 0:
        comm.send(np.zeros(2, np.float32), 1, tag=1)
        comm.barrier()
        comm.isend(np.zeros(3, np.float32), 1, tag=2).wait()
        comm.barrier()
        comm.sendrecv(np.zeros(1, np.float64), 1, np.zeros(1, np.float64), 1, tag=3)
    elif comm.rank == 2:
        comm.send(np.zeros(5, np.float16), 1, tag=4)
        comm.barrier()
        comm.barrier()
        comm.send(np.zeros(4, np.float16), 1, tag=5)
    else:
        comm.barrier()
        comm.barrier()
        for tag, size in ((1, 2), (2, 3)):
            comm.recv(np.zeros(size, np.float32), 0, tag=tag)
        comm.sendrecv(np.zeros(1, np.float64), 0, np.zeros(1, np.float64), 0, tag=3)
        for tag, size in ((4, 5), (5, 4)):
            comm.recv(np.zeros(size, np.float16), 2, tag=tag)
    return comm.messages_sent, comm.bytes_sent


def test_a_messages_step_counts_the_messages_its_sender_sent_before_it():
    """Message.step is the sender's own count: 0, 1, 2, ... per source, whatever the others
    send in between; Message.sequence is the global order."""
    trace = dist.simulate(3, _several_senders, timeout=5.0).trace
    assert [m.sequence for m in trace] == list(range(len(trace)))
    for index, message in enumerate(trace):
        earlier = [m for m in trace[:index] if m.source == message.source]
        assert message.step == len(earlier), (message, earlier)
    assert sorted(m.step for m in trace if m.source == 0) == [0, 1, 2]


def test_messages_sent_counts_every_message_a_rank_sent():
    """Each rank's messages_sent and bytes_sent are those of its messages in the trace."""
    results = dist.simulate(3, _several_senders, timeout=5.0)
    for rank, (messages, nbytes) in enumerate(results):
        mine = [m for m in results.trace if m.source == rank]
        assert (messages, nbytes) == (len(mine), sum(m.nbytes for m in mine))
    assert [messages for messages, _ in results] == [3, 1, 2]


def test_a_linear_broadcast_root_sends_one_message_per_other_rank():
    """bcast on 4 ranks: the root posts 3 messages of the array's bytes; the others none."""
    array = np.arange(5, dtype=np.float32)

    def body(comm):
        x = array.copy() if comm.rank == 2 else np.zeros_like(array)
        comm.bcast(x, root=2)
        return comm.messages_sent, comm.bytes_sent, x

    for rank, (messages, nbytes, x) in enumerate(dist.simulate(4, body, timeout=5.0)):
        expected = 3 if rank == 2 else 0
        assert (messages, nbytes) == (expected, expected * array.nbytes)
        np.testing.assert_array_equal(x, array)


def test_each_simulated_rank_is_the_only_rank_of_its_node():
    """Threads of one process, counted as one rank per node (ranks_on_this_node): so each is
    rank 0 of a node of 1, the local rank that picks its GPU (train/loop.py), in any group."""

    def body(comm):
        half = comm.split(comm.rank % 2)
        return [(c.node_rank_and_size(), c.ranks_on_this_node()) for c in (comm, half)]

    for answers in dist.simulate(3, body, timeout=5.0):
        for (node_rank, node_size), on_node in answers:
            assert node_size == on_node == 1
            assert node_rank in range(node_size)
