"""Dropout as a module, and the state its masks are drawn from (seed, step, global sample index),
so that every parallel layout and recomputation draws the same masks."""

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from minimp import backend, functional
from minimp.nn.module import Module
from minimp.tensor import Tensor


@dataclass
class DropoutState:
    """What a dropout mask is drawn from besides the layer: the run's seed, the optimizer step,
    and the global batch index of every row the caller holds (`sample_indices[r]` for row r)."""

    seed: int
    step: int
    sample_indices: np.ndarray


class Dropout(Module):
    """Zero each element with probability p in training mode, scaling the rest by 1/(1 - p).

    `layer` numbers this dropout within its model; with the `state` set by `set_dropout_state`
    it makes the mask a pure function of (seed, step, layer, sample, position), the same in
    every parallel layout and when an activation is recomputed (minimp/ops/dropout.py).
    """

    def __init__(self, p: float = 0.5, layer: int = 0):
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must lie in [0, 1), got {p}")
        self.p, self.layer = p, layer
        self.state: DropoutState | None = None
        # Tensor and sequence parallelism: the input is slice `slice_index` of equal slices of
        # the whole tensor's axis 1 (heads, positions); its masks are that slice of the whole's.
        self.slice_index = 0

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.state is None:
            raise RuntimeError(
                f"Dropout(p={self.p}) in training mode needs the rows' seed, step and global "
                "sample indices: call nn.set_dropout_state(model, seed, step, sample_indices) "
                "before the forward (or model.eval(), or p=0)"
            )
        state, per_sample = self.state, int(np.prod(x.shape[1:]))
        return functional.dropout(
            x, self.p, state.seed, state.step, self.layer, state.sample_indices,
            offset=self.slice_index * per_sample,
        )  # fmt: skip

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, layer={self.layer})"


def set_dropout_state(model: Module, seed: int, step: int, sample_indices: npt.ArrayLike) -> None:
    """Tell every Dropout in model which (seed, step) this forward belongs to and which global
    samples its rows are. Set it before each forward (each micro-batch has its own rows)."""
    state = DropoutState(seed, step, np.asarray(backend.to_numpy(sample_indices)))
    for module in model.modules():
        if isinstance(module, Dropout):
            module.state = state
