"""ZeRO's reduce-scatters in flight during backward: each starts once its unit is final.

The overlap of data parallelism (minimp/parallel/data/overlap.py) for ZeRO's units (layout.py):
each unit's reduce-scatter is the first half of minimp's non-blocking ring (RingAllreduce with
all_gather=False, minimp/distributed/ring_nonblocking.py), started by ZeroDataParallel the moment
the unit's gradients are final (stages 2-3: every micro-batch, as without overlap; stage 1: on the
last micro-batch, out of the float32 sums), advanced by every post-accumulate hook that follows,
and waited for when backward is over (stages 2-3: `after_backward`; stage 1: `reduce`).

Each ring has a send and a receive buffer of its own, allocated when it starts and dropped when
it is done (rings in flight at once cannot share ZeRO's one pair); unit u's messages go under tags
GRADIENT_BUCKETS + 2u. The chunks, the messages and the additions are those of
`ring_reduce_scatter_into`, the packing and the use of the result are ZeroDataParallel's own, so
the result is the same to the bit. The waits go in unit order on every rank: a rank blocked on
one ring then never waits for a rank blocked on another.
"""

import time
from typing import Any, Callable, Sequence

from minimp.backend import array_module
from minimp.distributed.protocol import Communicator, Tag
from minimp.distributed.ring_nonblocking import RingAllreduce
from minimp.measure.accounts import BytesSent


class OverlappedUnits:
    """The rings in flight of one ZeroDataParallel, counted as "reduce_scatter"."""

    def __init__(self, comm: Communicator, sent: BytesSent, parameters: int, micro_batches: int):
        """parameters, micro_batches: for stage 1, which starts on the step's last backward."""
        self.comm, self.sent, self.micro_batches = comm, sent, micro_batches
        self.arrivals = [0] * parameters  # stage 1: backwards that reached each, this step
        self.seconds = 0.0  # spent communicating inside backward (starting, testing, adding)
        # unit -> (its ring, what to do with the received array once the ring is done)
        self.in_flight: dict[int, tuple[RingAllreduce, Callable[[Any], None]]] = {}

    def is_last(self, index: int) -> bool:
        """Stage 1: count a backward that reached parameter index; whether it was the step's
        last. One too many would have been sent before its sum was complete: refused."""
        self.arrivals[index] += 1
        if self.arrivals[index] > self.micro_batches:
            raise RuntimeError(
                f"overlap: parameter {index} received {self.arrivals[index]} gradients in a step "
                f"of {self.micro_batches} micro-batches; tell ZeroDataParallel the right "
                "micro_batches, or turn overlap off"
            )
        return self.arrivals[index] == self.micro_batches

    def new_buffers(self, like: Any, size: int) -> tuple[Any, Any]:
        """A send and a receive buffer for one ring: size elements of like's dtype and device."""
        xp = array_module(like)
        return xp.empty(size, like.dtype), xp.empty(size, like.dtype)

    def start(
        self, unit: int, send: Any, receive: Any, bounds: Sequence, then: Callable[[Any], None]
    ) -> None:
        """Start unit's reduce-scatter of send (packed) into receive; then(receive) runs when
        receive[bounds[rank]] holds this rank's chunk of the sum."""
        if unit in self.in_flight:
            raise RuntimeError(f"overlap: unit {unit} started again while its ring is in flight")
        tags = (Tag.GRADIENT_BUCKETS + 2 * unit, Tag.GRADIENT_BUCKETS + 2 * unit + 1)
        started = time.perf_counter()
        with self.sent.counting(self.comm, "reduce_scatter"):
            ring = RingAllreduce(
                self.comm, send, receive, tags=tags, bounds=bounds, all_gather=False
            )
            self.in_flight[unit] = (ring, then)
        self.seconds += time.perf_counter() - started
        self.progress()

    def progress(self) -> None:
        """Advance every ring in flight as far as it goes without waiting; finish those done."""
        started = time.perf_counter()
        with self.sent.counting(self.comm, "reduce_scatter"):
            for unit, (ring, then) in list(self.in_flight.items()):
                if ring.progress():
                    del self.in_flight[unit]
                    then(ring.out)
        self.seconds += time.perf_counter() - started

    def wait(self) -> None:
        """Block until every ring in flight is done and finished, in unit order."""
        with self.sent.counting(self.comm, "reduce_scatter"):
            for unit in sorted(self.in_flight):
                ring, then = self.in_flight.pop(unit)
                ring.wait()
                then(ring.out)

    def buffers(self) -> list[Any]:
        """The send and receive buffers of the rings in flight (for the memory account)."""
        return [array for ring, _ in self.in_flight.values() for array in (ring.x, ring.out)]
