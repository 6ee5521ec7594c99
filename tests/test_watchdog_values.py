"""minimp/distributed/mpi.py's Watchdog in this process, on a clock the test sets: when it
aborts (a wait older than the timeout, and only then), with which message, how often it looks,
which communicators it reads, and MPICommunicator.start_watchdog's wiring to print_and_abort.
The watchdog ending a real job whose rank froze is checked under mpirun
(tests/test_distributed_mpi.py)."""

import inspect
import math
import threading
import time

import pytest

from minimp.distributed import launch, mpi
from minimp.distributed.mpi import MPICommunicator, Waiting, Watchdog

NOW = 100.0  # what the stand-in clock reads; ages below are exact in binary


class Clock:
    """Stands in for the `time` module inside mpi.py (the watchdog's clock): monotonic() reads
    `now`; sleep() records what it was asked for and sleeps at most a millisecond (refusing what
    time.sleep refuses), so a check comes fast and a wait is exactly as old as the test made it."""

    def __init__(self):
        self.now, self.sleeps = NOW, []
        self._slept = threading.Condition()

    def monotonic(self):
        return self.now

    def sleep(self, seconds):
        with self._slept:
            self.sleeps.append(seconds)
            self._slept.notify_all()
        time.sleep(min(seconds, 0.001))

    def wait_for_sleeps(self, count):
        """Block until the watchdog asked for `count` sleeps: count - 1 checks are done."""
        with self._slept:
            assert self._slept.wait_for(lambda: len(self.sleeps) >= count, timeout=5.0)


class Aborts:
    """The watchdog's abort: records each message and sets `called`."""

    def __init__(self):
        self.messages, self.called = [], threading.Event()

    def __call__(self, message):
        self.messages.append(message)
        self.called.set()


class Comm:
    """A watched communicator: only its `waiting` attribute matters to the watchdog."""

    def __init__(self, waiting=None):
        self.waiting = waiting


def waiting_for(operation, peer, age):
    """A Waiting stamped `age` seconds before the stand-in clock's now."""
    stamp = Waiting(operation, peer)
    stamp.since = NOW - age
    return stamp


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(mpi, "time", clock)
    return clock


@pytest.fixture
def dogs(clock):
    """Make watchdogs on the stand-in clock; each one's thread is ended after the test."""
    made = []

    def make(timeout, rank=0, abort=None):
        dog = Watchdog(timeout, rank, abort if abort is not None else Aborts())
        made.append(dog)
        return dog

    yield make
    for dog in made:
        dog.fired = True
        dog._thread.join(timeout=5.0)


def test_a_wait_older_than_the_timeout_aborts_once_with_who_waited_for_what(dogs, clock):
    aborts = Aborts()
    dog = dogs(30.0, rank=3, abort=aborts)
    assert dog.fired is False  # not yet
    dog.watch(Comm(waiting_for("receive from", 2, age=42.0)))
    assert aborts.called.wait(timeout=5.0)
    dog._thread.join(timeout=5.0)
    assert not dog._thread.is_alive() and dog.fired is True
    assert aborts.messages == [
        "[rank 3] minimp: waited 42 s to receive from rank 2; a rank is frozen, deadlocked or far"
        " slower than the others. Aborting the job (--timeout 30 s)."
    ]


@pytest.mark.parametrize("age", [0.25, 0.5], ids=["younger", "exactly-the-timeout"])
def test_a_wait_not_older_than_the_timeout_does_not_abort(dogs, clock, age):
    aborts = Aborts()
    dog = dogs(0.5, abort=aborts)  # a timeout under a second is allowed
    dog.watch(Comm(waiting_for("meet all 4 ranks at a barrier", None, age=age)))
    clock.wait_for_sleeps(4)  # three checks done
    assert aborts.messages == [] and dog.fired is False


