"""ZeRO's optimizer: the float32 masters and optimizer state of this rank's chunks only, updated
piece by piece with the wrapped optimizer's rule, and the compute copies made whole again.

Rajbhandari et al. 2020 ("ZeRO: Memory Optimizations Toward Training Trillion Parameter Models"),
section 5. With N data-parallel ranks each rank keeps 1/N of the masters and of Adam's two slots
(minimp/parallel/zero/layout.py says which 1/N), so those 12 bytes a parameter become 12/N. The
gradients it updates with are its chunks of the mean over the ranks, which the ZeRO GradientSync
(minimp/parallel/zero/data_parallel.py) reduce-scatters into place:

  stage 1  the float32 accumulators stay whole (every micro-batch adds into them, as without ZeRO);
           the reduce-scatter writes this rank's chunks of the mean into its own chunks of them
  stage 2  only this rank's chunks of the accumulators exist (`gradient_chunks`); each unit's
           16-bit gradients are reduce-scattered into them as soon as a backward completes them
  stage 3  as stage 2, and the compute copies are chunks too (`compute_chunks`); the layers gather
           them when they run (minimp/parallel/zero/stage3.py)

Its part of the mixed-precision step is the optimizer's: `accumulate_gradients()`, `step()`,
`zero_grad()`. `step()` updates every piece with `Optimizer.update`, the wrapped optimizer's rule
(minimp/optim/optimizer.py's `sgd` or `adam`: elementwise, so a piece gets the bits the whole
parameter would), rounds the chunks into the compute dtype and, in stages 1 and 2, all-gathers
them into every rank's whole compute copies.

Stage 3 with `gather_wire` (--param-gather-dtype fp8, ZeRO++'s qwZ, Wang et al. 2023 section
3.1): each owner's chunk travels as fp8 values behind its float32 scale
(minimp/distributed/ring_fp8.py), decoded on every rank, the owner's included, and rounded into
the compute dtype; the masters and the chunks kept between steps stay as they were.

A mixture's expert units (layout.py) are gathered over their own group, `expert_comm` (with --ep
the replicas holding the same experts), and their bytes counted as "expert_all_gather".
"""

from types import ModuleType
from typing import Any

import numpy as np

from minimp.backend import Array, array_module
from minimp.distributed import gather_named_arrays
from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import ring_all_gather_inplace
from minimp.distributed.ring_fp8 import fp8_all_gather_inplace
from minimp.measure.accounts import BytesSent
from minimp.optim import Optimizer
from minimp.parallel.zero.layout import Piece, ZeroLayout
from minimp.precision.casting import MASTER_DTYPE, round_to, widen
from minimp.precision.wire import Fp8Wire
from minimp.precision.step import MixedPrecisionOptimizer


