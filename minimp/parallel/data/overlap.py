"""Gradients reduced during backward, what both overlaps share: the hooks and the rings in flight.

Each bucket's all-reduce (data parallelism) or each unit's reduce-scatter (ZeRO) starts as soon as
its last gradient is final, and runs while backward goes on. PyTorch DDP's overlap (Li et al.
2020, "PyTorch Distributed", section 3.2.3), built on minimp's non-blocking ring
(minimp/distributed/ring_nonblocking.py). Both overlaps keep their rings in flight the same way
(`RingsInFlight`): each ring's messages go under two tags of its own, GRADIENT_BUCKETS + 2k and
+ 2k + 1 for bucket or unit k; every post-accumulate hook that follows advances every ring in
flight; what is still in flight when backward ends is waited for, in order of k on every rank, so
a rank blocked on one ring never waits for a rank blocked on another.

Data parallelism (`OverlappedBuckets`, in data_parallel.py). DataParallel plans the buckets from
the last parameter to the first, the order in which backward completes them. On the last
micro-batch of a step (the earlier ones only accumulate, like DDP's `no_sync`), each parameter's
post-accumulate hook adds its gradient into its float32 sum at once; when every parameter of the
next bucket is final, the bucket is packed and its ring starts (buckets start in plan order on
every rank). What is still in flight when backward ends is what `finalize_backward` waits for.

The bytes are those of DataParallel without overlap, packed, reduced and unpacked by the same
functions, so the result is the same to the bit. The one difference is what travels: without
overlap the step agrees on an overflow before the reduction and sends nothing non-finite; with it,
the buckets leave before anyone has checked them. The step's decisions do not change: a
non-finite gradient on any replica makes the reduced mean non-finite at the same element on every
replica (inf and NaN survive the 1/p, the 16-bit rounding and the sum), so the check of the
reduced gradients finds it, and every replica skips the step, as without overlap.

ZeRO (`OverlappedUnits`, in zero/data_parallel.py, for ZeRO's units: zero/layout.py). Each unit's
reduce-scatter is the first half of the non-blocking ring (RingAllreduce with all_gather=False),
started by ZeroDataParallel the moment the unit's gradients are final (stages 2-3: every
micro-batch, as without overlap; stage 1: on the last micro-batch, out of the float32 sums) and
waited for when backward is over (stages 2-3: `after_backward`; stage 1: `finalize_backward`).
Each ring has a send and a receive buffer of its own, allocated when it starts and dropped when it
is done (rings in flight at once cannot share ZeRO's one pair). The chunks, the messages and the
additions are those of `ring_reduce_scatter_into`, the packing and the use of the result are
ZeroDataParallel's own, so the result is the same to the bit.

On the fp8 wire (--grad-comm-dtype fp8) both overlaps' rings are distributed/ring_fp8.py's
`Fp8RingInFlight`: the blocking fp8 ring's encodes, messages and float32 additions in its order,
so again the bits and the bytes of --no-overlap.
"""

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from minimp.backend import Array
from minimp.distributed.protocol import Communicator, Tag
from minimp.distributed.ring_fp8 import Fp8RingInFlight
from minimp.distributed.ring_nonblocking import RingAllreduce
from minimp.measure.accounts import BytesSent
from minimp.precision.wire import Fp8Wire
from minimp.tensor import RemovableHandle, Tensor


def hook_each(params: Sequence[Tensor], arrived: Callable[[int], None]) -> list[RemovableHandle]:
    """Call arrived(index) each time backward has added params[index]'s gradient into .grad."""

    def hook(index: int) -> Callable[[Tensor], None]:
        return lambda parameter: arrived(index)

    return [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]


def refuse_incomplete(index: int, count: int, micro_batches: int, sync: str) -> None:
    """A parameter reached by more backwards (count) than there were micro-batches would have
    been sent before its sum was complete: refuse instead of averaging a wrong gradient."""
    if count > micro_batches:
        raise RuntimeError(f"overlap: parameter {index} received {count} gradients in a step of "
                           f"{micro_batches} micro-batches, so it was sent before it was "
                           f"complete; tell {sync} the right micro_batches, or turn overlap off")


class RingsInFlight:
    """Rings started during backward, by key (a bucket, a unit), and what to do with each result;
    the bytes they send go into `sent` under one collective's name. With an Fp8Wire the rings are
    ring_fp8.py's Fp8RingInFlight (float32 buffers, each chunk sent as fp8 with its scale)."""

    def __init__(self, comm: Communicator, sent: BytesSent, collective: str,
                 wire: Fp8Wire | None = None):
        self.comm, self.sent, self.collective, self.wire = comm, sent, collective, wire
        # seconds spent communicating inside backward (packing, starting, testing, adding)
        self.seconds = 0.0
        # key -> (its ring, what to do with the received array once the ring is done)
        self.in_flight: dict[int, tuple[RingAllreduce | Fp8RingInFlight,
                                        Callable[[Array], None]]] = {}

    @contextmanager
    def communicating(self) -> Iterator[None]:
        """Time what runs inside (into `seconds`) and count the bytes it sends."""
        started = time.perf_counter()
        with self.sent.counting(self.comm, self.collective):
            yield
        self.seconds += time.perf_counter() - started

    def _launch(self, key: int, send: Array, receive: Array, then: Callable[[Array], None],
                bounds: Sequence[tuple[int, int]] | None = None) -> None:
        """Start key's ring of send (packed) into receive: the whole all-reduce, or with bounds
        the reduce-scatter over those chunks; then(receive) runs once it is done."""
        if key in self.in_flight:
            raise RuntimeError(f"overlap: {key} started again while its ring is in flight")
        tags = (Tag.GRADIENT_BUCKETS + 2 * key, Tag.GRADIENT_BUCKETS + 2 * key + 1)
        whole = bounds is None  # an all-reduce; else the reduce-scatter half
        ring: RingAllreduce | Fp8RingInFlight
        if self.wire is not None:
            ring = Fp8RingInFlight(self.comm, send, receive, self.wire, tags=tags, bounds=bounds,
                                   all_gather=whole)
        else:
            ring = RingAllreduce(self.comm, send, receive, tags=tags, bounds=bounds,
                                 all_gather=whole)
        self.in_flight[key] = (ring, then)

    def _advance(self) -> None:
        """Advance every ring in flight as far as it goes without waiting; finish those done."""
        for key, (ring, then) in list(self.in_flight.items()):
            if ring.progress():
                del self.in_flight[key]
                then(ring.out)

    def _wait_all(self) -> None:
        """Block until every ring in flight is done and finished, in key order."""
        for key in sorted(self.in_flight):
            ring, then = self.in_flight.pop(key)
            ring.wait()
            then(ring.out)

    def buffers(self) -> list[Array]:
        """The buffers of the rings in flight (for the memory account): send and receive, and on
        the fp8 wire the two message buffers."""
        return [array for ring, _ in self.in_flight.values() for array in ring.buffers()]
