"""The layers MLPs and GPTs are built from: Linear, ReLU, Tanh, GELU, LayerNorm, Embedding,
Dropout, Sequential.

Each forward but Sequential's is one op (of minimp.functional, or a Tensor method: ReLU, Tanh);
initial values come from a NumPy Generator passed in, so every rank builds the same model.
Dropout's masks are drawn from a state (seed, step, global sample index) set before each forward,
so that every parallel layout and recomputation draws the same masks.
"""

import math
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import numpy.typing as npt

from minimp import backend, functional
from minimp.backend import Array
from minimp.nn.module import Module, Parameter
from minimp.precision.fp8_scaling import Fp8Meta
from minimp.precision.recipes import BlockScaledMeta
from minimp.tensor import Tensor, TensorLike


def _uniform(rng: np.random.Generator, bound: float, shape: tuple[int, ...]) -> Array:
    """U(-bound, bound) in float32, drawn on the host in float64 (reproducible on any device)."""
    return backend.to_device(rng.uniform(-bound, bound, size=shape).astype(np.float32))


class Linear(Module):
    """y = x @ weight^T + bias; weight is (out_features, in_features) and starts as PyTorch's does,
    U(-1/sqrt(in), 1/sqrt(in)), from the given NumPy Generator.

    Linear(in_features, out_features, bias=True, rng=None): rng is a numpy.random.Generator (a new
    unseeded one when None). Parameters are float32; model.to(...) makes the compute copies;
    nn.enable_fp8(model, recipe) gives it an `fp8_meta`, and its products then read fp8 inputs."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 rng: np.random.Generator | None = None):
        super().__init__()
        rng = np.random.default_rng() if rng is None else rng
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform(rng, bound, (out_features, in_features)))
        self.bias = Parameter(_uniform(rng, bound, (out_features,))) if bias else None
        # after nn.enable_fp8: the product then reads fp8
        self.fp8_meta: Fp8Meta | BlockScaledMeta | None = None

    def forward(self, x: Tensor) -> Tensor:
        return functional.linear(x, self.weight, self.bias, self.fp8_meta)

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    """max(x, 0), elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return x.relu()


class Tanh(Module):
    """tanh(x), elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()


class LayerNorm(Module):
    """Normalize the last axis (statistics in float32), then scale by weight and shift by bias.

    features: the size of that axis; eps: added to the variance before its square root (1e-5, as
    PyTorch); bias: False for no bias (a constant zero shift instead, which nothing trains).
    """

    def __init__(self, features: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(backend.to_device(np.ones(features, np.float32)))
        zeros = backend.to_device(np.zeros(features, np.float32))
        # Without a bias, a constant zero shift (not a Parameter: nothing trains it).
        self.bias = Parameter(zeros) if bias else Tensor(zeros)

    def forward(self, x: Tensor) -> Tensor:
        return functional.layer_norm(x, self.weight, self.bias, self.eps)

    def __repr__(self) -> str:
        return f"LayerNorm({self.weight.shape[0]})"


class Sequential(Module):
    """Layers applied in order. The ordered list is what pipeline parallelism splits into stages."""

    def __init__(self, *layers: Module):
        super().__init__()
        for index, layer in enumerate(layers):
            setattr(self, str(index), layer)

    @property
    def layers(self) -> list[Module]:
        """The layers in order (the list pipeline parallelism cuts into stages)."""
        return list(self._modules.values())

    def __len__(self) -> int:
        return len(self._modules)

    def __getitem__(self, index: int) -> Module:
        return self.layers[index]

    def __iter__(self) -> Iterator[Module]:
        return iter(self.layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _normal(rng: np.random.Generator, std: float, shape: tuple[int, ...]) -> Array:
    """N(0, std^2) in float32, drawn on the host in float64 (reproducible on any device)."""
    return backend.to_device((rng.standard_normal(shape) * std).astype(np.float32))


class Embedding(Module):
    """A table of vectors: forward(indices) = weight[indices]; weight (num_embeddings,
    embedding_dim) starts as PyTorch's does, N(0, 1), drawn from `rng`, a NumPy Generator (None:
    a fresh unseeded one)."""

    def __init__(self, num_embeddings: int, embedding_dim: int,
                 rng: np.random.Generator | None = None):
        super().__init__()
        rng = np.random.default_rng() if rng is None else rng
        self.weight = Parameter(_normal(rng, 1.0, (num_embeddings, embedding_dim)))

    def forward(self, indices: TensorLike) -> Tensor:
        return functional.embedding(indices, self.weight)

    def __repr__(self) -> str:
        return f"Embedding({self.weight.shape[0]}, {self.weight.shape[1]})"


class GELU(Module):
    """GELU in its tanh form (GPT-2's; PyTorch's nn.GELU(approximate='tanh'))."""

    def __init__(self, approximate: str = "tanh"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return functional.gelu(x, self.approximate)

    def __repr__(self) -> str:
        return f"GELU(approximate={self.approximate!r})"


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
                "before the forward (or model.eval(), or p=0)")
        state, per_sample = self.state, int(np.prod(x.shape[1:]))
        return functional.dropout(
            x, self.p, state.seed, state.step, self.layer, state.sample_indices,
            offset=self.slice_index * per_sample)

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, layer={self.layer})"


def set_dropout_state(model: Module, seed: int, step: int, sample_indices: npt.ArrayLike) -> None:
    """Tell every Dropout in model which (seed, step) this forward belongs to and which global
    samples its rows are. Set it before each forward (each micro-batch has its own rows)."""
    state = DropoutState(seed, step, np.asarray(backend.to_numpy(sample_indices)))
    for module in model.modules():
        if isinstance(module, Dropout):
            module.state = state
