"""ZeRO stages 1, 2 and 3 from the ring's two halves: the GradientSync, and building all of it.

Rajbhandari et al. 2020. Data parallelism all-reduces the gradients and every replica then takes
the same step on the same whole state. An all-reduce is a reduce-scatter followed by an all-gather
(minimp/distributed/ring.py), so ZeRO splits it at the seam: after the reduce-scatter each rank
holds the mean of 1/N of the gradients, updates just those 1/N of the masters and optimizer state
(ShardedOptimizer), and the all-gather then carries the updated compute copies instead of the
gradients. Same bytes on the wire (2 (N - 1)/N of the model), 1/N of the optimizer's memory.

  stage 1  optimizer state and masters sharded; the reduce-scatter happens in `reduce`, once a step,
           out of the whole float32 accumulators
  stage 2  gradients sharded too: each unit (a layer's parameters, layout.py) is
           reduce-scattered as soon as a backward completes its gradients, every micro-batch,
           and only this rank's chunk of the sum is kept
  stage 3  parameters sharded: layers gather their compute copies when they run
           (stage3.py), at one more all-gather per micro-batch

`ZeroDataParallel` is the GradientSync of the mixed-precision step (minimp/precision/step.py), whose
order of decisions does not change: overflow agreed by every rank, `reduce` (here: the
reduce-scatter, or nothing left to do), overflow agreed again, unscale, clip by the norm summed over
every rank's chunks and every stage, update, scaler. What changes is where the bytes move and that
`reduce` leaves in the list this rank's gradient pieces instead of whole gradients. With overlap,
`OverlappedUnits` keeps each unit's reduce-scatter in flight while backward goes on
(minimp/parallel/data/overlap.py).

A mixture of experts (--experts). One ZeRO that knows two groups, rather than one ZeRO per kind of
parameter: each layer's experts are a unit of their own (layout.py), cut over the expert group
(with --ep, the dp/ep replicas holding the same experts, as Megatron-Core's distributed optimizer
shards them; without it, the replicas), and every other part of the step (the overflow decision,
the norm, the update, the checkpoint's stitching, stage 3's gathers) stays one piece of code that
asks each unit for its group. Two ZeROs would each need the hooks, the step and the gathers of the
whole stage, and a third object to make one optimizer of them. What changes for an expert unit:
  - its reduce-scatter and all-gather run over its group, counted as "expert_reduce_scatter" and
    "expert_all_gather" when that group is not the replicas'; the 1/dp stays the replicas' (every
    replica's loss is in the mean: minimp/parallel/expert/grads.py), and alone in its group
    (--ep = --dp) a rank only divides, as data parallelism does;
  - its reduce-scatter starts when its gradients are complete, as a dense unit's, but runs at
    once: the rings in flight (overlap) are the replicas'. Every rank completes the same units at
    the same point of backward, because every expert runs, on zero rows if no token reached it
    (minimp/models/moe.py's run_experts): its gradient is zeros, never absent;
  - the gradient norm needs nothing new: each element, dense or expert, lies in one chunk of one
    rank of the job, so the squares of every rank's pieces, summed over the job, count each once.
"""

from typing import Any, Callable, Sequence

import numpy as np
import numpy.typing as npt

from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import ring_reduce_scatter_into
from minimp.distributed.ring_fp8 import fp8_reduce_scatter_into
from minimp.measure.accounts import BytesSent
from minimp.nn import Module
from minimp.optim import Optimizer
from minimp.parallel.data.data_parallel import ReplicaSync, pack, unpack
from minimp.parallel.data.overlap import RingsInFlight, hook_each, refuse_incomplete
from minimp.parallel.pipeline.split import RunLayers
from minimp.parallel.pipeline.tied import TiedGradients
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.zero.layout import ZeroLayout, plan_units
from minimp.parallel.zero.optimizer import ShardedOptimizer
from minimp.parallel.zero.stage3 import ParameterGatherer
from minimp.parallel.zero.stages import ZeroStage, zero_stage
from minimp.precision.casting import widen
from minimp.precision.wire import Fp8Wire
from minimp.tensor import Tensor


