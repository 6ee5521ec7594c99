"""An in-process simulated MPI world: ranks are threads, every message recorded, deadlocks caught.

`simulate(n, fn, *args)` runs fn(comm, *args) on n ranks and returns their results. Its communicator
satisfies the same Protocol as the real one (minimp/distributed/protocol.py), so the very same
collective runs here, in a notebook, message by message, and under `mpirun`. Like MPI, a message up
to `eager_limit` bytes is buffered and the sender goes on; a larger one waits until the receiver
takes it (the rendezvous protocol). That is why a ring written as Send-then-Recv works for small
arrays and deadlocks for large ones; here the deadlock raises DeadlockError saying who waits on
whom, instead of hanging.

The world's shared state comes first (mailboxes, the message trace, posted receives, and the
deadlock detector that names who waits on whom), then the requests, then a rank's communicator.
A blocking message is a non-blocking one waited for at once: send, recv and sendrecv (recv and
sendrecv are the Protocol's default bodies).
"""

import threading
import time
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Any, Callable, NoReturn

import numpy as np
from numpy.typing import ArrayLike

from minimp import backend
from minimp.backend import Array
from minimp.distributed.headers import PlanCache
from minimp.distributed.protocol import REDUCE_OPS, Communicator, Tag, byte_view, check_byte_count
from minimp.distributed.protocol import check_op

DEFAULT_EAGER_LIMIT = 64 * 1024  # bytes; MPICH's shared-memory eager threshold is of this order


class DeadlockError(RuntimeError):
    """Every live rank is blocked on a message that no rank can send."""


@dataclass
class Message:
    """One point-to-point message, as recorded in the trace (ranks are world ranks).

    sequence: its place in the global order in which messages were sent; step: the sender's own
    count of messages sent before this one; source, dest: the sending and the receiving rank;
    tag: the message's tag; nbytes: its payload's size in bytes.
    """

    sequence: int
    step: int
    source: int
    dest: int
    tag: int
    nbytes: int


class _Envelope:
    __slots__ = ("payload", "taken")

    def __init__(self, payload: Array):
        self.payload, self.taken = payload, False


