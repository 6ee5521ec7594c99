"""Gradients reduced during backward: each bucket's all-reduce (data parallelism) or each unit's
reduce-scatter (ZeRO) starts as soon as its last gradient is final, and runs while backward goes on.

PyTorch DDP's overlap (Li et al. 2020, "PyTorch Distributed", section 3.2.3), built on minimp's
non-blocking ring (minimp/distributed/ring_nonblocking.py). Both overlaps keep their rings in
flight the same way (`RingsInFlight`): each ring's messages go under two tags of its own,
GRADIENT_BUCKETS + 2k and + 2k + 1 for bucket or unit k; every post-accumulate hook that follows
advances every ring in flight; what is still in flight when backward ends is waited for, in order
of k on every rank, so a rank blocked on one ring never waits for a rank blocked on another.

Data parallelism (`OverlappedBuckets`). DataParallel plans the buckets from the last parameter to
the first, the order in which backward completes them. On the last micro-batch of a step (the
earlier ones only accumulate, like DDP's `no_sync`), each parameter's post-accumulate hook adds its
gradient into its float32 sum at once; when every parameter of the next bucket is final, the
bucket is packed and its ring starts (buckets start in plan order on every rank). What is still in
flight when backward ends is what `finalize_backward` waits for.

The bytes are those of DataParallel without overlap, packed, reduced and unpacked by the same
functions, so the result is the same to the bit. The one difference is what travels: without
overlap the step agrees on an overflow before the reduction and sends nothing non-finite; with it,
the buckets leave before anyone has checked them. The step's decisions do not change: a
non-finite gradient on any replica makes the reduced mean non-finite at the same element on every
replica (inf and NaN survive the 1/p, the 16-bit rounding and the sum), so the check of the
reduced gradients finds it, and every replica skips the step, as without overlap.

ZeRO (`OverlappedUnits`, for ZeRO's units: minimp/parallel/zero/layout.py). Each unit's
reduce-scatter is the first half of the non-blocking ring (RingAllreduce with all_gather=False),
started by ZeroDataParallel the moment the unit's gradients are final (stages 2-3: every
micro-batch, as without overlap; stage 1: on the last micro-batch, out of the float32 sums) and
waited for when backward is over (stages 2-3: `after_backward`; stage 1: `reduce`). Each ring has
a send and a receive buffer of its own, allocated when it starts and dropped when it is done (rings
in flight at once cannot share ZeRO's one pair). The chunks, the messages and the additions are
those of `ring_reduce_scatter_into`, the packing and the use of the result are ZeroDataParallel's
own, so the result is the same to the bit.
"""

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator, Tag
from minimp.distributed.ring_nonblocking import RingAllreduce
from minimp.measure.accounts import BytesSent
from minimp.optim import Optimizer
from minimp.tensor import RemovableHandle, Tensor


def hook_each(params: Sequence[Tensor], arrived: Callable[[int], None]) -> list[RemovableHandle]:
    """Call arrived(index) each time backward has added params[index]'s gradient into .grad."""

    def hook(index: int) -> Callable[[Tensor], None]:
        return lambda parameter: arrived(index)

    return [p.register_post_accumulate_grad_hook(hook(i)) for i, p in enumerate(params)]


class RingsInFlight:
    """Rings started during backward, by key (a bucket, a unit), and what to do with each result;
    the bytes they send go into `sent` under one collective's name."""

    def __init__(self, comm: Communicator, sent: BytesSent, collective: str):
        self.comm, self.sent, self.collective = comm, sent, collective
        self.seconds = (
            0.0  # spent communicating inside backward (packing, starting, testing, adding)
        )
        # key -> (its ring, what to do with the received array once the ring is done)
        self.in_flight: dict[int, tuple[RingAllreduce, Callable[[Array], None]]] = {}

    @contextmanager
    def communicating(self) -> Iterator[None]:
        """Time what runs inside (into `seconds`) and count the bytes it sends."""
        started = time.perf_counter()
        with self.sent.counting(self.comm, self.collective):
            yield
        self.seconds += time.perf_counter() - started

    def _launch(
        self,
        key: int,
        send: Array,
        receive: Array,
        then: Callable[[Array], None],
        bounds: Sequence[tuple[int, int]] | None = None,
    ) -> None:
        """Start key's ring of send (packed) into receive: the whole all-reduce, or with bounds
        the reduce-scatter over those chunks; then(receive) runs once it is done."""
        if key in self.in_flight:
            raise RuntimeError(f"overlap: {key} started again while its ring is in flight")
        tags = (Tag.GRADIENT_BUCKETS + 2 * key, Tag.GRADIENT_BUCKETS + 2 * key + 1)
        whole = bounds is None  # an all-reduce; else the reduce-scatter half
        ring = RingAllreduce(self.comm, send, receive, tags=tags, bounds=bounds, all_gather=whole)
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
        """The send and receive buffers of the rings in flight (for the memory account)."""
        return [array for ring, _ in self.in_flight.values() for array in (ring.x, ring.out)]


