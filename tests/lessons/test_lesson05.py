"""Lesson 5 (the ring all-reduce): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/05_ring_allreduce.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests

from minimp import distributed as dist

f16 = np.float16


def test_lesson5_bytes_per_rank_ring_and_naive():
    big = [np.ones(1_000_000, np.float32) for _ in range(4)]
    expected = {"ring": [6_000_000] * 4, "naive": [12_000_000] + [4_000_000] * 3}
    for algorithm, sent in expected.items():
        def reduce(comm):
            return dist.allreduce(comm, big[comm.rank], algorithm=algorithm)

        trace = dist.simulate(4, reduce).trace
        assert [sum(m.nbytes for m in trace if m.source == r) for r in range(4)] == sent


def test_lesson5_send_then_receive_works_eagerly_and_deadlocks_past_the_eager_limit():
    def naive_ring(comm, length):
        outgoing, incoming = np.ones(length, np.float32), np.empty(length, np.float32)
        comm.send(outgoing, (comm.rank + 1) % comm.size)
        comm.recv(incoming, (comm.rank - 1) % comm.size)
        return incoming

    assert dist.simulate(4, naive_ring, 100)[0][0] == 1
    with pytest.raises(dist.DeadlockError):
        dist.simulate(4, naive_ring, 100_000)


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def all_gather_by_direct_sends(comm, chunk):
    out = np.empty(comm.size * chunk.size, chunk.dtype)
    for rank in range(comm.size):
        part = out[rank * chunk.size : (rank + 1) * chunk.size]
        if rank == comm.rank:
            part[...] = chunk
            for other in range(comm.size):
                if other != rank:
                    comm.send(chunk, other)
        else:
            comm.recv(part, rank)
    return out


def reduce_scatter_by_allreduce(comm, x):
    total = dist.ring_allreduce(comm, x)
    n = x.size // comm.size
    return total[comm.rank * n : (comm.rank + 1) * n]


def ring_shift_sending_first(comm, x):
    incoming = np.empty_like(x)
    comm.send(x, (comm.rank + 1) % comm.size)
    comm.recv(incoming, (comm.rank - 1) % comm.size)
    return incoming


WRONG = {
    "check_all_gather": [
        Wrong(all_gather_by_direct_sends, ""),
    ],
    "check_reduce_scatter": [
        Wrong(reduce_scatter_by_allreduce, ""),
    ],
    "check_ring_shift": [
        Wrong(ring_shift_sending_first, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(5, WRONG)
