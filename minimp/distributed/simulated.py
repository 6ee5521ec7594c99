"""An in-process simulated MPI world: ranks are threads, every message recorded, deadlocks caught.

`simulate(n, fn, *args)` runs fn(comm, *args) on n ranks and returns their results. Its communicator
satisfies the same Protocol as the real one (minimp/distributed/protocol.py), so the very same
collective runs here, in a notebook, message by message, and under `mpirun`. Like MPI, a message up
to `eager_limit` bytes is buffered and the sender goes on; a larger one waits until the receiver
takes it (the rendezvous protocol). That is why a ring written as Send-then-Recv works for small
arrays and deadlocks for large ones; here the deadlock raises DeadlockError saying who waits on
whom, instead of hanging.
"""

import threading
from typing import Any, Callable

import numpy as np

from minimp.distributed.protocol import (
    REDUCE_OPS,
    Communicator,
    Tag,
    byte_view,
    check_byte_count,
    check_op,
)
from minimp.distributed.simulated_world import (
    DEFAULT_EAGER_LIMIT,
    DeadlockError,
    Message,
    WorldState,
    _Envelope,
)

class SimulatedWorld(WorldState):
    """n simulated ranks, run as threads: `run(fn, *args)` gives each a SimulatedCommunicator."""

    def run(self, fn: Callable, *args: Any) -> list:
        """Run fn(comm, *args) on every rank.
        Returns the results in rank order, or raises the first rank's exception."""
        results, errors = [None] * self.size, {}

        def body(rank):
            try:
                results[rank] = fn(
                    SimulatedCommunicator(self, rank, list(range(self.size)), ()), *args
                )
                how = "returned"
            except BaseException as error:  # noqa: BLE001 - reported to the caller below
                errors[rank] = error
                how = f"exited with {type(error).__name__}: {error}"
            with self.condition:
                self.finished[rank] = how
                self._detect_deadlock()
                self.condition.notify_all()

        threads = [
            threading.Thread(target=body, args=(rank,), name=f"rank{rank}", daemon=True)
            for rank in range(self.size)
        ]
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

    def __init__(self, target: Any, source: int):
        self.target, self.source, self.done = target, source, False
        self.error: ValueError | None = None

    def deliver(self, envelope: _Envelope) -> None:
        envelope.taken, self.done = True, True
        try:
            check_byte_count(envelope.payload.nbytes, self.target.nbytes, self.source)
            self.target[...] = envelope.payload
        except ValueError as error:  # the receiver's wait() raises it, as MPI's would
            self.error = error

    def raise_if_wrong(self) -> None:
        if self.error is not None:
            raise self.error


class SimulatedRequest:
    """A simulated non-blocking operation: complete when `done()` holds (checked under the world's
    lock); wait() blocks like any simulated call, with deadlock detection."""

    def __init__(self, comm: Any, done: Callable[[], bool], finish: Callable, what: str):
        self.comm, self.done, self.finish, self.what = comm, done, finish, what

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

    trace: list[Message] = []


def simulate(
    size: int,
    fn: Callable,
    *args: Any,
    eager_limit: int = DEFAULT_EAGER_LIMIT,
    timeout: float = 60.0,
) -> SimulationResults:
    """Run fn(comm, *args) on `size` in-process ranks; returns their results (with `.trace`)."""
    world = SimulatedWorld(size, eager_limit=eager_limit, timeout=timeout)
    results = SimulationResults(world.run(fn, *args))
    results.trace = world.trace
    return results


