"""Lesson 5 (the ring all-reduce): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/05_ring_allreduce.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests

from minimp import distributed as dist
from minimp.lessons import processes
from minimp.lessons.lesson05 import (
    BIG_N,
    EAGER_FLOATS,
    RENDEZVOUS_FLOATS,
    P,
    bytes_sent_per_rank,
    chunk_sent,
    chunks_sent,
    naive_ring,
)


def test_lesson5_the_ring_sums_bit_identically_in_2_p_minus_1_messages_per_rank():
    inputs = [np.full(8, float(rank + 1), np.float32) for rank in range(P)]
    results = dist.simulate(P, lambda comm: dist.ring_allreduce(comm, inputs[comm.rank]))
    assert all(r.tobytes() == np.full(8, 10, np.float32).tobytes() for r in results)
    assert [sum(m.source == r for m in results.trace) for r in range(P)] == [2 * (P - 1)] * P
    assert all(m.dest == (m.source + 1) % P for m in results.trace)  # "rank r sends to r + 1"


@pytest.mark.parametrize("p", [2, 3, 4, 5])
def test_lesson5_each_message_carries_the_chunk_the_formula_names(p):
    sent = chunks_sent(p, 2 * p)
    assert sent == [[chunk_sent(rank, step, p) for step in range(2 * (p - 1))]
                    for rank in range(p)]


def test_lesson5_bytes_per_rank_ring_and_naive():
    assert bytes_sent_per_rank("ring") == [2 * (P - 1) * 4 * BIG_N // P] * P  # 1.50 arrays
    assert bytes_sent_per_rank("naive") == [(P - 1) * 4 * BIG_N] + [4 * BIG_N] * (P - 1)


def test_lesson5_send_then_receive_works_eagerly_and_deadlocks_past_the_eager_limit():
    assert 4 * EAGER_FLOATS <= dist.simulated.DEFAULT_EAGER_LIMIT < 4 * RENDEZVOUS_FLOATS
    assert dist.simulate(P, naive_ring, EAGER_FLOATS)[0][0] == 1
    with pytest.raises(dist.DeadlockError, match="rendezvous"):
        dist.simulate(P, naive_ring, RENDEZVOUS_FLOATS)


@pytest.mark.mpi
def test_lesson5_the_mpirun_example_prints_the_same_sums_as_the_notebook_stores():
    lines = sorted(processes.run_script(P, "mpirun_examples/ring_allreduce.py").splitlines())
    assert lines == [f"rank {r}: {[float(r)] * 8} -> {[6.0] * 8} (6 messages, 48 bytes sent)"
                     for r in range(P)]


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


def all_gather_by_the_library(comm, chunk):
    return dist.all_gather(comm, chunk)  # minimp's own ring: the traffic is right, the work not


def reduce_scatter_by_the_library(comm, x):
    return dist.reduce_scatter(comm, x)


def ring_shift_sending_first(comm, x):
    incoming = np.empty_like(x)
    comm.send(x, (comm.rank + 1) % comm.size)
    comm.recv(incoming, (comm.rank - 1) % comm.size)
    return incoming


def all_gather_in_arrival_order(comm, chunk):
    """Appends each chunk as it arrives: own chunk first, then the left neighbour's, and so on."""
    p, rank = comm.size, comm.rank
    received, current = [chunk.copy()], chunk.copy()
    for _ in range(p - 1):
        incoming = np.empty_like(chunk)
        comm.sendrecv(current, (rank + 1) % p, incoming, (rank - 1) % p)
        received.append(incoming)
        current = incoming
    return np.concatenate(received)


def reduce_scatter_on_x_itself(comm, x):
    """The reference's schedule, with the partial sums kept in x (no copy)."""
    p, rank = comm.size, comm.rank
    n = x.size // p
    partial, incoming = x.ravel(), np.empty(n, x.dtype)
    for step in range(p - 1):
        send_block, recv_block = (rank - step - 1) % p, (rank - step - 2) % p
        comm.sendrecv(partial[send_block * n:(send_block + 1) * n], (rank + 1) % p, incoming,
                      (rank - 1) % p)
        partial[recv_block * n:(recv_block + 1) * n] += incoming
    return partial[rank * n:(rank + 1) * n].copy()


def reduce_scatter_one_block_early(comm, x):
    """Starts by sending block `rank` (the all-gather's schedule): the block finished after p - 1
    steps is rank + 1's, and block `rank` comes back incomplete."""
    p, rank = comm.size, comm.rank
    n = x.size // p
    partial, incoming = x.ravel().copy(), np.empty(n, x.dtype)
    for step in range(p - 1):
        send_block, recv_block = (rank - step) % p, (rank - step - 1) % p
        comm.sendrecv(partial[send_block * n:(send_block + 1) * n], (rank + 1) % p, incoming,
                      (rank - 1) % p)
        partial[recv_block * n:(recv_block + 1) * n] += incoming
    return partial[rank * n:(rank + 1) * n].copy()


def ring_shift_without_one_rank(comm, x):
    """Even ranks send first, odd ranks receive first, but p = 1 is not thought of: rank 0
    sends to itself and waits for a receive it has not posted."""
    incoming = np.empty_like(x)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.rank % 2 == 0:
        comm.send(x, right)
        comm.recv(incoming, left)
    else:
        comm.recv(incoming, left)
        comm.send(x, right)
    return incoming


def ring_shift_the_other_way(comm, x):
    """Safe from deadlock, but takes the right neighbour's x."""
    incoming = np.empty_like(x)
    right, left = (comm.rank + 1) % comm.size, (comm.rank - 1) % comm.size
    if comm.size == 1:
        return x.copy()
    if comm.rank % 2 == 0:
        comm.send(x, left)
        comm.recv(incoming, right)
    else:
        comm.recv(incoming, right)
        comm.send(x, left)
    return incoming


WRONG = {
    "check_all_gather": [
        Wrong(all_gather_by_direct_sends, "right neighbour"),
        Wrong(all_gather_in_arrival_order, "rank order"),
        Wrong(all_gather_by_the_library, "library"),
    ],
    "check_reduce_scatter": [
        Wrong(reduce_scatter_by_allreduce, "bandwidth"),
        Wrong(reduce_scatter_on_x_itself, "unchanged"),
        Wrong(reduce_scatter_one_block_early, "block r"),
        Wrong(reduce_scatter_by_the_library, "library"),
    ],
    "check_ring_shift": [
        Wrong(ring_shift_sending_first, "deadlock"),
        Wrong(ring_shift_without_one_rank, "p = 1"),
        Wrong(ring_shift_the_other_way, "left neighbour"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(5, WRONG)