class OverlappedBuckets(RingsInFlight):
    """The hooks, the buckets and the rings in flight of one DataParallel, as "all_reduce"."""

    def __init__(
        self,
        comm: Communicator,
        optimizer: Optimizer,
        buckets: list[tuple[list[int], int]],
        micro_batches: int,
        pack_bucket: Callable[[int], tuple[Array, Array]],
        unpack_bucket: Callable[[int], None],
        sent: BytesSent,
    ):
        """buckets: DataParallel's plan; pack_bucket(b) writes bucket b's float32 gradients onto
        its send buffer and returns (send, receive); unpack_bucket(b) writes the reduced mean
        back into the float32 gradients; sent: the account the bytes go into, as "all_reduce"."""
        super().__init__(comm, sent, "all_reduce")
        self.optimizer, self.buckets, self.micro_batches = optimizer, buckets, micro_batches
        self.pack_bucket, self.unpack_bucket = pack_bucket, unpack_bucket
        self.bucket_of = {index: b for b, (indices, _) in enumerate(buckets) for index in indices}
        self._reset()
        self.handles = hook_each(optimizer.params, self._arrived)

    def _reset(self) -> None:
        self.arrivals = [0] * len(self.optimizer.params)  # backwards that reached each, this step
        self.final = [0] * len(self.buckets)  # parameters of each bucket whose sum is final
        self.next_bucket = 0  # the next bucket to start, in plan order
        self.pending = False  # a backward ran since the last finalize_backward

    def _arrived(self, index: int) -> None:
        """Parameter index's gradient of one micro-batch is in .grad. On the last micro-batch it
        is final: into the float32 sum now, and its bucket may start."""
        self.arrivals[index] += 1
        self.pending = True
        if self.arrivals[index] != self.micro_batches:
            return  # an earlier micro-batch: DataParallel.after_backward accumulates it
        self.optimizer.accumulate_gradient(index)
        with self.communicating():
            self.final[self.bucket_of[index]] += 1
            self.progress()

    def progress(self, everything: bool = False) -> None:
        """Go as far as possible without waiting: start the complete buckets (every bucket not
        started yet, with `everything`) in plan order, advance every ring in flight, and unpack
        the buckets whose rings are done."""
        while self.next_bucket < len(self.buckets) and (everything or self._complete()):
            bucket = self.next_bucket
            send, receive = self.pack_bucket(bucket)
            self._launch(bucket, send, receive, self._unpacker(bucket))
            self.next_bucket += 1
        self._advance()

    def _unpacker(self, bucket: int) -> Callable[[Array], None]:
        return lambda received: self.unpack_bucket(bucket)

    def _complete(self) -> bool:
        """Whether every gradient of the next bucket is final."""
        return self.final[self.next_bucket] == len(self.buckets[self.next_bucket][0])

    def finalize_backward(self) -> None:
        """Backward is over: start the buckets not started yet (a parameter no backward reached
        sends zeros, as without overlap), wait for every ring, and get ready for the next step.
        Only once per step: a second call (DataParallel.reduce makes one) does nothing."""
        if not self.pending:
            return
        self._check_arrivals()
        self.progress(everything=True)
        self._wait_all()
        self._reset()

    def _check_arrivals(self) -> None:
        """A parameter reached by more backwards than there were micro-batches would have been
        sent before its sum was complete: refuse instead of averaging a wrong gradient."""
        for index, count in enumerate(self.arrivals):
            if count > self.micro_batches:
                raise RuntimeError(
                    f"overlap: parameter {index} received {count} gradients in a step of "
                    f"{self.micro_batches} micro-batches, so it was sent before it was complete; "
                    "tell DataParallel the right micro_batches, or turn overlap off"
                )

    def remove_hooks(self) -> None:
        """Take the hooks off the parameters (this DataParallel no longer overlaps)."""
        for handle in self.handles:
            handle.remove()


class OverlappedUnits(RingsInFlight):
    """The rings in flight of one ZeroDataParallel, counted as "reduce_scatter"."""

    def __init__(self, comm: Communicator, sent: BytesSent, parameters: int, micro_batches: int):
        """parameters, micro_batches: for stage 1, which starts on the step's last backward."""
        super().__init__(comm, sent, "reduce_scatter")
        self.micro_batches = micro_batches
        self.arrivals = [0] * parameters  # stage 1: backwards that reached each, this step

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

    def new_buffers(self, like: Array, size: int) -> tuple[Array, Array]:
        """A send and a receive buffer for one ring: size elements of like's dtype and device."""
        xp = array_module(like)
        return xp.empty(size, like.dtype), xp.empty(size, like.dtype)

    def start(
        self,
        unit: int,
        send: Array,
        receive: Array,
        bounds: Sequence[tuple[int, int]],
        then: Callable[[Array], None],
    ) -> None:
        """Start unit's reduce-scatter of send (packed) into receive; then(receive) runs when
        receive[bounds[rank]] holds this rank's chunk of the sum."""
        with self.communicating():
            self._launch(unit, send, receive, then, bounds)
        self.progress()

    def progress(self) -> None:
        """Advance every ring in flight as far as it goes without waiting; finish those done."""
        with self.communicating():
            self._advance()

    def wait(self) -> None:
        """Block until every ring in flight is done and finished, in unit order."""
        with self.sent.counting(self.comm, self.collective):
            self._wait_all()
