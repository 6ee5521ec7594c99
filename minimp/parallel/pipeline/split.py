"""Cutting a model's ordered layers: into pipeline stages (or interleaved chunks) balanced by
parameter count, into the groups that run as one (a layer with weights and the weightless layers
after it), and learning the activation shapes at every cut."""

from dataclasses import dataclass, field
from typing import Callable

from minimp.backend import Array
from minimp.nn.module import Module, Parameter, reachable_parameters
from minimp.tensor import Tensor, no_grad

RunLayers = Callable[[list[Module], Tensor], Tensor]  # how a group of layers runs: run_layers


class PipelineError(ValueError):
    """The model cannot be split as asked."""


@dataclass
class StageChunk:
    """One chunk of a rank's layers (a virtual stage) and the activation shapes at its ends."""

    layers: list[Module]
    input_shape: tuple[int, ...]
    output_shape: tuple[int, ...]
    groups: list[list[Module]] = field(init=False)
    parameters: list[Parameter] = field(init=False)

    def __post_init__(self) -> None:
        self.groups = [self.layers[start:stop] for start, stop in layer_groups(self.layers)]
        self.parameters = [p for layer in self.layers for p in reachable_parameters(layer)]


def split_stages(layers: list[Module], stages: int) -> list[tuple[int, int]]:
    """[(start, stop)] layer ranges of `stages` contiguous stages, balanced by parameter count.

    Parameter count is the cost because, in an MLP, each weight costs the same multiply-adds per
    sample forward and backward. Each layer with parameters opens a block that also takes the
    parameter-free layers after it (a ReLU stays with its Linear); blocks are then cut so that the
    most expensive stage is as cheap as possible (`_balanced_cuts`).
    """
    return split_counts([sum(p.size for p in layer.parameters()) for layer in layers], stages)


def split_counts(counts: list[int], stages: int) -> list[tuple[int, int]]:
    """split_stages for layers holding counts[i] parameters (known before any is built)."""
    blocks = count_groups(counts)
    if stages > len(blocks):
        raise PipelineError(f"--pp {stages} needs at least {stages} layers with weights, the model "
                            f"has {len(blocks)} (use --layers)")
    costs = [sum(counts[a:b]) for a, b in blocks]
    cuts = _balanced_cuts(costs, stages)
    return [(blocks[first][0], blocks[last - 1][1])
            for first, last in zip([0] + cuts, cuts + [len(blocks)])]


def layer_groups(layers: list[Module]) -> list[tuple[int, int]]:
    """[(start, stop)]: each layer with parameters and the parameter-free layers after it (a
    Linear and its ReLU). What pipelines cut between, and what runs as one: recomputed as one
    block (--recompute), gathered around by ZeRO stage 3."""
    return count_groups([sum(p.size for p in layer.parameters()) for layer in layers])


def count_groups(counts: list[int]) -> list[tuple[int, int]]:
    """layer_groups for layers holding counts[i] parameters."""
    starts = [i for i, count in enumerate(counts) if count > 0]
    if not starts:
        return [(0, len(counts))] if counts else []
    starts[0] = 0
    return list(zip(starts, starts[1:] + [len(counts)]))


def run_layers(layers: list[Module], x: Tensor) -> Tensor:
    """The layers applied in order (how a group runs by default)."""
    for layer in layers:
        x = layer(x)
    return x


def _balanced_cuts(costs: list[int], parts: int) -> list[int]:
    """Cut points splitting costs into `parts` contiguous non-empty groups, minimising the largest
    sum: a binary search over that largest sum, each candidate tried by one greedy pass. That is
    O(n log(total)); the textbook dynamic programme is O(parts n^2), minutes for 10^4 layers."""
    low, high = max(costs), sum(costs)
    while low < high:  # the smallest limit that `parts` groups can keep to
        middle = (low + high) // 2
        if _groups_needed(costs, middle) <= parts:
            high = middle
        else:
            low = middle + 1
    return _greedy_cuts(costs, low, parts)


def _groups_needed(costs: list[int], limit: int) -> int:
    """How many groups a greedy pass needs when no group may sum to more than limit."""
    groups, total = 1, 0
    for cost in costs:
        if total + cost > limit:
            groups, total = groups + 1, 0
        total += cost
    return groups


def _greedy_cuts(costs: list[int], limit: int, parts: int) -> list[int]:
    """Fill each group up to `limit`, but cut early where the blocks left are just enough to give
    each of the remaining groups one."""
    cuts: list[int] = []
    total = 0
    for index, cost in enumerate(costs):
        groups_after_this_one = parts - len(cuts) - 1
        if index > 0 and (total + cost > limit or len(costs) - index == groups_after_this_one):
            cuts.append(index)
            total = 0
        total += cost
    return cuts


def cut_shapes(layers: list[Module], sample: Array) -> list[tuple[int, ...]]:
    """shapes[i]: the shape of the activation entering layer i for one micro-batch `sample`
    (shapes[len(layers)] is the output's). One forward without a graph, on every rank, so both
    sides of every cut know the shape of the bytes they exchange."""
    shapes, x = [tuple(sample.shape)], Tensor(sample)
    with no_grad():
        for layer in layers:
            x = layer(x)
            shapes.append(tuple(x.shape))
    return shapes


def stage_parameters(model: Module, bounds: tuple[int, int]) -> list[tuple[str, Parameter]]:
    """(name, Parameter) of the layers in range(*bounds) of a Sequential, named as in the whole
    model ("4.weight"), so every layout writes the same checkpoint names."""
    start, stop = bounds
    return [(name, parameter) for name, parameter in model.named_parameters()
            if start <= int(name.split(".")[0]) < stop]
