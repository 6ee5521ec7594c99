"""The simulated world's shared state at its edges: what a new SimulatedWorld starts with (the 60 s
default timeout, no deadlock diagnosed, no sends counted), the diagnosis raised by the rank whose
wait completes a deadlock (word for word, and that rank no longer listed as waiting), and when a
wait gives up: strictly past its deadline, at most one 0.2 s poll late, even if no rank ever
notifies. Every wait here is bounded: a clock the test drives, or a thread joined with a timeout."""

import threading
import types

import pytest

from minimp.distributed import simulated
from minimp.distributed.simulated import DeadlockError, SimulatedWorld


def test_a_new_world_waits_60_seconds_by_default_and_has_diagnosed_nothing():
    """simulate()'s default timeout is 60 s and so is SimulatedWorld's; a fresh world has no
    deadlock (None, not some other falsy value), no waiting or finished ranks, no sends counted."""
    state = SimulatedWorld(3)
    assert state.timeout == 60.0
    assert state.deadlock is None
    assert state.sends_by_rank == [0, 0, 0]
    assert state.waiting == {} and state.finished == {} and state.trace == []


def test_the_rank_that_completes_a_deadlock_raises_the_whole_diagnosis_and_stops_waiting():
    """Rank 1 has returned; rank 0, the only live rank, then waits for something that can't come.
    Its own block_until diagnoses the deadlock (no other thread is involved, so it is always this
    path) and raises it with the exact report, and rank 0 is no longer listed as waiting."""
    state = SimulatedWorld(2, timeout=2.0)
    state.finished[1] = "returned"
    with state.condition, pytest.raises(DeadlockError) as caught:
        state.block_until(0, lambda: False, "receive from rank 1 (tag 5)")
    expected = "deadlock: rank 0 waits to receive from rank 1 (tag 5); rank 1 has returned"
    assert str(caught.value) == expected
    assert state.deadlock == expected
    assert state.waiting == {}


class _Clock:
    """A monotonic clock the test moves: each condition.wait(timeout) advances it by timeout."""

    def __init__(self, now=0.0):
        self.now = now

    def monotonic(self):
        return self.now


class _ClockedCondition:
    """Stands in for threading.Condition: wait() returns at once, the clock moved by its timeout."""

    def __init__(self, clock):
        self.clock, self.waits = clock, []

    def wait(self, timeout=None):
        self.waits.append(timeout)
        self.clock.now += timeout
        return False

    def notify_all(self):
        pass


def test_a_wait_whose_clock_reads_exactly_the_deadline_has_not_timed_out(monkeypatch):
    """timeout=0 at 100 s on the test's clock: the first check finds the clock at the deadline,
    reached but not passed, so the rank waits one poll and sees its predicate hold instead of
    raising TimeoutError."""
    clock = _Clock(100.0)
    monkeypatch.setattr(simulated, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    state = SimulatedWorld(2, timeout=0.0)  # rank 1 is not waiting: no deadlock to diagnose
    checks = []

    def predicate():
        checks.append(clock.now)
        return len(checks) > 1

    state.condition = _ClockedCondition(clock)
    state.block_until(0, predicate, "receive from rank 1 (tag 0)")
    assert checks == [100.0, 100.2]
    assert state.waiting == {}


def test_a_wait_gives_up_at_most_one_fifth_of_a_second_past_its_timeout(monkeypatch):
    """With timeout=0.5 s and nobody to notify, the rank re-checks every 0.2 s (0.2, 0.4, 0.6 on
    the test's clock) and raises TimeoutError at the first check past the deadline: 0.1 s late,
    never more than one 0.2 s poll."""
    clock = _Clock()
    monkeypatch.setattr(simulated, "time", types.SimpleNamespace(monotonic=clock.monotonic))
    state = SimulatedWorld(2, timeout=0.5)
    state.condition = _ClockedCondition(clock)
    with pytest.raises(TimeoutError, match=r"^rank 0 waited 0.5 s to receive from rank 1"):
        state.block_until(0, lambda: False, "receive from rank 1 (tag 0)")
    assert state.condition.waits == [0.2, 0.2, 0.2]
    assert 0.5 < clock.now <= 0.5 + 0.2
    assert state.waiting == {}


def test_a_wait_no_rank_ever_notifies_still_ends_in_a_timeout_error():
    """A real condition, a 0.1 s timeout, and no other thread to notify it: the rank must wake by
    itself and raise TimeoutError. The thread is joined for at most 5 s so a wait that never
    wakes fails this test instead of hanging it."""
    state = SimulatedWorld(2, timeout=0.1)
    outcome = []

    def rank0():
        with state.condition:
            try:
                state.block_until(0, lambda: False, "receive from rank 1 (tag 0)")
            except BaseException as error:  # noqa: BLE001 - inspected below
                outcome.append(error)

    thread = threading.Thread(target=rank0, daemon=True)
    thread.start()
    thread.join(timeout=5.0)
    assert not thread.is_alive(), "block_until never woke up to notice its timeout"
    assert len(outcome) == 1 and isinstance(outcome[0], TimeoutError)
    assert str(outcome[0]) == "rank 0 waited 0.1 s to receive from rank 1 (tag 0)"
