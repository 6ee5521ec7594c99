"""Data parallelism: every replica holds the whole model, sees its own shard of each global batch,
and the replicas sum their gradients with minimp's ring all-reduce before anyone steps.

Data parallelism does not split the parameters: each rank stores all of them (and all
optimizer state); only the batch is split. (ZeRO is what shards optimizer state and
gradients, using reduce_scatter and all_gather.)

Averaging by the world size p can happen before or after the all-reduce:
  before  each rank sends g_r / p and the sum is the mean. The values on the wire never exceed the
          largest single gradient, so a float16 wire cannot overflow where one rank's gradient did
          not. What PyTorch DDP does today.
  after   each rank sends g_r and divides the sum by p. The sum of p float16 gradients can overflow
          65504 even when every g_r is finite (with loss scaling this is the common case), and tiny
          g_r / p could underflow the other way; in float32 both orders are equally fine.

`DataParallel` is the `GradientSync` of minimp/precision/step.py: the mixed-precision step calls it
to agree on overflows, to average the gradients and to add up the gradient norm.
"""

import zlib
from typing import Any, Sequence

import numpy as np

from minimp.backend import array_module, to_numpy
from minimp.distributed.protocol import Communicator
from minimp.distributed.persistent import PersistentAllreduce
from minimp.precision.casting import round_to, widen
from minimp.parallel.data.overlap import OverlappedBuckets
from minimp.parallel.pipeline.tied import TiedGradients
from minimp.measure.accounts import BytesSent, PeakMemory, data_parallel_arrays, held_bytes
from minimp.precision.step import GradientSync, squared_norm


class ReplicaMismatchError(RuntimeError):
    """Replicas that should be bit-identical are not."""