class ZeroDataParallel(ReplicaSync):
    """ZeRO's GradientSync over one stage's replicas; build it with `zero_data_parallel`."""

    def __init__(self, comm: Communicator, optimizer: ShardedOptimizer, *,
                 comm_dtype: "npt.DTypeLike | Fp8Wire" = np.float32, average: str = "before",
                 decision_comm: Communicator | None = None, tied: TiedGradients | None = None,
                 sent: BytesSent | None = None,
                 tensor_parallel: TensorParallelGradients | None = None, overlap: bool = False,
                 micro_batches: int = 1):
        """As DataParallel's: comm the replicas of this stage, optimizer this replica's
        ShardedOptimizer, comm_dtype the gradients' wire dtype (an Fp8Wire: packed in float32,
        each chunk sent as fp8 with its scale, minimp/distributed/ring_fp8.py, with
        overlap too), average "before" or "after" the sum
        (the division by the replicas), decision_comm every rank that shares the skip decision and
        the gradient norm (by default the replicas), tied the parameters this stage shares with
        another, tensor_parallel the partial gradients and whole copies of --tp; sent counts the
        bytes by collective. overlap: each unit's reduce-scatter progresses during backward
        (minimp/parallel/data/overlap.py); stage 1 then needs to know which backward is the step's
        last (of `micro_batches`)."""
        super().__init__(comm, average, decision_comm, tied, tensor_parallel, sent)
        self.optimizer, self.layout, self.params = optimizer, optimizer.layout, optimizer.params
        self.stage = zero_stage(optimizer.stage)
        self.gatherer: ParameterGatherer | None = None
        xp = array_module(*optimizer.masters)
        self.wire = comm_dtype if isinstance(comm_dtype, Fp8Wire) else None
        if self.wire is not None:
            comm_dtype = np.float32  # the units are packed in float32, quantized chunk by chunk
        largest = self.layout.largest_unit()  # 0 when no unit travels (one replica)
        # One send and one receive buffer, as large as the largest unit, reused by every unit
        # (without overlap).
        self.send, self.receive = xp.empty(largest, comm_dtype), xp.empty(largest, comm_dtype)
        self.piece_indices = [p.index for pieces in self.layout.pieces for p in pieces]
        self.unit_of = self.layout.unit_of()
        self.arrived: list[set[int]] = [set() for _ in self.layout.units]
        self.overlap: OverlappedUnits | None = None
        if overlap and comm.size > 1:  # one replica has nothing to send
            self.overlap = OverlappedUnits(comm, self.sent, len(self.params), micro_batches,
                                           self.wire)
        self.started: set[int] = set()  # stage 1 with overlap: units whose ring started this step
        # Stages 2-3 reduce-scatter a unit once its gradients are complete; stage 1 only overlaps.
        if self.stage.shards_gradients or self.overlap is not None:
            hook_each(self.params, self._arrived)

    # ----- GradientSync -----------------------------------------------------------------------
    def finalize_backward(self) -> None:
        """Stage 1 with overlap: start the units backward did not complete, wait for every ring
        (this rank's chunks of the accumulators then hold the mean), and reset for the next step.
        Stages 2-3 waited in after_backward."""
        if self.overlap is not None and not self.stage.shards_gradients:
            self._reduce_scatter_accumulators()
            self.overlap.arrivals = [0] * len(self.params)

    def reduce(self, gradients: list[Array | None]) -> None:
        """Leave in `gradients` (replacing its contents) this rank's gradient pieces, each the
        mean over the replicas (stage 1 reduce-scatters them now, or with overlap did in
        finalize_backward; stages 2-3 did during backward), the tied ones summed with the other
        stage's copy, the partial ones (--tp) over their shards."""
        if not self.stage.shards_gradients and self.overlap is None:
            self._reduce_scatter_accumulators()
        pieces = self.optimizer.gradient_pieces()
        by_index = dict(zip(self.piece_indices, pieces))
        if self.tied is not None:
            self.tied.sum_across_stages([by_index[i] for i in self.tied.indices if i in by_index])
        if self.tensor_parallel is not None:
            self.tensor_parallel.reduce_pieces(by_index)
        gradients[:] = pieces
        self.sample_peak()

    def global_squared_norm(self, gradients: Sequence[Array | None]) -> float:
        """The squares of this rank's pieces, summed over every rank of the job (each element of
        the model lies in one chunk of one stage; a tied copy counts once)."""
        return self._squared_norm(gradients, self.piece_indices, self.decision_comm)

    # ----- during backward --------------------------------------------------------------------
    def after_backward(self) -> None:
        """What runs after every micro-batch's backward: stage 1 accumulates (float32, whole);
        stages 2-3 reduce-scatter the units the backward left incomplete."""
        self.sample_peak()
        if not self.stage.shards_gradients:
            self.optimizer.accumulate_gradients()
            self.sample_peak()
            return
        for unit, spec in enumerate(self.layout.units):
            if self.arrived[unit] or any(self.params[i].grad is not None for i in spec.indices):
                self._reduce_unit(unit)
        if self.overlap is not None:
            self.overlap.wait()
        if self.gatherer is not None:
            self.gatherer.release_holds()

    def run_group(self, layers: list[Module], x: Tensor, run_layers: RunLayers) -> Tensor:
        """The pipeline stage's way of running a group of layers: stage 3 gathers around it."""
        if self.gatherer is None:
            return run_layers(layers, x)
        return self.gatherer.run(layers, x, run_layers)

    def _arrived(self, index: int) -> None:
        """A backward completed parameter index's gradient (the hook). Stage 1 (with overlap)
        takes it into its float32 sum on the last micro-batch and starts the unit once all of
        its sums are complete; stages 2-3 reduce-scatter a unit once a backward completed it."""
        unit = self.unit_of[index]
        if not self.stage.shards_gradients:
            assert self.overlap is not None  # stage 1 hooks only with overlap
            if not self.overlap.is_last(index):
                return  # an earlier micro-batch: after_backward accumulates it
            self.optimizer.inner.accumulate_gradient(index)
        self.arrived[unit].add(index)
        if len(self.arrived[unit]) == len(self.layout.units[unit].indices):
            reduce = self._reduce_unit if self.stage.shards_gradients else self._reduce_accumulator
            reduce(unit)
        elif self.overlap is not None:
            self.overlap.progress()

    def _reduce_unit(self, unit: int) -> None:
        """Reduce-scatter one unit's 16-bit gradients; add this rank's chunk of the mean into its
        float32 sums; free the 16-bit gradients (and, in stage 3, the gathered unit)."""
        self.sample_peak()
        spec = self.layout.units[unit]
        flats = [self._gradient(index) for index in spec.indices]
        if self.optimizer.group(unit)[0].size == 1:  # the whole unit is this rank's chunk
            whole = widen(array_module(*flats).concatenate(flats))  # (a unit has a parameter)
            if self.comm.size > 1:  # an expert unit alone in its group: the 1/dp only
                whole = whole * np.float32(1.0 / self.comm.size)
            self.optimizer.add_reduced(unit, whole)
        else:
            self._reduce_scatter(unit, flats, lambda chunk: self._add_reduced(unit, chunk))
        for index in spec.indices:
            self.params[index].grad = None
        self.arrived[unit].clear()
        if self.gatherer is not None:
            self.gatherer.unit_reduced(unit)

    def _add_reduced(self, unit: int, chunk: Array) -> None:
        if self.average == "after":
            chunk = chunk * np.float32(1.0 / self.comm.size)
        self.optimizer.add_reduced(unit, chunk)

    def _gradient(self, index: int) -> Array:
        """A parameter's gradient, flat (zeros when backward gave it none, as the all-reduce)."""
        parameter = self.params[index]
        if parameter.grad is None:
            return array_module(self.send).zeros(parameter.size, parameter.dtype)
        return parameter.grad.reshape(-1)

    def _reduce_scatter(self, unit: int, flats: list[Array], then: Callable[[Array], None]) -> None:
        """Pack the unit's flat gradients (times 1/N before, by default, N the replicas), reduce-
        scatter them around the ring of the unit's group and call then(this rank's chunk of the
        sum, widened to float32): at once, or, with overlap, when the ring in flight is done (the
        rings in flight are the replicas'; an expert group's ring runs at once)."""
        size, inverse = self.layout.units[unit].size, 1.0 / self.comm.size
        comm, prefix = self.optimizer.group(unit)
        overlap = self.overlap if comm is self.comm else None
        if overlap is None:
            send, receive = self.send[:size], self.receive[:size]
        else:  # rings in flight at once need buffers of their own
            send, receive = overlap.new_buffers(self.send, size)
        offset = 0
        for flat in flats:
            pack(send[offset : offset + flat.size], flat, inverse, self.average)
            offset += flat.size
        (start, stop), bounds = self.layout.chunk(unit), self.layout.bounds[unit]
        if overlap is not None:
            overlap.start(unit, send, receive, bounds, lambda o: then(widen(o[start:stop])))
            return
        with self.sent.counting(comm, prefix + "reduce_scatter"):
            if self.wire is not None:
                fp8_reduce_scatter_into(comm, send, receive, bounds, self.wire)
            else:
                ring_reduce_scatter_into(comm, send, receive, bounds)
        then(widen(receive[start:stop]))

    def _reduce_scatter_accumulators(self) -> None:
        """Stage 1: every unit's whole float32 accumulators, reduce-scattered; this rank's chunks
        of the mean are written into its own chunks of them."""
        for index, summed in enumerate(self.optimizer.inner.master_gradients):
            if summed is None:  # no gradient reached it: zeros, as the all-reduce sends
                self._accumulator(index)[...] = 0
        for unit in range(len(self.layout.units)):
            if unit not in self.started:  # with overlap, the complete units started in backward
                self._reduce_accumulator(unit)
        if self.overlap is not None:
            self.overlap.wait()
        self.started = set()

    def _reduce_accumulator(self, unit: int) -> None:
        """Stage 1: one unit's float32 accumulators, reduce-scattered; this rank's chunk of the
        mean written into its own chunks of them."""
        inverse = 1.0 / self.comm.size
        self.started.add(unit)
        self.arrived[unit].clear()
        if self.optimizer.group(unit)[0].size == 1:  # nothing travels
            if self.comm.size > 1:  # an expert unit alone in its group: the 1/dp only
                for index in self.layout.units[unit].indices:
                    self._accumulator(index)[...] *= np.float32(inverse)
            return

        def write(chunk: Array) -> None:
            for piece in self.layout.pieces[unit]:
                target = self._accumulator(piece.index).reshape(-1)[piece.start : piece.stop]
                received = chunk[piece.offset : piece.offset + piece.size]
                unpack(target, received, inverse, self.average)

        flats = [self._accumulator(i).reshape(-1) for i in self.layout.units[unit].indices]
        self._reduce_scatter(unit, flats, write)

    def _accumulator(self, index: int) -> Array:
        """Stage 1: parameter index's whole float32 accumulator."""
        accumulator = self.optimizer.inner.accumulators[index]
        assert accumulator is not None  # stage 1 allocates every one when it shards (optimizer.py)
        return accumulator

    # ----- the memory account -----------------------------------------------------------------
    def arrays_by_kind(self) -> dict[str, list[Array | None]]:
        """What this rank holds, by kind: the sharded optimizer's arrays, the reduce-scatters'
        buffers (and those of the rings in flight), stage 3's gathered units."""
        arrays = self.optimizer.arrays_by_kind()
        arrays["buffers"] = arrays["buffers"] + [self.send, self.receive]
        if self.overlap is not None:
            arrays["buffers"] += self.overlap.buffers()
        if self.gatherer is not None:
            arrays.update(self.gatherer.arrays_by_kind())
        return arrays


