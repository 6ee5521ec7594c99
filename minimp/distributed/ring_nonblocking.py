"""The ring all-reduce as a state machine of non-blocking messages: start it, advance it, wait.

The same chunks, the same messages and the same additions in the same order as `ring_allreduce`
(minimp/distributed/ring.py), so the same bits; but each of its 2(p - 1) steps is an irecv from the
left and an isend to the right, posted when the step before it has completed, and nothing waits
unless asked to. Whoever holds it calls `progress()` between other work (data parallelism calls it
from backward's hooks, minimp/parallel/data/overlap.py): progress tests the step in flight and, once
both of its messages are complete, adds the received chunk and posts the next step.

Why no communication thread: every MPI call is made by the thread that runs backward, between two
of its ops, so the MPI library only needs MPI_THREAD_FUNNELED (MPI_THREAD_SINGLE would do for
this code; minimp asks for more only because its watchdog may call MPI_Abort from another thread),
the simulated world runs it as it is, message by message, and the order of every addition is fixed
by the program, not by a scheduler. The price: a step finishes only when somebody calls progress()
or wait(), so between two hooks a finished step waits for the next hook.
"""

from minimp.backend import Array
from minimp.distributed.buffers import reduce_into
from minimp.distributed.protocol import Communicator, Request, Tag, check_op
from minimp.distributed.ring import Bounds, chunk_bounds, ring_step


class RingSteps:
    """What every ring posted step by step shares: its 2(p - 1) steps (p - 1 with all_gather
    False), `done`, `progress()` and `wait()`. A subclass posts a step's two messages in `_post`
    and, once both are complete, uses what arrived and posts the next in `_finish_step`."""

    def _begin(self, comm: Communicator, x: Array, out: Array, tags: tuple[int, int],
               bounds: Bounds | None, all_gather: bool) -> None:
        self.comm, self.x, self.out, self.tags = comm, x, out, tags
        self.bounds = chunk_bounds(x.size, comm.size) if bounds is None else bounds
        # p - 1 steps of the reduce-scatter, then (unless stopped there) p - 1 of the gather.
        self.steps = (2 if all_gather else 1) * (comm.size - 1)
        self.step = 0
        self.requests: list[Request] = []

    def _start(self) -> None:
        """Post the first step (one rank: the result is x)."""
        if self.comm.size == 1:
            self.out[...] = self.x
        else:
            self._post()

    @property
    def done(self) -> bool:
        """Whether out holds the result."""
        return self.step == self.steps

    def progress(self) -> bool:
        """Advance as far as possible without waiting; returns `done`."""
        while not self.done:
            complete = [request.test() for request in self.requests]  # test each: each progresses
            if not all(complete):
                break
            self._finish_step()
        return self.done

    def wait(self) -> None:
        """Block until out holds the result."""
        while not self.done:
            for request in self.requests:
                request.wait()
            self._finish_step()

    def _post(self) -> None:
        raise NotImplementedError

    def _finish_step(self) -> None:
        raise NotImplementedError


class RingAllreduce(RingSteps):
    """One ring all-reduce of the flat, contiguous array x into out (same dtype and size, not
    overlapping x), in flight from construction until `progress()` returns True or `wait()` returns.
    Neither array may be touched meanwhile (MPI may still read x and write out).

    Unlike ring_allreduce it does not first check that every rank passes the same length and dtype
    (that check is a blocking collective, a synchronisation point an overlap cannot afford): the
    callers plan their buckets alike on every rank."""

    def __init__(self, comm: Communicator, x: Array, out: Array, op: str = "sum",
                 tags: tuple[int, int] = (Tag.RING_REDUCE_SCATTER, Tag.RING_ALL_GATHER), *,
                 bounds: Bounds | None = None, all_gather: bool = True):
        """tags: the reduce-scatter's and the all-gather's. Rings in flight at the same time on
        one communicator need tags of their own: MPI matches a message to the first receive
        posted for its (source, tag), whichever ring posted it. bounds: the chunks (by default
        chunk_bounds(x.size, p)). all_gather=False stops after the reduce-scatter half, as
        `ring_reduce_scatter_into`: out[bounds[rank]] then holds this rank's chunk of the sum
        (ZeRO's reduce-scatters during backward, minimp/parallel/data/overlap.py)."""
        check_op(op)
        if out.size != x.size or out.dtype != x.dtype:
            raise ValueError(f"out must be a {x.dtype} array of {x.size} elements")
        self.op = op
        self._begin(comm, x, out, tags, bounds, all_gather)
        self._start()

    def buffers(self) -> list[Array]:
        """What it holds while in flight: x and out."""
        return [self.x, self.out]

    def _chunks(self) -> tuple[Array, Array, tuple[int, int], int]:
        """(outgoing, incoming, incoming's bounds, tag) of the current step, as ring.py has them:
        reduce-scatter step s sends chunk (r - s - 1) and receives chunk (r - s - 2); all-gather
        step s sends chunk (r - s) and receives chunk (r - s - 1), all mod p."""
        p, step = self.comm.size, self.step
        reduce_scatter = step < p - 1
        behind = step + 1 if reduce_scatter else step - (p - 1)
        (send_start, send_stop), receive = ring_step(self.comm, self.bounds, behind)
        # At step 0 we send our own share; later, the partial sum we finished a step earlier.
        outgoing = (self.x if step == 0 else self.out)[send_start:send_stop]
        tag = self.tags[0] if reduce_scatter else self.tags[1]
        return outgoing, self.out[receive[0] : receive[1]], receive, tag

    def _post(self) -> None:
        outgoing, incoming, _, tag = self._chunks()
        left, right = (self.comm.rank - 1) % self.comm.size, (self.comm.rank + 1) % self.comm.size
        # The receive first: a message that arrives early then lands straight in its place.
        self.requests = [self.comm.irecv(incoming, left, tag=tag),
                         self.comm.isend(outgoing, right, tag=tag)]

    def _finish_step(self) -> None:
        """Both messages of the step are complete: add (reduce-scatter), then post the next."""
        _, incoming, (start, stop), _ = self._chunks()
        if self.step < self.comm.size - 1:
            reduce_into(incoming, self.x[start:stop], self.op)
        self.step += 1
        self.requests = []
        if not self.done:
            self._post()