class ShardedOptimizer(MixedPrecisionOptimizer):
    """Masters, slots (and, from stage 2, gradient sums) of this rank's chunks; see the module."""

    def __init__(self, optimizer: Optimizer, layout: ZeroLayout, comm: Communicator, stage: int,
                 sent: BytesSent | None = None, expert_comm: Communicator | None = None,
                 gather_wire: Fp8Wire | None = None):
        """optimizer: the whole optimizer of this stage, built (and resumed) as without ZeRO; its
        masters and slots are cut into this rank's chunks and then dropped. comm: the
        data-parallel replicas of this stage, over which the layout was cut. sent: counts the
        all-gathers' bytes (shared with the GradientSync's counter). expert_comm: the group the
        expert units were cut over (by default comm). gather_wire: stage 3's all-gathers in fp8
        (the module's docstring); None: in the compute dtype."""
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage}")
        if gather_wire is not None and stage != 3:
            raise ValueError(f"ZeRO stage {stage} gathers updated compute copies, not parameters "
                             "for a layer: an fp8 gather_wire needs stage 3")
        self.gather_wire = gather_wire
        self.inner, self.layout, self.comm, self.stage = optimizer, layout, comm, stage
        self.expert_comm = expert_comm or comm
        self.params = optimizer.params
        self.dtype = self.params[0].dtype if self.params else MASTER_DTYPE
        xp = array_module(*optimizer.master_weights)
        units = range(len(layout.units))
        self.masters = [self._cut(unit, optimizer.master_weights, xp) for unit in units]
        self.slots = [
            [{name: _part(optimizer.slots[p.index][name], p) for name in optimizer.slot_names}
             for p in pieces]
            for pieces in layout.pieces
        ]  # fmt: skip
        if stage == 1:  # whole accumulators, allocated now: the masters they take shapes from go
            for index, master in enumerate(optimizer.master_weights):
                optimizer.accumulators[index] = xp.empty(master.shape, MASTER_DTYPE)
        self.gradient_chunks = [xp.zeros_like(m) for m in self.masters] if stage > 1 else []
        self.fresh = [True] * len(self.gradient_chunks)  # no reduced gradient arrived this step
        # Stage 3's compute copies are chunks; in float32 the chunk is the master itself.
        self.compute_chunks = [round_to(m, self.dtype) for m in self.masters] if stage == 3 else []
        self.sent = sent or BytesSent()
        many = layout.largest_unit() > 0 and stage < 3  # some unit travels
        self.gather_buffer = xp.empty(layout.largest_unit(), self.dtype) if many else None
        optimizer.master_weights = [None] * len(self.params)  # the whole masters are not kept
        optimizer.slots = [dict.fromkeys(optimizer.slot_names) for _ in self.params]

    def _cut(self, unit: int, arrays: list, xp: ModuleType) -> Array:
        """This rank's chunk of a unit, copied out of whole per-parameter arrays (float32)."""
        chunk = xp.empty(self.layout.chunk_size(unit), MASTER_DTYPE)
        for piece in self.layout.pieces[unit]:
            chunk[piece.offset : piece.offset + piece.size] = _part(arrays[piece.index], piece)
        return chunk

    def group(self, unit: int) -> tuple[Communicator, str]:
        """The communicator a unit is cut over, and the prefix of its collectives' names in the
        byte account: "expert_" over an expert group of its own, else none."""
        if self.layout.units[unit].expert and self.expert_comm is not self.comm:
            return self.expert_comm, "expert_"
        return self.comm, ""

    # ----- the wrapped optimizer's settings ---------------------------------------------------
    @property
    def lr(self) -> float:
        """The learning rate (the wrapped optimizer's: the trainer sets it every step)."""
        return self.inner.lr

    @lr.setter
    def lr(self, value: float) -> None:
        self.inner.lr = value

    @property
    def step_count(self) -> int:
        """Steps taken (Adam's bias correction reads it from the wrapped optimizer)."""
        return self.inner.step_count

    def state_dict(self) -> dict:
        """step_count and lr; the arrays are chunks: `gather_state` makes them whole."""
        return {"step_count": self.step_count, "lr": self.lr}

    # ----- the optimizer's part of the step ---------------------------------------------------
    def accumulate_gradients(self) -> list[Array | None]:
        """Stage 1: each parameter's 16-bit gradient into its whole float32 accumulator, as
        Optimizer does; returns them. Stages 2-3: the gradients were reduce-scattered during
        backward; returns this rank's gradient pieces (see `gradient_pieces`)."""
        if self.stage == 1:
            return list(self.inner.accumulate_gradients())
        pending = [i for i, parameter in enumerate(self.params) if parameter.grad is not None]
        if pending:
            raise RuntimeError(f"ZeRO stage {self.stage}: parameter(s) {pending} hold gradients "
                               "that were not reduce-scattered; call the GradientSync's "
                               "after_backward() after each backward")
        return self.gradient_pieces()

    def gradient_pieces(self) -> list[Array]:
        """This rank's gradients, one float32 view per piece (layout order): of the whole
        accumulators in stage 1, of `gradient_chunks` from stage 2. A unit no gradient reached
        this step gives zeros, as data parallelism's all-reduce does."""
        return [self._gradient_piece(unit, piece)
                for unit, pieces in enumerate(self.layout.pieces) for piece in pieces]

    def _gradient_piece(self, unit: int, piece: Piece) -> Array:
        if self.stage == 1:
            return _part(self.inner.accumulators[piece.index], piece, copy=False)
        if self.fresh[unit]:
            self.gradient_chunks[unit][...] = 0
            self.fresh[unit] = False
        return self.gradient_chunks[unit][piece.offset : piece.offset + piece.size]

    def add_reduced(self, unit: int, chunk: Array) -> None:
        """Stages 2-3: add one micro-batch's reduced chunk of a unit into this rank's sums
        (float32; the first of the step is copied, so one micro-batch gives its exact bits)."""
        if self.fresh[unit]:
            self.gradient_chunks[unit][...] = chunk
            self.fresh[unit] = False
        else:
            self.gradient_chunks[unit] += chunk

    def step(self) -> None:
        """Update every piece (its master, its slots) with its gradient, as it is (unscaled and
        clipped already), then bring the compute copies up to date."""
        self.inner.step_count += 1
        for unit, unit_pieces in enumerate(self.layout.pieces):
            for piece, slots in zip(unit_pieces, self.slots[unit]):
                master = self.masters[unit][piece.offset : piece.offset + piece.size]
                grad = self._gradient_piece(unit, piece)
                self.inner.update(master, grad, slots, self.inner.weight_decays[piece.index])
        self.publish()

    def publish(self) -> None:
        """Round the masters into the compute dtype: stage 3 keeps the chunks; stages 1-2
        all-gather each unit, one unit at a time, into every rank's whole compute copies."""
        for unit, spec in enumerate(self.layout.units):
            if self.stage == 3:
                if self.compute_chunks[unit] is not self.masters[unit]:
                    self.compute_chunks[unit][...] = round_to(self.masters[unit], self.dtype)
                continue
            flat = self._gathered(unit)
            for index, begin, size in zip(spec.indices, spec.offsets(), spec.sizes):
                self.params[index].data.reshape(-1)[...] = flat[begin : begin + size]

    def _gathered(self, unit: int) -> Array:
        """The unit's whole compute copy, flat: all-gathered from every rank's chunk."""
        rounded = round_to(self.masters[unit], self.dtype)
        if self.group(unit)[0].size == 1:  # one rank: the chunk is the unit
            return rounded
        assert self.gather_buffer is not None  # allocated when any unit travels
        return self.all_gather(unit, rounded, self.gather_buffer[: self.layout.units[unit].size])

    def all_gather(self, unit: int, chunk: Array, flat: Array) -> Array:
        """flat (the unit's size) made the whole unit: this rank's chunk written into its place,
        every other rank's gathered around the ring (stage 3's layers gather so too)."""
        start, stop = self.layout.chunk(unit)
        flat[start:stop] = chunk
        comm, prefix = self.group(unit)
        if comm.size > 1:
            with self.sent.counting(comm, prefix + "all_gather"):
                if self.gather_wire is None:
                    ring_all_gather_inplace(comm, flat, self.layout.bounds[unit])
                else:  # decoded in float32, then rounded once into the compute dtype
                    whole = widen(flat)  # flat itself when float32
                    fp8_all_gather_inplace(comm, whole, self.layout.bounds[unit],
                                           self.gather_wire)
                    flat[...] = round_to(whole, flat.dtype)
        return flat

    def zero_grad(self) -> None:
        """Forget the gradients: the parameters', and this step's sums (the buffers stay)."""
        self.inner.zero_grad()
        self.fresh = [True] * len(self.gradient_chunks)

    # ----- checkpoints and the memory account -------------------------------------------------
    def gather_state(self, names: list[str]) -> dict[str, Any] | None:
        """Every rank sends its pieces to rank 0 of each unit's group, which returns those whole
        masters and slots under the one-process names (master/<name>, optimizer/<name>/<slot>):
        data-parallel rank 0 this stage's, and with an expert group of their own each expert
        group's rank 0 its experts (with --ep, data-parallel ranks 1 .. ep - 1 return only
        theirs); None on the other ranks. A collective of the replicas (and the expert groups)."""
        whole: dict[str, Any] | None = None
        groups = [self.comm] if self.expert_comm is self.comm else [self.comm, self.expert_comm]
        for comm in groups:
            pieces: dict[str, Any] = {}
            for unit, unit_pieces in enumerate(self.layout.pieces):
                if self.group(unit)[0] is comm:
                    pieces.update(self._named_pieces(unit, unit_pieces, names))
            gathered = gather_named_arrays(comm, pieces)
            if gathered is not None:
                whole = {**(whole or {}), **gathered}
        return None if whole is None else _stitch(whole, names, self.params)

    def _named_pieces(self, unit: int, pieces: list[Piece], names: list[str]) -> dict[str, Any]:
        """{"master/<name>@<start>": this rank's piece, "optimizer/<name>/<slot>@<start>": ...}."""
        named: dict[str, Any] = {}
        for piece, slots in zip(pieces, self.slots[unit]):
            name, at = names[piece.index], f"@{piece.start}"
            chunk = self.masters[unit][piece.offset : piece.offset + piece.size]
            named[f"master/{name}{at}"] = chunk
            for slot, value in slots.items():
                if value is not None:
                    named[f"optimizer/{name}/{slot}{at}"] = value
        return named

    def arrays_by_kind(self) -> dict[str, list[Any]]:
        """What this optimizer holds, by kind (minimp/measure/accounts.py adds the bytes up)."""
        slots = [v for unit in self.slots for s in unit for v in s.values() if v is not None]
        accumulators = self.gradient_chunks or list(self.inner.accumulators)
        compute = self.compute_chunks or [parameter.data for parameter in self.params]
        buffers = [] if self.gather_buffer is None else [self.gather_buffer]
        return {
            "parameters": compute,
            "gradients": [parameter.grad for parameter in self.params],
            "accumulators": accumulators,
            "masters": self.masters,
            "optimizer_state": slots,
            "buffers": buffers,
        }


def _part(array: Array | None, piece: Piece, copy: bool = True) -> Array | None:
    """A piece of a whole per-parameter array (flattened); None stays None."""
    if array is None:
        return None
    part = array.reshape(-1)[piece.start : piece.stop]
    return part.copy() if copy else part


def _stitch(gathered: dict[str, Any], names: list[str], params: list) -> dict[str, Any]:
    """{"master/w@0": piece, "master/w@5": piece, ...} -> {"master/w": whole array}."""
    shapes = {name: params[index].shape for index, name in enumerate(names)}
    whole: dict[str, Any] = {}
    for key, piece in gathered.items():
        base, start = key.rsplit("@", 1)
        name = base.split("/")[1]
        if base not in whole:
            whole[base] = np.empty(shapes[name], np.float32)
        whole[base].reshape(-1)[int(start) : int(start) + piece.size] = piece
    order = {name: position for position, name in enumerate(names)}  # as one process lists them
    return dict(sorted(whole.items(), key=lambda item: order[item[0].split("/")[1]]))