class SimulatedCommunicator(Communicator):
    """A rank's view of a SimulatedWorld, or of a group split from it.
    Same API as MPICommunicator."""

    def __init__(self, world: SimulatedWorld, rank: int, members: list[int], context: tuple):
        self.world, self.members, self.context = world, members, context
        self.rank, self.size = rank, len(members)  # rank within this group
        self.world_rank = members[rank]
        self.bytes_sent = 0
        self.messages_sent = 0
        self.scalar_allreduces = 0  # allreduce_scalars calls (their bytes are MPI's, not counted)
        self._collective_calls = 0

    def __repr__(self) -> str:
        return f"SimulatedCommunicator(rank={self.rank}, size={self.size})"

    def _post(self, array, dest, tag):
        """Put a copy of the bytes in dest's mailbox (under the lock); returns the envelope."""
        world, payload = self.world, byte_view(array).copy()  # refuses what MPI refuses
        source, target = self.world_rank, self.members[dest]
        record = Message(
            len(world.trace), world.sends_by_rank[source], source, target, tag, payload.nbytes
        )
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

    def _await_delivery(self, envelope, dest):
        """Large messages wait for the receiver (rendezvous); small ones were buffered (eager)."""
        if envelope.payload.nbytes > self.world.eager_limit:
            self.world.block_until(
                self.world_rank,
                lambda: envelope.taken,
                f"send {envelope.payload.nbytes} bytes to rank {self.members[dest]} "
                "(rendezvous: needs a matching receive)",
            )

    def _take(self, array, source, tag):
        box = self.world.mailboxes[(self.context, self.members[source], self.world_rank, tag)]
        self.world.block_until(
            self.world_rank,
            lambda: bool(box),
            f"receive from rank {self.members[source]} (tag {tag})",
        )
        envelope = box.popleft()
        envelope.taken = True
        self.world.condition.notify_all()
        target = byte_view(array)
        check_byte_count(envelope.payload.nbytes, target.nbytes, self.members[source])
        target[...] = envelope.payload

    def send(self, array: Any, dest: int, tag: int = 0) -> None:
        with self.world.condition:
            self._await_delivery(self._post(array, dest, tag), dest)

    def recv(self, array: Any, source: int, tag: int = 0) -> None:
        with self.world.condition:
            self._take(array, source, tag)

    def isend(self, array: Any, dest: int, tag: int = 0) -> "SimulatedRequest":
        """The bytes are copied and posted now; wait() returns at once for an eager message and
        once the receiver has taken a larger one (rendezvous), as MPI_Wait on an Isend does."""
        with self.world.condition:
            envelope = self._post(array, dest, tag)
        eager = envelope.payload.nbytes <= self.world.eager_limit
        what = f"finish a send of {envelope.payload.nbytes} bytes to rank {self.members[dest]}"
        return SimulatedRequest(self, lambda: eager or envelope.taken, lambda: None, what)

    def irecv(self, array: Any, source: int, tag: int = 0) -> "SimulatedRequest":
        """A receive posted now: a message already waiting is taken at once; a later one is
        delivered into array the moment it is sent."""
        posted = PostedReceive(byte_view(array), self.members[source])
        with self.world.condition:
            key = (self.context, self.members[source], self.world_rank, tag)
            box = self.world.mailboxes[key]
            if box:
                posted.deliver(box.popleft())
            else:
                self.world.posted[key].append(posted)
        what = f"receive from rank {self.members[source]} (tag {tag})"
        return SimulatedRequest(self, lambda: posted.done, posted.raise_if_wrong, what)

    def sendrecv(
        self,
        send_array: Any,
        dest: int,
        recv_array: Any,
        source: int,
        tag: int = 0,
        recv_tag: int | None = None,
    ) -> None:
        with self.world.condition:
            envelope = self._post(send_array, dest, tag)
            self._take(recv_array, source, tag if recv_tag is None else recv_tag)
            self._await_delivery(envelope, dest)

    def bcast(self, array: Any, root: int = 0) -> None:
        """Root sends to every other rank (a linear broadcast: simple to read in a trace)."""
        if self.rank == root:
            for dest in range(self.size):
                if dest != root:
                    self.send(array, dest, tag=Tag.BROADCAST)
        else:
            self.recv(array, root, tag=Tag.BROADCAST)

    def _collective(self, contribution):
        """Every rank of the group hands in a contribution; all get the dict of all of them."""
        world = self.world
        key = (self.context, self._collective_calls)
        self._collective_calls += 1
        with world.condition:
            entry = world.collectives.setdefault(key, {})
            entry[self.rank] = contribution
            world.condition.notify_all()
            world.block_until(
                self.world_rank,
                lambda: len(entry) == self.size,
                f"join a collective of {self.size} ranks",
            )
            readers = world.collective_reads.setdefault(key, set())
            readers.add(self.rank)
            if len(readers) == self.size:  # the last reader frees it: long runs do not grow
                del world.collectives[key], world.collective_reads[key]
            return dict(entry)

    def allreduce_scalars(self, values: Any, op: str = "max") -> np.ndarray:
        check_op(op)
        self.scalar_allreduces += 1
        contributions = self._collective(np.asarray(values, dtype=np.float64).copy())
        return REDUCE_OPS[op].reduce(np.stack([contributions[r] for r in range(self.size)]), axis=0)

    def barrier(self) -> None:
        self._collective(None)

    def ranks_on_this_node(self) -> int:
        """Simulated ranks are threads sharing one process (and its BLAS thread pool): count one."""
        return 1

    def node_rank_and_size(self) -> tuple[int, int]:
        return 0, 1

    def split(self, color: int, key: int = 0) -> "SimulatedCommunicator":
        """Same semantics as MPI_Comm_split: one group per color, ranked by (key, old rank)."""
        contributions = self._collective((color, key))
        group = sorted((k, r) for r, (c, k) in contributions.items() if c == color)
        members = [self.members[r] for _, r in group]
        rank = [r for _, r in group].index(self.rank)
        return SimulatedCommunicator(
            self.world, rank, members, self.context + ((self._collective_calls, color),)
        )

    def abort(self, code: int = 1) -> None:
        raise SystemExit(code)