def test_every_watched_communicator_is_looked_at(dogs, clock):
    # one that waits for nothing, one without a `waiting` attribute at all, one frozen: the
    # frozen one, watched last, is the one reported
    aborts = Aborts()
    dog = dogs(0.5, rank=1, abort=aborts)
    dog.watch(object())
    dog.watch(Comm())
    dog.watch(Comm(waiting_for("broadcast from", 0, age=0.25)))
    dog.watch(Comm(waiting_for("send to", 5, age=2.75)))
    assert aborts.called.wait(timeout=5.0)
    (message,) = aborts.messages
    assert message.startswith("[rank 1] minimp: waited 3 s to send to rank 5;")
    assert message.endswith("(--timeout 0.5 s).")


def test_a_communicator_watched_later_is_watched_too(dogs, clock):
    aborts = Aborts()
    dog = dogs(0.5, abort=aborts)
    clock.wait_for_sleeps(3)
    assert aborts.messages == []
    dog.watch(Comm(waiting_for("all-reduce (max) with all 2 ranks", None, age=1.0)))
    assert aborts.called.wait(timeout=5.0)
    assert "to all-reduce (max) with all 2 ranks;" in aborts.messages[0]


@pytest.mark.parametrize(
    "timeout, period", [(50.0, 1.0), (10.0, 1.0), (2.0, 0.2), (0.05, 0.005)]
)
def test_the_watchdog_looks_every_tenth_of_the_timeout_but_at_least_every_second(
    dogs, clock, timeout, period
):
    dogs(timeout)
    clock.wait_for_sleeps(2)
    assert clock.sleeps[:2] == [pytest.approx(period, rel=1e-12)] * 2


def test_the_watchdog_thread_is_a_named_daemon(dogs):
    # a daemon: it never keeps a finished job alive; named, so a stack dump says what it is
    dog = dogs(3600.0)
    assert dog._thread.daemon is True and dog._thread.name == "minimp-watchdog"
    assert dog._thread.is_alive()


@pytest.mark.parametrize("timeout", [0.0, -1.0, math.nan])
def test_a_timeout_must_be_positive(dogs, timeout):
    with pytest.raises(ValueError, match="a watchdog needs a positive timeout"):
        dogs(timeout)


class OneOfFour:
    """An mpi4py communicator of which this process is rank 3 of 4; no call reaches it."""

    def Get_rank(self):
        return 3

    def Get_size(self):
        return 4


def test_start_watchdog_prints_the_ranks_message_and_aborts_the_job_with_code_3(
    clock, capfd
):
    comm = MPICommunicator(OneOfFour())
    codes, aborted = [], threading.Event()

    def abort(code):  # stands in for MPI_Abort on COMM_WORLD
        codes.append(code)
        aborted.set()

    comm.abort = abort
    comm.start_watchdog(30.0)
    try:
        comm._wait("meet all 4 ranks at a barrier")  # stamped at the clock's now
        clock.now += 42.0
        assert aborted.wait(timeout=5.0)
    finally:
        comm._watchdog.fired = True
        comm._watchdog._thread.join(timeout=5.0)
    assert codes == [3]
    assert capfd.readouterr().err == (
        "[rank 3] minimp: waited 42 s to meet all 4 ranks at a barrier; a rank is frozen,"
        " deadlocked or far slower than the others. Aborting the job (--timeout 30 s).\n"
    )


def test_print_and_abort_writes_then_pauses_as_long_as_launch_does_then_aborts(clock, capfd):
    # the pause lets mpirun forward the line before MPI_Abort tears the job down: the same
    # pause as launch's for a failing rank's message (docs/reliability.md: 0.5 s)
    pause = inspect.signature(launch.flush_and_pause).parameters["seconds"].default
    seen = []

    def abort(code):  # what had happened when MPI_Abort was called
        seen.append((code, list(clock.sleeps), capfd.readouterr().err))

    mpi.print_and_abort(abort)("[rank 1] minimp: waited 42 s")
    assert seen == [(3, [pause], "[rank 1] minimp: waited 42 s\n")]