class OverlappedUnits(RingsInFlight):
    """The rings in flight of one ZeroDataParallel, counted as "reduce_scatter"."""

    def __init__(self, comm: Communicator, sent: BytesSent, parameters: int, micro_batches: int,
                 wire: Fp8Wire | None = None):
        """parameters, micro_batches: for stage 1, which starts on the step's last backward;
        wire: the fp8 wire's codec, if the gradients travel on it."""
        super().__init__(comm, sent, "reduce_scatter", wire)
        self.micro_batches = micro_batches
        self.arrivals = [0] * parameters  # stage 1: backwards that reached each, this step

    def is_last(self, index: int) -> bool:
        """Stage 1: count a backward that reached parameter index; whether it was the step's
        last. One too many would have been sent before its sum was complete: refused."""
        self.arrivals[index] += 1
        refuse_incomplete(index, self.arrivals[index], self.micro_batches, "ZeroDataParallel")
        return self.arrivals[index] == self.micro_batches

    def new_buffers(self, like: Array, size: int) -> tuple[Array, Array]:
        """A send and a receive buffer for one ring: size elements of like's dtype and device."""
        xp = array_module(like)
        return xp.empty(size, like.dtype), xp.empty(size, like.dtype)

    def start(self, unit: int, send: Array, receive: Array, bounds: Sequence[tuple[int, int]],
              then: Callable[[Array], None]) -> None:
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


