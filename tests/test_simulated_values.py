"""The simulated communicator's rules at their edges: a message of exactly `eager_limit` bytes is
still eager (MPI's eager protocol covers sizes up to and including the threshold), and sendrecv's
default tags are send's and recv's (0), so it pairs with them; bcast's default root and split's
default key are MPI's (0), as the Communicator Protocol says. Also what it reports: each message's
place among its sender's (the trace's `step`), the sender a wrong-sized message came from, and a
receive no rank will ever match, as a deadlock naming who it waits for."""

import numpy as np
import pytest

from minimp import distributed as dist

LIMIT = 16  # bytes: four float32


def test_an_isend_of_exactly_eager_limit_bytes_completes_before_any_receive():
    """16 bytes with eager_limit=16: buffered, so test() is True before rank 1 receives; 20
    bytes wait for the receive (rendezvous)."""

    def body(comm):
        if comm.rank == 0:
            at_limit = comm.isend(np.ones(LIMIT // 4, np.float32), 1, tag=1)
            past_limit = comm.isend(np.ones(LIMIT // 4 + 1, np.float32), 1, tag=2)
            states = [at_limit.test(), past_limit.test()]
            comm.barrier()  # rank 1 receives only after this
            past_limit.wait()
            return states
        comm.barrier()
        inbox = [np.zeros(LIMIT // 4, np.float32), np.zeros(LIMIT // 4 + 1, np.float32)]
        comm.recv(inbox[0], 0, tag=1)
        comm.recv(inbox[1], 0, tag=2)
        return [float(array.sum()) for array in inbox]

    sender, receiver = dist.simulate(2, body, eager_limit=LIMIT, timeout=5.0)
    assert sender == [True, False]
    assert receiver == [LIMIT // 4, LIMIT // 4 + 1]


def test_sendrecv_without_tags_pairs_with_send_and_recv_without_tags():
    """Rank 0 sends and receives with the default tag; rank 1 exchanges with one sendrecv and
    names no tag: its message and its receive must match rank 0's (tag 0), or both ranks wait
    for a message that never comes (a DeadlockError)."""

    def body(comm):
        mine, theirs = np.full(3, comm.rank + 1.0, np.float32), np.zeros(3, np.float32)
        if comm.rank == 0:
            comm.send(mine, 1)
            comm.recv(theirs, 1)
        else:
            comm.sendrecv(mine, 0, theirs, 0)
        return theirs

    received = dist.simulate(2, body, timeout=5.0)
    np.testing.assert_array_equal(received[0], np.full(3, 2.0, np.float32))
    np.testing.assert_array_equal(received[1], np.full(3, 1.0, np.float32))
    assert [message.tag for message in received.trace] == [0, 0]


def test_a_blocking_send_of_exactly_eager_limit_bytes_returns_before_its_receive():
    """send() of 16 bytes with eager_limit=16 is buffered: rank 0 goes on to the barrier that rank 1
    waits at before it receives. Were it a rendezvous, each rank would wait on the other (a
    DeadlockError, raised at once)."""

    def body(comm):
        array = np.full(LIMIT // 4, comm.rank + 1.0, np.float32)
        if comm.rank == 0:
            comm.send(array, 1)
            comm.barrier()
        else:
            comm.barrier()
            comm.recv(array, 0)
        return array

    received = dist.simulate(2, body, eager_limit=LIMIT, timeout=5.0)[1]
    np.testing.assert_array_equal(received, np.ones(LIMIT // 4, np.float32))


def test_a_message_s_step_counts_the_messages_its_sender_sent_before_it():
    """Rank 0 sends three messages (two with send, one with isend), rank 1 two (one of them
    through sendrecv): in the trace each sender's messages are numbered 0, 1, 2, ... in the order
    it sent them, whatever the order the two threads' messages interleave in."""

    def body(comm):
        array = np.zeros(2, np.float32)
        if comm.rank == 0:
            comm.send(array, 1, tag=1)
            comm.send(array, 1, tag=2)
            comm.isend(array, 1, tag=3).wait()
            comm.recv(array, 1, tag=4)
            comm.recv(array, 1, tag=5)
        else:
            comm.sendrecv(array, 0, array, 0, tag=4, recv_tag=1)
            comm.send(array, 0, tag=5)
            comm.recv(array, 0, tag=2)
            comm.recv(array, 0, tag=3)

    trace = dist.simulate(2, body, timeout=5.0).trace
    for source, tags in [(0, [1, 2, 3]), (1, [4, 5])]:
        sent = [message for message in trace if message.source == source]
        assert [message.tag for message in sent] == tags
        assert [message.step for message in sent] == list(range(len(tags)))


def test_a_message_of_the_wrong_size_names_the_rank_it_came_from():
    """Rank 1 sends three float32 where rank 0 receives four: a message must fill its buffer
    exactly, and rank 0 raises saying how many bytes came from which rank."""

    def body(comm):
        if comm.rank == 1:
            comm.send(np.zeros(3, np.float32), 0)
        else:
            comm.recv(np.zeros(4, np.float32), 1)

    with pytest.raises(ValueError, match="received 12 bytes from rank 1 into a 16-byte buffer"):
        dist.simulate(2, body, timeout=5.0)


def test_a_receive_no_rank_will_match_is_a_deadlock_naming_source_and_tag():
    """Rank 0 waits for a message of tag 5 from rank 1, which returns without sending it: the
    world sees that the only live rank waits on a finished one and raises DeadlockError at once
    (not the TimeoutError that ends a wait no one diagnosed), saying what rank 0 waits for."""

    def body(comm):
        if comm.rank == 0:
            comm.recv(np.zeros(1, np.float32), 1, tag=5)

    expected = r"rank 0 waits to receive from rank 1 \(tag 5\); rank 1 has returned"
    with pytest.raises(dist.DeadlockError, match=expected):
        dist.simulate(2, body, timeout=1.0)


@pytest.mark.parametrize("size", [1, 3])
def test_bcast_without_a_root_sends_rank_0_s_array(size):
    """Each rank starts with its own array (rank r holds r + 1); bcast(x) names no root, so every
    rank ends with rank 0's, sent by rank 0 alone. On one rank it is a no-op: no peer to wait on.
    """

    def body(comm):
        array = np.full(3, comm.rank + 1.0, np.float32)
        comm.bcast(array)
        return array

    received = dist.simulate(size, body, timeout=5.0)
    for array in received:
        np.testing.assert_array_equal(array, np.ones(3, np.float32))
    assert [message.source for message in received.trace] == [0] * (size - 1)


def test_split_without_a_key_ranks_as_key_0_among_ranks_that_give_one():
    """One color, four ranks: rank 0 gives no key, ranks 1, 2, 3 give keys 1, 0, -1. MPI orders
    the group by (key, old rank) with key 0 for rank 0, so the new order is 3, 0, 2, 1."""
    keys = {1: 1, 2: 0, 3: -1}

    def body(comm):
        group = comm.split(7) if comm.rank == 0 else comm.split(7, key=keys[comm.rank])
        return group.rank, group.size

    expected_order = sorted(range(4), key=lambda r: (keys.get(r, 0), r))
    answers = dist.simulate(4, body, timeout=5.0)
    assert [rank for rank, _ in answers] == [expected_order.index(r) for r in range(4)]
    assert {size for _, size in answers} == {4}
