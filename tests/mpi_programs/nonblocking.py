"""Run under mpirun by tests/test_distributed_mpi.py (and on the simulated world by
tests/test_distributed_nonblocking.py): isend and irecv around a ring, small and past the eager
limit, receives posted before and after their sends, out of tag order."""

import sys

import numpy as np


def exchange(comm):
    """Each rank sends two arrays to its right neighbour under two tags and receives its left
    neighbour's, the receive for the second tag posted first. Returns what arrived."""
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    received = {}
    for length in (10, 200_000):  # 40 bytes: eager; 800 KB: rendezvous
        mine = [np.full(length, comm.rank * 10 + k, np.float32) for k in (1, 2)]
        inbox = [np.empty(length, np.float32) for _ in (1, 2)]
        second = comm.irecv(inbox[1], left, tag=2)  # posted before anything was sent
        sends = [comm.isend(mine[0], right, tag=1), comm.isend(mine[1], right, tag=2)]
        first = comm.irecv(inbox[0], left, tag=1)  # its message may be waiting already
        for request in (first, second, *sends):
            request.wait()
        assert first.test() and second.test()
        received[length] = [float(inbox[0][0]), float(inbox[1][-1])]
    return received


def main():
    from minimp import distributed as dist

    comm = dist.world()
    received = exchange(comm)
    left = (comm.rank - 1) % comm.size
    expected = [left * 10 + 1.0, left * 10 + 2.0]
    assert all(values == expected for values in received.values()), received
    wrong = np.empty(5, np.float32)  # a 12-byte message cannot fill it
    if comm.size > 1:
        if comm.rank == 0:
            comm.isend(np.ones(3, np.float32), 1, tag=3).wait()
        elif comm.rank == 1:
            try:
                comm.irecv(wrong, 0, tag=3).wait()
            except ValueError as error:
                print(f"rank 1: {error}")
    comm.barrier()
    print(f"rank {comm.rank}: nonblocking exchange ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
