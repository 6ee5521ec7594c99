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
to agree on overflows, to average the gradients and to add up the gradient norm (`ReplicaSync`, the
part it shares with ZeRO's). With overlap, `OverlappedBuckets` all-reduces each bucket during the
backward of the step's last micro-batch (minimp/parallel/data/overlap.py).

With --ep the expert parameters are reduced apart (`ExpertGradients`): summed over the replicas
holding the same experts and divided by every replica (minimp/parallel/expert/grads.py derives
it), after the dense buckets, never during backward.
"""

from typing import Callable, Sequence

import numpy as np
import numpy.typing as npt

from minimp.backend import Array, array_module
from minimp.distributed.collectives import PersistentAllreduce
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring_fp8 import Fp8RingAllreduce
from minimp.measure.accounts import BytesSent, PeakMemory, held_bytes
from minimp.optim import Optimizer
from minimp.parallel.data.overlap import RingsInFlight, hook_each, refuse_incomplete
from minimp.parallel.expert.grads import ExpertGradients
from minimp.parallel.pipeline.tied import TiedGradients
from minimp.parallel.replicas import check_same
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.precision.casting import round_to, widen
from minimp.precision.step import GradientSync, squared_norm
from minimp.precision.wire import Fp8Wire


class ReplicaSync(GradientSync):
    """What the GradientSyncs of data parallelism and of ZeRO share over one stage's replicas: when
    to average, the one overflow decision, the gradient norm that counts each parameter once, and
    the accounts of the bytes this rank sends and holds."""

    overlap: RingsInFlight | None  # the rings in flight during backward (None: no overlap)

    def __init__(self, comm: Communicator, average: str, decision_comm: Communicator | None,
                 tied: TiedGradients | None, tensor_parallel: TensorParallelGradients | None,
                 sent: BytesSent | None = None):
        """comm: the replicas; the others as DataParallel's and ZeroDataParallel's (sent: the
        account of the bytes sent, new by default)."""
        if average not in ("before", "after"):
            raise ValueError(f"average must be 'before' or 'after', got {average!r}")
        self.comm, self.average, self.decision_comm = comm, average, decision_comm or comm
        self.tied, self.tensor_parallel = tied, tensor_parallel
        # The accounts (minimp/measure/accounts.py): bytes sent by collective, the peak held.
        self.sent, self.peak = sent or BytesSent(), PeakMemory()

    def any_rank(self, found_inf: bool) -> bool:
        """One decision for all: True on every rank of decision_comm when any rank saw a
        non-finite gradient (one MAX all-reduce)."""
        if self.decision_comm.size == 1:
            return found_inf
        return bool(self.decision_comm.allreduce_scalars([float(found_inf)], op="max")[0])

    def backward_communication_seconds(self) -> float:
        """Seconds spent communicating inside backward so far, a running total: packing,
        starting, testing and finishing rings from the hooks (0 without overlap)."""
        return self.overlap.seconds if self.overlap is not None else 0.0

    def _squared_norm(self, gradients: Sequence[Array | None], indices: Sequence[int],
                      over: Communicator | None) -> float:
        """The squares of the gradients (of the parameters at optimizer positions `indices`),
        summed over the ranks of `over`: a tied copy, and a tensor-parallel whole copy, count on
        one rank only."""
        uncounted = self.tied.uncounted() if self.tied is not None else set()
        if self.tensor_parallel is not None:
            uncounted |= self.tensor_parallel.uncounted()
        local = squared_norm([g for g, index in zip(gradients, indices) if index not in uncounted])
        if over is None or over.size == 1:
            return local
        return float(over.allreduce_scalars([local], op="sum")[0])

    def arrays_by_kind(self) -> dict[str, list[Array | None]]:
        """What this rank holds, by kind (the KINDS of minimp/measure/accounts.py)."""
        raise NotImplementedError

    def held(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind (minimp/measure/accounts.py)."""
        return held_bytes(self.arrays_by_kind())

    def sample_peak(self) -> None:
        """Note the bytes held now, if they are the most this rank has held (`peak`)."""
        self.peak.sample(self.held())


class DataParallel(ReplicaSync):
    """Gradient buckets and the collective decisions of one data-parallel group."""

    def __init__(self, comm: Communicator, optimizer: Optimizer, *, bucket_mb: float = 25.0,
                 comm_dtype: "npt.DTypeLike | Fp8Wire" = np.float32, average: str = "before",
                 decision_comm: Communicator | None = None,
                 stages_comm: Communicator | None = None, tied: TiedGradients | None = None,
                 tensor_parallel: TensorParallelGradients | None = None, overlap: bool = False,
                 micro_batches: int = 1, experts: ExpertGradients | None = None):
        """comm: the replicas of this stage. optimizer: this replica's, whose float32 gradient sums
        are averaged. bucket_mb: the most MiB of gradients (counted in comm_dtype) one all-reduce
        carries. comm_dtype: the dtype gradients travel in (float32, or a 16-bit wire), or an
        Fp8Wire (precision/wire.py): the buckets are packed in float32 and each chunk travels as
        fp8 with its own scale (distributed/ring_fp8.py, with overlap too). average:
        "before" multiplies each gradient by 1/replicas before the sum (in float32, then rounded
        onto the wire), "after" multiplies the sum as it comes off the wire. decision_comm: who
        shares the skip decision (with pipeline stages, every rank of the job; by default the
        replicas). stages_comm: the ranks that hold the other parts of this replica's model (its
        pipeline stages and tensor-parallel shards), whose gradient norms add up to the model's; by
        default none. tied: the parameters this stage shares with another stage
        (parallel/pipeline/tied.py), whose gradients are summed after averaging. tensor_parallel: a
        TensorParallelGradients (parallel/tensor/grads.py), whose partial gradients are summed after
        averaging and whose whole copies count once. overlap: all-reduce each bucket during the
        backward of the step's last micro-batch (of `micro_batches`) as soon as it is complete
        (minimp/parallel/data/overlap.py). experts: with --ep, the expert parameters, reduced
        apart over their own group (the module's docstring)."""
        super().__init__(comm, average, decision_comm, tied, tensor_parallel)
        self.optimizer, self.stages_comm, self.experts = optimizer, stages_comm, experts
        # An fp8 wire packs its buckets in float32; its ring makes each chunk's message.
        self.wire: Fp8Wire | None = None
        if isinstance(comm_dtype, Fp8Wire):
            self.wire, comm_dtype = comm_dtype, np.float32
        self.comm_dtype = np.dtype(comm_dtype)
        expert_indices = experts.indices if experts is not None else frozenset()
        everything = range(len(optimizer.params))
        self.dense = [index for index in everything if index not in expert_indices]
        self.buckets = self._plan_buckets(bucket_mb * 2**20, self.dense)
        self.buffers, self.plans = self._plan_buffers(comm, self.buckets)
        self.expert_buckets = self._plan_buckets(bucket_mb * 2**20, sorted(expert_indices))
        self.expert_buffers, self.expert_plans = self._plan_buffers(
            experts.comm if experts is not None else comm, self.expert_buckets)
        self.overlap: OverlappedBuckets | None = None
        if overlap and comm.size > 1:  # one replica has nothing to send
            self.overlap = OverlappedBuckets(self, micro_batches)

    def _plan_buffers(self, comm: Communicator, buckets: list[tuple[list[int], int]]
                      ) -> tuple[list[tuple[Array, Array]],
                                 list[PersistentAllreduce | Fp8RingAllreduce]]:
        """One send and one receive buffer per bucket, reused every step (no allocations, no page
        faults), and the all-reduce of each; one replica sends nothing and needs none."""
        masters = self.optimizer.master_weights
        xp = array_module(masters[0]) if masters else np
        sizes = [size for _, size in buckets] if comm.size > 1 else []
        buffers = [(xp.empty(n, self.comm_dtype), xp.empty(n, self.comm_dtype)) for n in sizes]
        if self.wire is not None:
            return buffers, [Fp8RingAllreduce(comm, n, self.wire) for n in sizes]
        # The ranks agree on every bucket's length and dtype here, once, instead of at every
        # all-reduce of every step (the overlapped rings never check: they rely on this).
        plans: list[PersistentAllreduce | Fp8RingAllreduce] = [
            PersistentAllreduce(comm, (n,), self.comm_dtype, algorithm="ring") for n in sizes]
        return buffers, plans

    def _plan_buckets(self, bucket_bytes: float,
                      indices: list[int]) -> list[tuple[list[int], int]]:
        """[(parameter indices, elements)] of the parameters at `indices`; they are taken last to
        first, the order in which backward produces their gradients (so, with overlap, the first
        bucket is complete early in backward and its ring starts then, as in PyTorch DDP)."""
        buckets: list[tuple[list[int], int]] = []
        current: list[int] = []
        size = 0
        for index in reversed(indices):
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
        """Make every replica start from root's float32 masters, bit for bit (with --ep, the
        expert ones from root's rank of their own group)."""
        if self.experts is None:
            return broadcast_masters(self.comm, self.optimizer, root)
        broadcast_masters(self.comm, self.optimizer, root, self.dense)
        broadcast_masters(self.experts.comm, self.optimizer, root, sorted(self.experts.indices))

    def global_squared_norm(self, gradients: Sequence[Array | None]) -> float:
        """This stage's squared gradient norm plus the other stages' (replicas hold the same
        averaged gradients, so they are not added again; a tied copy counts once). With --ep the
        expert squares add up over the ep group first (each rank holds other experts)."""
        if self.experts is None:
            return self._squared_norm(gradients, range(len(gradients)), self.stages_comm)
        dense = self._squared_norm([gradients[i] for i in self.dense], self.dense, None)
        indices = sorted(self.experts.indices)
        experts = self._squared_norm([gradients[i] for i in indices], indices, self.experts.ep_comm)
        if self.stages_comm is None or self.stages_comm.size == 1:
            return dense + experts
        return float(self.stages_comm.allreduce_scalars([dense + experts], op="sum")[0])

    def finalize_backward(self) -> None:
        """With overlap, wait for the buckets still in flight (the others were all-reduced during
        backward); the float32 gradients then hold the mean over the replicas."""
        if self.overlap is not None:
            with self.sent.counting(self.comm, "all_reduce"):
                self.overlap.finalize_backward()

    def reduce(self, gradients: list[Array | None]) -> None:
        """Replace each float32 gradient (in place) by the mean over the replicas (with overlap:
        already done by finalize_backward, which this waits for); then sum the tied copies'
        gradients across their two stages, and the partial ones (--tp) over their shards."""
        if self.overlap is not None:
            self.finalize_backward()
        else:
            with self.sent.counting(self.comm, "all_reduce"):
                self._average_over_replicas(gradients)
        if self.experts is not None:
            with self.sent.counting(self.experts.comm, "expert_all_reduce"):
                self._reduce_experts(gradients)
        if self.tied is not None:
            self.tied.reduce(gradients)
        if self.tensor_parallel is not None:
            self.tensor_parallel.reduce(gradients, self.optimizer.master_weights)

    def after_backward(self) -> None:
        """What runs after every micro-batch's backward: the float32 accumulation of the
        gradients the overlap's hooks did not take (all of them without overlap)."""
        self.sample_peak()  # every 16-bit gradient of this backward is alive now
        self.optimizer.accumulate_gradients()
        if self.overlap is not None:
            self.overlap.pending = True

    def arrays_by_kind(self) -> dict[str, list[Array | None]]:
        """What this rank holds (ZeRO's stage 0), by kind: the optimizer's arrays and the
        all-reduce's buffers."""
        optimizer = self.optimizer
        slots = [v for slots in optimizer.slots for v in slots.values() if v is not None]
        return {
            "parameters": [parameter.data for parameter in optimizer.params],
            "gradients": [parameter.grad for parameter in optimizer.params],
            "accumulators": list(optimizer.accumulators),
            "masters": list(optimizer.master_weights),
            "optimizer_state": slots,
            "buffers": [buffer for pair in self.buffers + self.expert_buffers for buffer in pair],
        }

    def _average_over_replicas(self, gradients: list[Array | None]) -> None:
        if self.comm.size == 1:
            return
        for bucket in range(len(self.buckets)):
            send, receive = self._pack(bucket, gradients)
            self.plans[bucket](send, out=receive)
            self._unpack(bucket, gradients)

    def _reduce_experts(self, gradients: list[Array | None]) -> None:
        """The expert gradients: summed over the replicas holding the same experts, times 1/p
        of every replica (p = comm.size, not the expert group's: expert/grads.py). Alone in its
        group a rank sends nothing and only divides."""
        assert self.experts is not None  # reduce calls this with --ep only
        if self.experts.comm.size == 1:
            for index in self.experts.indices:
                gradient = _gradient_or_zeros(gradients, index, self.optimizer)
                gradient *= np.float32(1.0 / self.comm.size)
            return
        for bucket in range(len(self.expert_buckets)):
            send, receive = self.expert_buffers[bucket]
            self._pack_bucket(self.expert_buckets[bucket][0], send, gradients)
            self.expert_plans[bucket](send, out=receive)
            self._unpack_bucket(self.expert_buckets[bucket][0], receive, gradients)

    def _pack(self, bucket: int, gradients: list[Array | None]) -> tuple[Array, Array]:
        """Write the bucket's float32 gradients onto its send buffer (times 1/p, by default);
        returns the bucket's (send, receive) buffers."""
        send, receive = self.buffers[bucket]
        self._pack_bucket(self.buckets[bucket][0], send, gradients)
        return send, receive

    def _unpack(self, bucket: int, gradients: list[Array | None]) -> None:
        """The bucket's reduced sum, off its receive buffer, into the float32 gradients."""
        self._unpack_bucket(self.buckets[bucket][0], self.buffers[bucket][1], gradients)

    def _pack_bucket(self, indices: list[int], send: Array, gradients: list[Array | None]) -> None:
        """The float32 gradients at `indices` onto `send` (times 1/p, p = comm.size, by default)."""
        inverse, offset = 1.0 / self.comm.size, 0
        for index in indices:
            flat = _gradient_or_zeros(gradients, index, self.optimizer).reshape(-1)
            pack(send[offset : offset + flat.size], flat, inverse, self.average)
            offset += flat.size

    def _unpack_bucket(self, indices: list[int], receive: Array,
                       gradients: list[Array | None]) -> None:
        """A reduced sum off `receive` into the float32 gradients at `indices`."""
        inverse, offset = 1.0 / self.comm.size, 0
        for index in indices:
            grad = gradients[index]
            assert grad is not None  # _pack gave the parameters no backward reached zeros
            # Written through grad itself: a gradient that arrived transposed (the head's copy
            # of the tied embedding) is Fortran-ordered, and its reshape(-1) is a copy.
            piece = receive[offset : offset + grad.size].reshape(grad.shape)
            unpack(grad, piece, inverse, self.average)
            offset += grad.size

    def check_replicas(self, extra: Sequence[Array] = ()) -> None:
        """Raise ReplicaMismatchError naming the ranks whose masters (and `extra` arrays, such as
        fp8 scaling state) differ from rank 0's."""
        what = "master weights or fp8 state" if extra else "master weights"
        message = what + " of rank(s) {ranks} differ from rank 0's (replicas drifted apart)"
        masters = self.optimizer.master_weights
        check_same(self.comm, [*(masters[i] for i in self.dense), *extra], message)
        if self.experts is not None:  # the replicas holding the same experts
            check_same(self.experts.comm, [masters[i] for i in sorted(self.experts.indices)],
                       "expert " + message + " in their expert data-parallel group")


class OverlappedBuckets(RingsInFlight):
    """The hooks, the buckets and the rings in flight of one DataParallel, as "all_reduce"."""

    def __init__(self, sync: DataParallel, micro_batches: int):
        """sync: the DataParallel whose buckets (its plan, its buffers, its _pack and _unpack)
        move during backward; its bytes go into sync.sent, as "all_reduce"."""
        super().__init__(sync.comm, sync.sent, "all_reduce", sync.wire)
        self.sync, self.optimizer, self.buckets = sync, sync.optimizer, sync.buckets
        self.micro_batches = micro_batches
        self.bucket_of = {i: b for b, (indices, _) in enumerate(self.buckets) for i in indices}
        self._reset()
        hook_each(self.optimizer.params, self._arrived)

    def _reset(self) -> None:
        self.arrivals = [0] * len(self.optimizer.params)  # backwards that reached each, this step
        self.final = [0] * len(self.buckets)  # parameters of each bucket whose sum is final
        self.next_bucket = 0  # the next bucket to start, in plan order
        self.pending = False  # a backward ran since the last finalize_backward

    def _arrived(self, index: int) -> None:
        """Parameter index's gradient of one micro-batch is in .grad. On the last micro-batch it
        is final: into the float32 sum now, and its bucket may start. (An expert parameter, in no
        bucket here, stays for after_backward and reduce.)"""
        if index not in self.bucket_of:
            return
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
            # The float32 gradients are read when a bucket moves: zero_grad makes a new list.
            send, receive = self.sync._pack(bucket, self.optimizer.master_gradients)
            self._launch(bucket, send, receive, self._unpacker(bucket))
            self.next_bucket += 1
        self._advance()

    def _unpacker(self, bucket: int) -> Callable[[Array], None]:
        return lambda received: self.sync._unpack(bucket, self.optimizer.master_gradients)

    def _complete(self) -> bool:
        """Whether every gradient of the next bucket is final."""
        return self.final[self.next_bucket] == len(self.buckets[self.next_bucket][0])

    def finalize_backward(self) -> None:
        """Backward is over: start the buckets not started yet (a parameter no backward reached
        sends zeros, as without overlap), wait for every ring, and get ready for the next step.
        Only once per step: a second call (DataParallel.reduce makes one) does nothing."""
        if not self.pending:
            return
        for index, count in enumerate(self.arrivals):
            refuse_incomplete(index, count, self.micro_batches, "DataParallel")
        self.progress(everything=True)
        self._wait_all()
        self._reset()


def broadcast_masters(comm: Communicator, optimizer: Optimizer, root: int = 0,
                      indices: Sequence[int] | None = None) -> None:
    """Overwrite every rank's float32 masters (and compute copies) with root's, bit for bit
    (those at `indices`, by default all)."""
    masters = optimizer.master_weights
    for index in range(len(masters)) if indices is None else indices:
        comm.bcast(masters[index], root=root)
        optimizer.set_master_weight(index, masters[index])


def pack(wire: Array, gradient: Array, inverse: float, average: str) -> None:
    """Write a flat gradient (float32, or a 16-bit one) into its place on the wire: with
    average "before" multiplied by 1/p in float32 first; rounded once into the wire's dtype."""
    if average == "before":
        wire[...] = round_to(widen(gradient) * np.float32(inverse), wire.dtype)
    else:
        wire[...] = round_to(gradient, wire.dtype)


def unpack(target: Array, received: Array, inverse: float, average: str) -> None:
    """A reduced sum off the wire into a float32 gradient (with average "after": times 1/p)."""
    target[...] = received
    if average == "after":
        target *= np.float32(inverse)


def _gradient_or_zeros(gradients: list[Array | None], index: int, optimizer: Optimizer) -> Array:
    """A parameter no loss reached still takes part in the all-reduce, with zeros."""
    if gradients[index] is None:
        master = optimizer.master_weights[index]
        gradients[index] = array_module(master).zeros_like(master)
    return gradients[index]


def shard(indices: np.ndarray, rank: int, world_size: int) -> np.ndarray:
    """This replica's contiguous slice of a global batch (the batch size must divide evenly)."""
    size = len(indices) // world_size
    return indices[rank * size : (rank + 1) * size]