class DataParallel(GradientSync):
    """Gradient buckets and the collective decisions of one data-parallel group."""

    def __init__(
        self,
        comm: Communicator,
        optimizer: Any,
        *,
        bucket_mb: float = 25.0,
        comm_dtype: Any = np.float32,
        average: str = "before",
        decision_comm: Communicator | None = None,
        stages_comm: Communicator | None = None,
        tied: TiedGradients | None = None,
        tensor_parallel: Any = None,
        overlap: bool = False,
        micro_batches: int = 1,
    ):
        """comm: the replicas of this stage. decision_comm: who shares the skip decision (with
        pipeline stages, every rank of the job; by default the replicas). stages_comm: the ranks
        that hold the other parts of this replica's model (its pipeline stages and tensor-parallel
        shards), whose gradient norms add up to the model's; by default none. tied: the parameters
        this stage shares with another stage (parallel/pipeline/tied.py), whose gradients are summed
        after averaging. tensor_parallel: a TensorParallelGradients (parallel/tensor/grads.py),
        whose partial gradients are summed after averaging and whose whole copies count once.
        overlap: all-reduce each bucket during the backward of the step's last micro-batch (of
        `micro_batches`) as soon as it is complete (minimp/parallel/data/overlap.py)."""
        if average not in ("before", "after"):
            raise ValueError(f"average must be 'before' or 'after', got {average!r}")
        self.comm, self.optimizer, self.average = comm, optimizer, average
        self.decision_comm = decision_comm or comm
        self.stages_comm, self.tied, self.tensor_parallel = stages_comm, tied, tensor_parallel
        self.comm_dtype = np.dtype(comm_dtype)
        self.buckets = self._plan_buckets(bucket_mb * 2**20)
        self.sent, self.peak = BytesSent(), PeakMemory()  # the accounts (measure/accounts.py)
        xp = array_module(optimizer.master_weights[0]) if optimizer.master_weights else np
        # One send and one receive buffer per bucket, reused every step (no allocations, no page
        # faults); one replica sends nothing and needs none.
        self.buffers = [
            (xp.empty(size, self.comm_dtype), xp.empty(size, self.comm_dtype))
            for _, size in (self.buckets if comm.size > 1 else [])
        ]
        # The ranks agree on every bucket's length and dtype here, once, instead of at every
        # all-reduce of every step (the overlapped rings never check: they rely on this).
        self.plans = [
            PersistentAllreduce(comm, (size,), self.comm_dtype, algorithm="ring")
            for _, size in (self.buckets if comm.size > 1 else [])
        ]
        self.overlap: OverlappedBuckets | None = None
        if overlap and comm.size > 1:
            # The float32 gradients are read when a bucket moves: zero_grad makes a new list.
            self.overlap = OverlappedBuckets(
                comm,
                optimizer,
                self.buckets,
                micro_batches,
                pack_bucket=lambda bucket: self._pack(bucket, optimizer.master_gradients),
                unpack_bucket=lambda bucket: self._unpack(bucket, optimizer.master_gradients),
                sent=self.sent,
            )

    def _plan_buckets(self, bucket_bytes: float) -> list[tuple[list[int], int]]:
        """[(parameter indices, elements)]; parameters are taken last to first, the order in which
        backward produces their gradients (so a real overlap of communication with backward could
        start on a full bucket early, as PyTorch DDP does)."""
        buckets: list[tuple[list[int], int]] = []
        current: list[int] = []
        size = 0
        for index in reversed(range(len(self.optimizer.params))):
            elements = self.optimizer.master_weights[index].size
            if current and (size + elements) * self.comm_dtype.itemsize > bucket_bytes:
                buckets.append((current, size))
                current, size = [], 0
            current.append(index)
            size += elements
        if current:
            buckets.append((current, size))
        return buckets

    def broadcast_parameters(self, root: int = 0) -> None:
        """Make every replica start from root's float32 masters, bit for bit."""
        broadcast_masters(self.comm, self.optimizer, root)

    def any_rank(self, found_inf: bool) -> bool:
        """One decision for all: True on every rank when any rank saw a non-finite gradient."""
        return any_rank(self.decision_comm, found_inf)

    def global_squared_norm(self, gradients: Sequence[Any]) -> float:
        """This stage's squared gradient norm plus the other stages' (replicas hold the same
        averaged gradients, so they are not added again; a tied copy counts once)."""
        uncounted = self.tied.uncounted() if self.tied is not None else set()
        if self.tensor_parallel is not None:
            uncounted |= self.tensor_parallel.uncounted()
        local = squared_norm([g for i, g in enumerate(gradients) if i not in uncounted])
        if self.stages_comm is None or self.stages_comm.size == 1:
            return local
        return float(self.stages_comm.allreduce_scalars([local], op="sum")[0])

    def finalize_backward(self) -> None:
        """With overlap, wait for the buckets still in flight (the others were all-reduced during
        backward); the float32 gradients then hold the mean over the replicas."""
        if self.overlap is not None:
            with self.sent.counting(self.comm, "all_reduce"):
                self.overlap.finalize_backward()

    def backward_communication_seconds(self) -> float:
        """Seconds spent communicating inside backward so far, a running total: packing, testing
        and adding buckets from the hooks (0 without overlap)."""
        return self.overlap.seconds if self.overlap is not None else 0.0

    def reduce(self, gradients: list) -> None:
        """Replace each float32 gradient (in place) by the mean over the replicas (with overlap:
        already done by finalize_backward, which this waits for); then sum the tied copies'
        gradients across their two stages."""
        if self.overlap is not None:
            self.finalize_backward()
        else:
            with self.sent.counting(self.comm, "all_reduce"):
                self._average_over_replicas(gradients)
        if self.tied is not None:
            self.tied.reduce(gradients)
        if self.tensor_parallel is not None:
            self.tensor_parallel.reduce(gradients, self.optimizer.master_weights)

    def after_backward(self) -> None:
        """What runs after every micro-batch's backward: the float32 accumulation of the
        gradients the overlap's hooks did not take (all of them without overlap)."""
        self.peak.sample(self.held())  # every 16-bit gradient of this backward is alive now
        self.optimizer.accumulate_gradients()
        if self.overlap is not None:
            self.overlap.pending = True

    def held(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (minimp/measure/accounts.py)."""
        return held_bytes(data_parallel_arrays(self.optimizer, self))

    def _average_over_replicas(self, gradients: list) -> None:
        if self.comm.size == 1:
            return
        for bucket in range(len(self.buckets)):
            send, receive = self._pack(bucket, gradients)
            self.plans[bucket](send, out=receive)
            self._unpack(bucket, gradients)

    def _pack(self, bucket: int, gradients: list) -> tuple[Any, Any]:
        """Write the bucket's float32 gradients onto its send buffer (times 1/p, by default);
        returns the bucket's (send, receive) buffers."""
        indices, _ = self.buckets[bucket]
        send, receive = self.buffers[bucket]
        inverse, offset = 1.0 / self.comm.size, 0
        for index in indices:
            flat = _gradient_or_zeros(gradients, index, self.optimizer).reshape(-1)
            pack(send[offset : offset + flat.size], flat, inverse, self.average)
            offset += flat.size
        return send, receive

    def _unpack(self, bucket: int, gradients: list) -> None:
        """The bucket's reduced sum, off its receive buffer, into the float32 gradients."""
        indices, _ = self.buckets[bucket]
        receive = self.buffers[bucket][1]
        inverse, offset = 1.0 / self.comm.size, 0
        for index in indices:
            grad = gradients[index]
            # Written through grad itself: a gradient that arrived transposed (the head's copy
            # of the tied embedding) is Fortran-ordered, and its reshape(-1) is a copy.
            piece = receive[offset : offset + grad.size].reshape(grad.shape)
            unpack(grad, piece, inverse, self.average)
            offset += grad.size

    def check_replicas(self, extra: Sequence[Any] = ()) -> None:
        """Raise ReplicaMismatchError naming the ranks whose masters (and `extra` arrays, such as
        fp8 scaling state) differ from rank 0's."""
        differing = ranks_differing_from_rank_0(self.comm, [*self.optimizer.master_weights, *extra])
        if differing:
            what = "master weights or fp8 state" if extra else "master weights"
            raise ReplicaMismatchError(
                f"{what} of rank(s) {differing} differ from rank 0's (replicas drifted apart)"
            )


def ranks_differing_from_rank_0(comm: Communicator, arrays: Sequence[Any]) -> list[int]:
    """The ranks whose arrays' bytes differ from rank 0's: one CRC-32 of them per rank, summed into
    a table by one scalar all-reduce (no array travels)."""
    checksum = 0
    for array in arrays:
        checksum = zlib.crc32(to_numpy(array).tobytes(), checksum)
    table = np.zeros(comm.size)
    table[comm.rank] = checksum  # a 32-bit integer: exact in float64
    table = comm.allreduce_scalars(table, op="sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


def any_rank(comm: Communicator, found_inf: bool) -> bool:
    """True on every rank of comm when found_inf is True on any (one MAX all-reduce)."""
    if comm.size == 1:
        return found_inf
    return bool(comm.allreduce_scalars([float(found_inf)], op="max")[0])


def broadcast_masters(comm: Communicator, optimizer: Any, root: int = 0) -> None:
    """Overwrite every rank's float32 masters (and compute copies) with root's, bit for bit."""
    for index, master in enumerate(optimizer.master_weights):
        comm.bcast(master, root=root)
        optimizer.set_master_weight(index, master)


def pack(wire: Any, gradient: Any, inverse: float, average: str) -> None:
    """Write a flat gradient (float32, or a 16-bit one) into its place on the wire: with
    average "before" multiplied by 1/p in float32 first; rounded once into the wire's dtype."""
    if average == "before":
        wire[...] = round_to(widen(gradient) * np.float32(inverse), wire.dtype)
    else:
        wire[...] = round_to(gradient, wire.dtype)


def unpack(target: Any, received: Any, inverse: float, average: str) -> None:
    """A reduced sum off the wire into a float32 gradient (with average "after": times 1/p)."""
    target[...] = received
    if average == "after":
        target *= np.float32(inverse)


def _gradient_or_zeros(gradients: list, index: int, optimizer: Any) -> Any:
    """A parameter no loss reached still takes part in the all-reduce, with zeros."""
    if gradients[index] is None:
        gradients[index] = array_module(optimizer.master_weights[index]).zeros_like(
            optimizer.master_weights[index]
        )
    return gradients[index]


def shard(indices: Any, rank: int, world_size: int) -> Any:
    """This replica's contiguous slice of a global batch (the batch size must divide evenly)."""
    size = len(indices) // world_size
    return indices[rank * size : (rank + 1) * size]
