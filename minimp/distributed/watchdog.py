"""The watchdog: end the whole job when one communication waits longer than a timeout.

MPI has no timeouts: a receive from a rank that froze (SIGSTOP, a deadlocked peer, a hung GPU)
waits forever, and so does the job. PyTorch's process groups therefore abort a collective that
takes longer than their timeout; this is minimp's version. Each blocking call of an
MPICommunicator stamps "waiting since t, for this operation" before it enters MPI and clears the
stamp after (two attribute writes: small messages do not pay for the watch). One daemon thread
looks at the stamps a few times per timeout and, when one is older than the timeout, prints which
rank waited for what and aborts the job. The timeout must be longer than every legitimate wait
(evaluation on rank 0, gathering a checkpoint, a first GPU kernel compile).
"""

import os
import sys
import threading
import time
from typing import Callable


class Waiting:
    """What a communicator is blocked in: since when (time.monotonic), which call, with whom."""

    __slots__ = ("since", "operation", "peer")

    def __init__(self, operation: str, peer: int | None):
        self.since, self.operation, self.peer = time.monotonic(), operation, peer

    def describe(self) -> str:
        return self.operation if self.peer is None else f"{self.operation} rank {self.peer}"


class Watchdog:
    """A daemon thread that calls `abort(message)` when a watched communicator's current wait is
    older than `timeout` seconds. Watch a communicator with `watch(comm)` (its `waiting`
    attribute is read, never written, by the thread)."""

    def __init__(self, timeout: float, rank: int, abort: Callable[[str], None]):
        if not timeout > 0:
            raise ValueError(f"a watchdog needs a positive timeout, got {timeout}")
        self.timeout, self.rank, self.abort = timeout, rank, abort
        self.watched: list = []
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="minimp-watchdog", daemon=True)
        self._thread.start()

    def watch(self, comm: object) -> None:
        self.watched.append(comm)

    def _run(self) -> None:
        period = min(1.0, self.timeout / 10)
        while not self.fired:
            time.sleep(period)
            now = time.monotonic()
            for comm in tuple(self.watched):
                waiting = getattr(comm, "waiting", None)
                if waiting is not None and now - waiting.since > self.timeout:
                    self.fired = True
                    self.abort(
                        f"[rank {self.rank}] minimp: waited {now - waiting.since:.0f} s to "
                        f"{waiting.describe()}; a rank is frozen, deadlocked or far slower than "
                        f"the others. Aborting the job (--timeout {self.timeout:g} s)."
                    )
                    return


def print_and_abort(abort: Callable[[int], None]) -> Callable[[str], None]:
    """The watchdog's action under MPI: the message straight to stderr, a moment for mpirun to
    forward it, then MPI_Abort of the whole job (from this thread: MPI runs THREAD_MULTIPLE)."""

    def act(message: str) -> None:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
        time.sleep(0.5)
        abort(3)

    return act
