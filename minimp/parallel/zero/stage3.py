"""ZeRO stage 3: a layer's compute copy exists only while the layer runs; only the chunks persist.

Just before a layer's forward its units are all-gathered from every rank's chunk (ShardedOptimizer's
`compute_chunks`) into a new flat array, and the layer's parameters become views of it; after the
forward they are freed again. For backward the same units are gathered once more, when the
gradient reaches the layer's output (a tensor hook), and freed when their gradients are complete
(the ZeRO GradientSync reduce-scatters them and calls `unit_reduced`). A unit two layers read
(the GPT's token embedding) is counted, not gathered twice while it is held.

Freed means freed: an op's graph would keep the gathered weight alive until backward (a Linear
saves its W), so the forward runs under `saved_tensors_hooks` that store a weight, or a view of
one, as a note of where it lay (unit, offset, shape, strides), and rebuild it from the unit's new
copy when backward reads it. PyTorch's FSDP frees the storage under the saved tensor instead; a
NumPy array's memory cannot be taken from under it, so minimp swaps the references.

A freed parameter's `.data` is a read-only broadcast of one NaN: the right shape and dtype, one
element of memory, and NaN in anything that reads it by mistake.
"""

from dataclasses import dataclass
from typing import Callable

import numpy as np

from minimp.backend import Array, array_module, data_address
from minimp.function import saved_tensors_hooks
from minimp.nn import Module
from minimp.parallel.pipeline.split import RunLayers
from minimp.parallel.zero.optimizer import ShardedOptimizer
from minimp.tensor import Tensor, memory_owner


@dataclass(frozen=True)
class _Packed:
    """Where a saved weight lay in its unit's gathered array."""

    unit: int
    offset: int  # elements from the start of the unit's flat array
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def free(parameter: Tensor) -> None:
    """Replace a parameter's compute copy by a broadcast of one NaN (see the module)."""
    xp = array_module(parameter.data)
    nan = xp.full((), np.nan, parameter.dtype)
    parameter.data = xp.broadcast_to(nan, parameter.shape)


class ParameterGatherer:
    """Gathers and frees the units of stage 3 around each group of layers the stage runs."""

    def __init__(self, optimizer: ShardedOptimizer, layers: list[Module],
                 layer_units: list[list[int]], sample: Callable[[], None] = lambda: None):
        """optimizer: the ShardedOptimizer (stage 3), whose `sent` counts the all-gathers;
        layers and layer_units: the stage's layers and the units each one reads
        (layout.plan_units); sample(): called after each gather (the trainer measures the
        peak memory there)."""
        self.optimizer, self.layout, self.sample = optimizer, optimizer.layout, sample
        self.params, self.sent = optimizer.params, optimizer.sent
        self.units_of_layer = {id(layer): units for layer, units in zip(layers, layer_units)}
        count = len(self.layout.units)
        self.counts, self.holds = [0] * count, [0] * count
        self.flats: list[Array | None] = [None] * count
        self.unit_by_owner: dict[int, int] = {}
        for parameter in self.params:
            free(parameter)

    def run(self, layers: list[Module], x: Tensor, run_layers: RunLayers) -> Tensor:
        """run_layers(layers, x) with their units gathered, and gathered again for backward."""
        units = sorted({u for layer in layers for u in self.units_of_layer.get(id(layer), ())})
        for unit in units:
            self._acquire(unit)
        with saved_tensors_hooks(self._pack, self._unpack):
            y = run_layers(layers, x)
        for unit in units:
            self._release(unit)
        if y.requires_grad and units:
            y.register_hook(lambda grad: self._hold(units))
        return y

    def _hold(self, units: list[int]) -> None:
        """Before the layers' backward: gathered until their gradients are complete."""
        for unit in units:
            self._acquire(unit)
            self.holds[unit] += 1

    def unit_reduced(self, unit: int) -> None:
        """The unit's gradients are complete (and reduce-scattered): drop the backward's holds."""
        while self.holds[unit]:
            self.holds[unit] -= 1
            self._release(unit)

    def release_holds(self) -> None:
        """After a backward: drop the holds of units no gradient reached."""
        for unit in range(len(self.holds)):
            self.unit_reduced(unit)

    def _acquire(self, unit: int) -> None:
        self.counts[unit] += 1
        if self.counts[unit] > 1:
            return
        spec, chunk = self.layout.units[unit], self.optimizer.compute_chunks[unit]
        flat = array_module(chunk).empty(spec.size, chunk.dtype)
        self.optimizer.all_gather(unit, chunk, flat)
        for index, begin, size in zip(spec.indices, spec.offsets(), spec.sizes):
            parameter = self.params[index]
            parameter.data = flat[begin : begin + size].reshape(parameter.shape)
        self.flats[unit] = flat
        self.unit_by_owner[id(flat)] = unit
        self.sample()

    def _release(self, unit: int) -> None:
        self.counts[unit] -= 1
        if self.counts[unit] > 0:
            return
        for index in self.layout.units[unit].indices:
            free(self.params[index])
        del self.unit_by_owner[id(self.flats[unit])]
        self.flats[unit] = None

    def _pack(self, array: Array) -> "Array | _Packed":
        owner = memory_owner(array) if hasattr(array, "base") else None
        unit = self.unit_by_owner.get(id(owner))
        if unit is None:
            return array  # an activation: kept as it is
        offset = (data_address(array) - data_address(owner)) // array.itemsize
        return _Packed(unit, offset, tuple(array.shape), tuple(array.strides))

    def _unpack(self, packed: "Array | _Packed") -> Array:
        if not isinstance(packed, _Packed):
            return packed
        flat = self.flats[packed.unit]
        if flat is None:
            raise RuntimeError(f"ZeRO stage 3: unit {packed.unit} is not gathered for backward")
        start = flat[packed.offset :]
        strided = array_module(flat).lib.stride_tricks.as_strided
        return strided(start, shape=packed.shape, strides=packed.strides)

    def arrays_by_kind(self) -> dict[str, list[Array | None]]:
        """The units gathered right now (none at the end of a step)."""
        return {"gathered": [flat for flat in self.flats if flat is not None]}
