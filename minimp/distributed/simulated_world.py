"""The shared state of a simulated MPI world: mailboxes, the message trace, posted receives, and
the deadlock detector that names who waits on whom (the ranks themselves: simulated.py)."""

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Callable

DEFAULT_EAGER_LIMIT = 64 * 1024  # bytes; MPICH's shared-memory eager threshold is of this order


class DeadlockError(RuntimeError):
    """Every live rank is blocked on a message that no rank can send."""


@dataclass
class Message:
    """One point-to-point message, as recorded in the trace (ranks are world ranks)."""

    sequence: int  # global order in which messages were sent
    step: int  # the sender's own count of messages sent before this one
    source: int
    dest: int
    tag: int
    nbytes: int


class _Envelope:
    __slots__ = ("payload", "taken")

    def __init__(self, payload):
        self.payload, self.taken = payload, False


class WorldState:
    """The shared state of n simulated ranks: mailboxes, the trace, who is blocked on what."""

    def __init__(self, size: int, eager_limit: int = DEFAULT_EAGER_LIMIT, timeout: float = 60.0):
        if size < 1:
            raise ValueError(f"a world needs at least one rank, got {size}")
        self.size, self.eager_limit, self.timeout = size, eager_limit, timeout
        self.condition = threading.Condition()
        # (context, source, dest, tag) -> envelopes in send order
        self.mailboxes: defaultdict[tuple, deque] = defaultdict(deque)
        # (context, source, dest, tag) -> receives posted (irecv) before their message came
        self.posted: defaultdict[tuple, deque] = defaultdict(deque)
        # (context, call number) -> {rank: contribution}, until all have read it
        self.collectives: dict[tuple, dict] = {}
        self.collective_reads: dict[tuple, set] = {}  # (context, call number) -> ranks that read
        self.waiting: dict[int, tuple] = {}  # world rank -> (description, predicate)
        self.finished: dict[int, str] = {}  # world rank -> "returned" or "exited with ..."
        self.trace: list[Message] = []
        self.sends_by_rank = [0] * size
        self.deadlock = None

    # Called with the condition held by every blocking operation.
    def block_until(self, rank: int, predicate: Callable[[], bool], description: str) -> None:
        """Wait (the condition held) until predicate() holds; raise DeadlockError when every
        live rank waits on something no rank can give, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        while not predicate():
            if self.deadlock:
                raise DeadlockError(self.deadlock)
            self.waiting[rank] = (description, predicate)
            self._detect_deadlock()
            if self.deadlock:
                self.waiting.pop(rank, None)
                raise DeadlockError(self.deadlock)
            if time.monotonic() > deadline:
                self.waiting.pop(rank, None)
                raise TimeoutError(f"rank {rank} waited {self.timeout:g} s to {description}")
            self.condition.wait(timeout=0.2)
        self.waiting.pop(rank, None)

    def _detect_deadlock(self):
        if self.deadlock:
            return  # keep the first diagnosis: later ones only list ranks that died of it
        live = [rank for rank in range(self.size) if rank not in self.finished]
        if not all(rank in self.waiting for rank in live):
            return
        if any(predicate() for _, predicate in (self.waiting[rank] for rank in live)):
            return
        lines = [f"rank {rank} waits to {self.waiting[rank][0]}" for rank in live]
        lines += [f"rank {rank} has {how}" for rank, how in sorted(self.finished.items())]
        self.deadlock = "deadlock: " + "; ".join(lines)
        self.condition.notify_all()
