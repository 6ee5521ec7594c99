"""How a simulated world runs its ranks and reports on them: each rank is a daemon thread named
after it, simulate() hands its timeout to the world, a rank's own failure is raised before the
deadlocks it caused in the others, and a deadlock's message says what each rank waits for and how
the finished ones ended. Also what the simulated collectives give back: allreduce_scalars always
reduces float64, and a split group's context counts the parent's collectives that made it."""

import threading

import numpy as np
import pytest

from minimp import distributed as dist


def test_each_rank_runs_in_a_daemon_thread_named_after_its_rank():
    """Thread names say which rank a traceback or a debugger's thread list belongs to; daemon
    threads do not keep the interpreter alive when a rank never returns."""

    def body(comm):
        thread = threading.current_thread()
        return thread.name, thread.daemon

    assert dist.simulate(3, body, timeout=5.0) == [(f"rank{r}", True) for r in range(3)]


def test_simulate_hands_its_timeout_to_the_world():
    """Rank 1 is busy outside the world (not blocked in it, so no deadlock) until rank 0 gives up:
    with timeout=0.3 rank 0's receive raises TimeoutError after about 0.3 s, naming the wait. With
    the default 60 s it would still be waiting when rank 1 returns, and die of a deadlock."""
    released = threading.Event()

    def body(comm):
        if comm.rank == 0:
            try:
                comm.recv(np.zeros(1, np.float32), 1, tag=3)
            finally:
                released.set()
        else:
            released.wait(3.0)

    expected = r"rank 0 waited 0\.3 s to receive from rank 1 \(tag 3\)"
    with pytest.raises(TimeoutError, match=expected):
        dist.simulate(2, body, timeout=0.3)


def _fails_while_rank_0_waits(seen):
    def body(comm):
        if comm.rank == 0:
            try:
                comm.recv(np.zeros(1, np.float32), 1, tag=2)
            except dist.DeadlockError as error:
                seen.append(str(error))
                raise
        else:
            raise ValueError("no data for rank 0")

    return body


def test_a_rank_s_own_failure_is_raised_before_the_deadlock_it_caused():
    """Rank 1 fails; rank 0, waiting on it, dies of a deadlock. Rank 0 comes first in rank order,
    but the error worth reading is rank 1's ValueError: run() raises it, not the DeadlockError."""
    with pytest.raises(ValueError, match="no data for rank 0"):
        dist.simulate(2, _fails_while_rank_0_waits([]), timeout=5.0)


def test_a_deadlock_says_which_exception_a_finished_rank_exited_with():
    """The deadlock rank 0 sees names the exception type and message rank 1 exited with."""
    seen = []
    with pytest.raises(ValueError):
        dist.simulate(2, _fails_while_rank_0_waits(seen), timeout=5.0)
    assert seen == [
        "deadlock: rank 0 waits to receive from rank 1 (tag 2); "
        "rank 1 has exited with ValueError: no data for rank 0"
    ]


def test_a_collective_a_rank_never_joins_is_a_deadlock_naming_the_group_size():
    """Ranks 0 and 1 enter a barrier that rank 2 returns without: each waits to join a collective
    of 3 ranks, and the DeadlockError says so."""

    def body(comm):
        if comm.rank < 2:
            comm.barrier()

    expected = (
        "deadlock: rank 0 waits to join a collective of 3 ranks; "
        "rank 1 waits to join a collective of 3 ranks; rank 2 has returned"
    )
    with pytest.raises(dist.DeadlockError) as raised:
        dist.simulate(3, body, timeout=5.0)
    assert str(raised.value) == expected


@pytest.mark.parametrize(
    "values", [[1, 2], np.array([1.5, 2.5], np.float32), np.array([3, 4], np.int32)]
)
def test_allreduce_scalars_reduces_and_returns_float64_whatever_it_is_given(values):
    """Ints and float32 alike are reduced as float64 (the Protocol's 'a few float64 scalars'), as
    MPICommunicator does, so results are the same dtype on every communicator."""

    def body(comm):
        return comm.allreduce_scalars(np.asarray(values) * (comm.rank + 1), op="sum")

    for result in dist.simulate(2, body, timeout=5.0):
        assert result.dtype == np.float64
        np.testing.assert_array_equal(result, np.asarray(values, np.float64) * 3)


def test_a_split_group_s_context_counts_the_parent_s_collectives_that_made_it():
    """A group's context is its parent's plus (the split's place among the parent's collectives,
    counting from 1, color): split, barrier, split on the world give contexts ((1, c),) and
    ((3, 0),); a split of the first group adds (1, 0) to its context."""

    def body(comm):
        first = comm.split(comm.rank % 2)
        comm.barrier()
        second = comm.split(0)
        inner = first.split(0)
        return first.context, second.context, inner.context

    for rank, (first, second, inner) in enumerate(dist.simulate(4, body, timeout=5.0)):
        assert first == ((1, rank % 2),)
        assert second == ((3, 0),)
        assert inner == ((1, rank % 2), (1, 0))
