"""The simulated communicator's rules at their edges: a message of exactly `eager_limit` bytes is
still eager (MPI's eager protocol covers sizes up to and including the threshold), and sendrecv's
default tags are send's and recv's (0), so it pairs with them."""

import numpy as np

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
