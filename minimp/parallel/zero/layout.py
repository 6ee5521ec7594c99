"""ZeRO's layout: which rank holds which elements of which parameters (arithmetic only, no ranks).

A pipeline stage's parameters are grouped into units: the parameters of one layer, and apart from
them every parameter that more than one layer reads (the GPT's token embedding, which the head reads
too) or that another stage holds a copy of (parallel/pipeline/tied.py). A unit is what ZeRO moves at
once: stage 3 gathers a layer's units just before the layer runs, stages 2 and 3 reduce-scatter a
unit as soon as its gradients are complete (ZeRO's "buckets" are these units, so --bucket-mb is for
stage 0 only).

Each unit is laid out flat, its parameters one after another in the order
`nn.module.reachable_parameters` finds them in its layer (the same on every rank), and cut into N
chunks by `chunk_bounds`, the ring's own cut (the first size % N chunks get one element more, and
chunks are empty when the unit has fewer than N elements). Rank r holds chunk r of every unit.
Where a parameter meets a chunk is a `Piece`. Example: a unit [W (3 x 2), b (3)] has 9 elements;
with N = 2 the chunks are [0, 5) and [5, 9), so rank 0 holds W's elements 0..4 and rank 1 holds W's
element 5 and all of b: pieces (W, 0, 5) on rank 0, (W, 5, 6) and (b, 0, 3) on rank 1.

A mixture's experts (--experts) are a unit of their own in each layer, an expert unit, cut over
the expert group: with --ep the replicas holding the same experts (Megatron-Core's expert data
parallel group, dp/ep ranks), without it the replicas, as the dense units. Rank r holds chunk r of
a unit in that unit's group.
"""

from collections import Counter
from dataclasses import dataclass
from itertools import accumulate

from minimp.distributed.ring import chunk_bounds
from minimp.nn.module import Module, Parameter, reachable_parameters


@dataclass(frozen=True)
class Piece:
    """Where one parameter meets this rank's chunk of its unit. index: the parameter's position in
    the optimizer; start, stop: the piece is elements start..stop-1 of the flattened parameter;
    offset: where the piece begins in this rank's chunk of the unit."""

    index: int
    start: int
    stop: int
    offset: int

    @property
    def size(self) -> int:
        """Elements in the piece."""
        return self.stop - self.start


@dataclass(frozen=True)
class Unit:
    """Parameters laid out flat, one after another: indices (optimizer positions) and sizes;
    expert: they are a mixture's experts, cut over the expert group."""

    indices: tuple[int, ...]
    sizes: tuple[int, ...]
    expert: bool = False

    @property
    def size(self) -> int:
        """Elements in the unit."""
        return sum(self.sizes)

    def offsets(self) -> list[int]:
        """Where each parameter begins in the flat unit."""
        return list(accumulate(self.sizes, initial=0))[:-1]

    def pieces(self, rank: int, world_size: int) -> list[Piece]:
        """The non-empty intersections of rank's chunk with each parameter, in order."""
        chunk_start, chunk_stop = chunk_bounds(self.size, world_size)[rank]
        pieces = []
        for index, begin, size in zip(self.indices, self.offsets(), self.sizes):
            start, stop = max(chunk_start, begin), min(chunk_stop, begin + size)
            if start < stop:
                pieces.append(Piece(index, start - begin, stop - begin, start - chunk_start))
        return pieces


class ZeroLayout:
    """The units of one stage and this rank's chunk of each, over N data-parallel ranks: `units`,
    the stage's parameters laid out flat, and this rank, `rank` of `world_size` = N; the expert
    units over this rank's expert group, `expert_rank` of `expert_world_size` (by default the
    data-parallel ranks too)."""

    def __init__(self, units: list[Unit], rank: int, world_size: int,
                 expert_rank: int | None = None, expert_world_size: int | None = None):
        self.units, self.rank, self.world_size = units, rank, world_size
        expert = (rank if expert_rank is None else expert_rank,
                  world_size if expert_world_size is None else expert_world_size)
        # (this rank's place, ranks) in each unit's group
        self.places = [expert if unit.expert else (rank, world_size) for unit in units]
        self.bounds = [chunk_bounds(unit.size, n) for unit, (_, n) in zip(units, self.places)]
        self.pieces = [unit.pieces(r, n) for unit, (r, n) in zip(units, self.places)]

    def chunk(self, unit: int, rank: int | None = None) -> tuple[int, int]:
        """(start, stop) of a rank's chunk (this rank's by default) in the flat unit."""
        return self.bounds[unit][self.places[unit][0] if rank is None else rank]

    def chunk_size(self, unit: int, rank: int | None = None) -> int:
        """Elements of a unit a rank holds (this rank by default)."""
        start, stop = self.chunk(unit, rank)
        return stop - start

    def shard_size(self, rank: int | None = None) -> int:
        """Elements a rank holds: its chunks of every unit (rank: its place in each unit's
        group)."""
        return sum(self.chunk_size(unit, rank) for unit in range(len(self.units)))

    def largest_unit(self) -> int:
        """Elements of the largest unit that travels, cut over more than one rank (what one
        reduce-scatter or all-gather buffer holds); 0 when none does."""
        return max((unit.size for unit, (_, n) in zip(self.units, self.places) if n > 1),
                   default=0)

    def unit_of(self) -> dict[int, int]:
        """{optimizer position: its unit}."""
        return {index: u for u, unit in enumerate(self.units) for index in unit.indices}


def plan_units(layers: list[Module], params: list[Parameter], tied: set[int],
               experts: frozenset[int] = frozenset()) -> tuple[list[Unit], list[list[int]]]:
    """(units, the units each layer reads) for a stage's layers and its optimizer's parameters
    (params, in optimizer order). tied: optimizer positions another stage holds a copy of;
    experts: those of a mixture's experts (a unit of their own in each layer)."""
    position = {id(parameter): index for index, parameter in enumerate(params)}
    reads = [[position[id(p)] for p in reachable_parameters(layer) if id(p) in position]
             for layer in layers]
    readers = Counter(index for indices in reads for index in indices)
    shared = {index for index, count in readers.items() if count > 1} | set(tied)
    units: list[Unit] = []
    unit_of: dict[int, int] = {}

    def add(indices: list[int], expert: bool = False) -> None:
        for index in indices:
            unit_of[index] = len(units)
        units.append(Unit(tuple(indices), tuple(params[i].size for i in indices), expert))

    for indices in reads:
        own = [index for index in indices if index not in shared and index not in unit_of]
        for kind in (False, True):  # the layer's dense parameters, then its experts
            if part := [index for index in own if (index in experts) == kind]:
                add(part, kind)
        for index in indices:
            if index in shared and index not in unit_of:
                add([index])
    for index in range(len(params)):  # a parameter no layer of the stage reads: a unit of its own
        if index not in unit_of:
            add([index], index in experts)
    layer_units = [sorted({unit_of[index] for index in indices}) for indices in reads]
    return units, layer_units