class SimulatedWorld:
    """n simulated ranks, run as threads (`run(fn, *args)` gives each a SimulatedCommunicator), and
    their shared state: mailboxes, the trace, who is blocked on what.

    size: the number of ranks n; eager_limit: a message up to this many bytes is buffered and its
    sender goes on, a larger one waits for its receive (as MPI's eager protocol; 64 KiB by
    default); timeout: seconds a rank may wait before a TimeoutError (60 by default).
    """

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
        self.deadlock: str | None = None

    # Called with the condition held by every blocking operation.
    def block_until(self, rank: int, predicate: Callable[[], bool], description: str) -> None:
        """Wait (the condition held) until predicate() holds; raise DeadlockError when every
        live rank waits on something no rank can give, TimeoutError after `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        try:
            while not predicate():
                self.waiting[rank] = (description, predicate)
                self._detect_deadlock()  # keeps the first diagnosis when there is one already
                if self.deadlock:
                    raise DeadlockError(self.deadlock)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank} waited {self.timeout:g} s to {description}")
                self.condition.wait(timeout=0.2)
        finally:
            self.waiting.pop(rank, None)  # returned or raised, this rank waits no more

    def _detect_deadlock(self) -> None:
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

    def run(self, fn: Callable[..., Any], *args: object) -> list:
        """Run fn(comm, *args) on every rank, each on the device current where run was called.
        Returns the results in rank order, or raises the first rank's exception."""
        results: list = [None] * self.size
        errors: dict[int, BaseException] = {}
        device = backend.current_device()  # a new thread would start on MINIMP_DEVICE's

        def body(rank: int) -> None:
            try:
                with device:
                    comm = SimulatedCommunicator(self, rank, list(range(self.size)), ())
                    results[rank] = fn(comm, *args)
                how = "returned"
            except BaseException as error:  # noqa: BLE001 - reported to the caller below
                errors[rank] = error
                how = f"exited with {type(error).__name__}: {error}"
            with self.condition:
                self.finished[rank] = how
                self._detect_deadlock()
                self.condition.notify_all()

        threads = [threading.Thread(target=body, args=(rank,), name=f"rank{rank}", daemon=True)
                   for rank in range(self.size)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if errors:
            # Report a rank's own failure before the deadlocks it caused in the others.
            first = min(errors, key=lambda r: (isinstance(errors[r], DeadlockError), r))
            raise errors[first]
        return results


class PostedReceive:
    """A receive's buffer waiting for its message (under the world's lock)."""

    def __init__(self, target: Array, source: int):
        self.target, self.source, self.done = target, source, False
        self.error: ValueError | None = None

    def deliver(self, envelope: _Envelope) -> None:
        envelope.taken, self.done = True, True
        payload = envelope.payload
        if payload.nbytes < self.target.nbytes:  # MPI puts a short message's bytes at the start
            self.target[:payload.nbytes] = payload
        try:
            check_byte_count(envelope.payload.nbytes, self.target.nbytes, self.source)
            self.target[...] = envelope.payload
        except ValueError as error:  # the receiver's wait() raises it, as MPI's would
            self.error = error

    def raise_if_wrong(self) -> None:
        if self.error is not None:
            raise self.error


@dataclass(eq=False)
class SimulatedRequest:
    """A simulated non-blocking operation: complete when `done()` holds (checked under the world's
    lock); wait() blocks like any simulated call, with deadlock detection, then calls `finish()`
    (a receive raises its error there)."""

    comm: "SimulatedCommunicator"
    done: Callable[[], bool]
    finish: Callable[[], None]
    what: str  # what a deadlock report says the rank waits to do

    def wait(self) -> None:
        world = self.comm.world
        with world.condition:
            world.block_until(self.comm.world_rank, self.done, self.what)
        self.finish()

    def test(self) -> bool:
        with self.comm.world.condition:
            complete = self.done()
        if complete:
            self.finish()
        return complete


class SimulationResults(list):
    """The ranks' return values, in rank order, with the message trace attached as `.trace`."""

    trace: list[Message]


def simulate(size: int, fn: Callable[..., Any], *args: object,
             eager_limit: int = DEFAULT_EAGER_LIMIT, timeout: float = 60.0) -> SimulationResults:
    """Run fn(comm, *args) on `size` in-process ranks; returns their results (with `.trace`)."""
    world = SimulatedWorld(size, eager_limit=eager_limit, timeout=timeout)
    results = SimulationResults(world.run(fn, *args))
    results.trace = world.trace
    return results


class SimulatedCommunicator(Communicator):
    """A rank's view of a SimulatedWorld, or of a group split from it.
    Same API as MPICommunicator.

    world: the SimulatedWorld; rank: this rank's number within the group; members: the group's
    world ranks, in group-rank order; context: a tuple that keeps this group's messages and
    collectives apart from every other group's (`split` extends it).
    """

    def __init__(self, world: SimulatedWorld, rank: int, members: list[int], context: tuple):
        self.world, self.members, self.context = world, members, context
        self.rank, self.size = rank, len(members)  # rank within this group
        self.world_rank = members[rank]
        self.bytes_sent = 0
        self.messages_sent = 0
        self.scalar_allreduces = 0  # allreduce_scalars calls (bytes uncounted, as under MPI)
        self._collective_calls = 0
        # the checked all-reduce's buffers, kept from call to call (minimp/distributed/headers.py)
        self.allreduce_plans = PlanCache()

    def __repr__(self) -> str:
        return f"SimulatedCommunicator(rank={self.rank}, size={self.size})"

    def _post(self, array: Array, dest: int, tag: int) -> _Envelope:
        """Put a copy of the bytes in dest's mailbox (under the lock); returns the envelope."""
        world, payload = self.world, byte_view(array).copy()  # refuses what MPI refuses
        source, target = self.world_rank, self.members[dest]
        record = Message(len(world.trace), world.sends_by_rank[source], source, target, tag,
                         payload.nbytes)
        world.sends_by_rank[source] += 1
        world.trace.append(record)
        envelope = _Envelope(payload)
        key = (self.context, source, target, tag)
        if world.posted[key]:  # a receive is waiting for it (irecv): delivered at once
            world.posted[key].popleft().deliver(envelope)
        else:
            world.mailboxes[key].append(envelope)
        world.condition.notify_all()
        self.bytes_sent += payload.nbytes
        self.messages_sent += 1
        return envelope

    def _start_send(self, array: Array, dest: int, tag: int, what: str) -> SimulatedRequest:
        """Post the bytes now; the request completes at once for an eager message and once the
        receiver has taken a larger one (rendezvous). `what` names the wait ({nbytes}, {dest})."""
        with self.world.condition:
            envelope = self._post(array, dest, tag)
        nbytes, eager = envelope.payload.nbytes, envelope.payload.nbytes <= self.world.eager_limit
        what = what.format(nbytes=nbytes, dest=self.members[dest])
        return SimulatedRequest(self, lambda: eager or envelope.taken, lambda: None, what)

    def send(self, array: Array, dest: int, tag: int = 0) -> None:
        """Returns at once for an eager message and once the receiver has taken a larger one
        (rendezvous), as MPI_Send does."""
        what = "send {nbytes} bytes to rank {dest} (rendezvous: needs a matching receive)"
        self._start_send(array, dest, tag, what).wait()

    def isend(self, array: Array, dest: int, tag: int = 0) -> SimulatedRequest:
        """The bytes are copied and posted now; wait() returns at once for an eager message and
        once the receiver has taken a larger one (rendezvous), as MPI_Wait on an Isend does."""
        return self._start_send(array, dest, tag, "finish a send of {nbytes} bytes to rank {dest}")

    def irecv(self, array: Array, source: int, tag: int = 0) -> SimulatedRequest:
        """A receive posted now: a message already waiting is taken at once; a later one is
        delivered into array the moment it is sent."""
        posted = PostedReceive(byte_view(array), self.members[source])
        with self.world.condition:
            key = (self.context, self.members[source], self.world_rank, tag)
            box = self.world.mailboxes[key]
            if box:
                posted.deliver(box.popleft())
                self.world.condition.notify_all()  # its sender may wait for it to be taken
            else:
                self.world.posted[key].append(posted)
        what = f"receive from rank {self.members[source]} (tag {tag})"
        return SimulatedRequest(self, lambda: posted.done, posted.raise_if_wrong, what)

    def bcast(self, array: Array, root: int = 0) -> None:
        """Root sends to every other rank (a linear broadcast: simple to read in a trace)."""
        if self.rank == root:
            for dest in range(self.size):
                if dest != root:
                    self.send(array, dest, tag=Tag.BROADCAST)
        else:
            self.recv(array, root, tag=Tag.BROADCAST)

    def _collective(self, contribution: object) -> dict[int, Any]:
        """Every rank of the group hands in a contribution; all get the dict of all of them."""
        world = self.world
        key = (self.context, self._collective_calls)
        self._collective_calls += 1
        with world.condition:
            entry = world.collectives.setdefault(key, {})
            entry[self.rank] = contribution
            world.condition.notify_all()
            world.block_until(self.world_rank, lambda: len(entry) == self.size,
                              f"join a collective of {self.size} ranks")
            readers = world.collective_reads.setdefault(key, set())
            readers.add(self.rank)
            if len(readers) == self.size:  # the last reader frees it: long runs do not grow
                del world.collectives[key], world.collective_reads[key]
            return dict(entry)

    def allreduce_scalars(self, values: ArrayLike, op: str = "max") -> np.ndarray:
        check_op(op)
        self.scalar_allreduces += 1
        contributions = self._collective(np.asarray(values, dtype=np.float64).copy())
        return REDUCE_OPS[op].reduce(np.stack([contributions[r] for r in range(self.size)]), axis=0)

    def barrier(self) -> None:
        self._collective(None)

    def node_rank_and_size(self) -> tuple[int, int]:
        """Simulated ranks are threads sharing one process (and its BLAS thread pool): each counts
        as the one rank of its node, so it takes every core."""
        return 0, 1

    def split(self, color: int, key: int = 0) -> "SimulatedCommunicator":
        """Same semantics as MPI_Comm_split: one group per color, ranked by (key, old rank)."""
        contributions = self._collective((color, key))
        group = sorted((k, r) for r, (c, k) in contributions.items() if c == color)
        members = [self.members[r] for _, r in group]
        rank = [r for _, r in group].index(self.rank)
        context = self.context + ((self._collective_calls, color),)
        return SimulatedCommunicator(self.world, rank, members, context)

    def abort(self, code: int = 1) -> NoReturn:
        raise SystemExit(code)