def zero_data_parallel(stage: ZeroStage | int, optimizer: Optimizer, layers: list[Module],
                       comm: Communicator, *, tied: TiedGradients | None = None,
                       experts: frozenset[int] = frozenset(),
                       expert_comm: Communicator | None = None,
                       gather_wire: Fp8Wire | None = None, **options: Any) -> ZeroDataParallel:
    """Shard a stage's optimizer (built, and resumed, as without ZeRO) over comm's replicas and
    return its GradientSync; `.optimizer` is the ShardedOptimizer the step must use, and
    `.run_group` the way the pipeline stage must run its layers. stage: a ZeroStage, or its
    number (--zero); layers: the stage's layers, in order; experts: the optimizer positions of a
    mixture's experts, sharded over expert_comm (with --ep the replicas holding the same experts;
    by default comm); gather_wire: stage 3's all-gathers in fp8 (zero/optimizer.py); options:
    those of ZeroDataParallel."""
    stage = zero_stage(stage)
    tied_indices = set(tied.indices) if tied is not None else set()
    units, layer_units = plan_units(layers, optimizer.params, tied_indices, experts)
    expert_comm = expert_comm or comm
    layout = ZeroLayout(units, comm.rank, comm.size, expert_comm.rank, expert_comm.size)
    sent = BytesSent()
    sharded = ShardedOptimizer(optimizer, layout, comm, stage.number, sent, expert_comm,
                               gather_wire)
    sync = ZeroDataParallel(comm, sharded, tied=tied, sent=sent, **options)
    if stage.shards_parameters:
        sync.gatherer = ParameterGatherer(sharded, layers, layer_units, sync.sample_peak)
    return sync
