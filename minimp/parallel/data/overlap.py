"""Gradient buckets all-reduced during backward: each starts as soon as its last gradient is final.

PyTorch DDP's overlap (Li et al. 2020, "PyTorch Distributed", section 3.2.3), built on minimp's
non-blocking ring (minimp/distributed/ring_nonblocking.py). DataParallel plans the buckets from
the last parameter to the first, the order in which backward completes them. On the last
micro-batch of a step (the earlier ones only accumulate, like DDP's `no_sync`), each parameter's
post-accumulate hook adds its gradient into its float32 sum at once; when every parameter of the
next bucket is final, the bucket is packed and its ring starts (buckets start in plan order on
every rank); and every hook advances every ring in flight, each bucket's messages under tags of
its own. What is still in flight when backward ends is what `finalize_backward` waits for.

The bytes are those of DataParallel without overlap, packed, reduced and unpacked by the same
functions, so the result is the same to the bit. The one difference is what travels: without
overlap the step agrees on an overflow before the reduction and sends nothing non-finite; with it,
the buckets leave before anyone has checked them. The step's decisions do not change: a
non-finite gradient on any replica makes the reduced mean non-finite at the same element on every
replica (inf and NaN survive the 1/p, the 16-bit rounding and the sum), so the check of the
reduced gradients finds it, and every replica skips the step, as without overlap.
"""

import time
from typing import Any, Callable

from minimp.distributed.protocol import Communicator, Tag
from minimp.distributed.ring_nonblocking import RingAllreduce
from minimp.measure.accounts import BytesSent
from minimp.tensor import RemovableHandle


class OverlappedBuckets:
    """The hooks, the buckets and the rings in flight of one DataParallel."""

    def __init__(
        self,
        comm: Communicator,
        optimizer: Any,
        buckets: list[tuple[list[int], int]],
        micro_batches: int,
        pack_bucket: Callable[[int], tuple[Any, Any]],
        unpack_bucket: Callable[[int], None],
        sent: BytesSent,
    ):
        """buckets: DataParallel's plan; pack_bucket(b) writes bucket b's float32 gradients onto
        its send buffer and returns (send, receive); unpack_bucket(b) writes the reduced mean
        back into the float32 gradients; sent: the account the bytes go into, as "all_reduce"."""
        self.comm, self.optimizer, self.buckets = comm, optimizer, buckets
        self.micro_batches = micro_batches
        self.pack_bucket, self.unpack_bucket, self.sent = pack_bucket, unpack_bucket, sent
        self.bucket_of = {index: b for b, (indices, _) in enumerate(buckets) for index in indices}
        self.seconds = 0.0  # spent communicating inside backward (packing, testing, adding)
        self._reset()
        self.handles: list[RemovableHandle] = [
            parameter.register_post_accumulate_grad_hook(self._hook(index))
            for index, parameter in enumerate(optimizer.params)
        ]

    def _reset(self) -> None:
        self.arrivals = [0] * len(self.optimizer.params)  # backwards that reached each, this step
        self.final = [0] * len(self.buckets)  # parameters of each bucket whose sum is final
        self.next_bucket = 0  # the next bucket to start, in plan order
        self.in_flight: list[tuple[int, RingAllreduce]] = []
        self.pending = False  # a backward ran since the last finalize_backward

    def _hook(self, index: int) -> Callable[[Any], None]:
        return lambda parameter: self._arrived(index)

    def _arrived(self, index: int) -> None:
        """Parameter index's gradient of one micro-batch is in .grad. On the last micro-batch it
        is final: into the float32 sum now, and its bucket may start."""
        self.arrivals[index] += 1
        self.pending = True
        if self.arrivals[index] != self.micro_batches:
            return  # an earlier micro-batch: DataParallel.after_backward accumulates it
        self.optimizer.accumulate_gradient(index)
        started = time.perf_counter()
        self.final[self.bucket_of[index]] += 1
        with self.sent.counting(self.comm, "all_reduce"):
            self.progress()
        self.seconds += time.perf_counter() - started

    def progress(self, everything: bool = False) -> None:
        """Go as far as possible without waiting: start the complete buckets (every bucket not
        started yet, with `everything`) in plan order, advance every ring in flight, and unpack
        the buckets whose rings are done."""
        while self.next_bucket < len(self.buckets) and (everything or self._complete()):
            bucket = self.next_bucket
            send, receive = self.pack_bucket(bucket)
            tags = (Tag.GRADIENT_BUCKETS + 2 * bucket, Tag.GRADIENT_BUCKETS + 2 * bucket + 1)
            self.in_flight.append((bucket, RingAllreduce(self.comm, send, receive, tags=tags)))
            self.next_bucket += 1
        for bucket, ring in list(self.in_flight):
            if ring.progress():
                self.in_flight.remove((bucket, ring))
                self.unpack_bucket(bucket)

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
        for bucket, ring in self.in_flight:
            ring.wait()
            self.unpack_bucket(bucket)
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
