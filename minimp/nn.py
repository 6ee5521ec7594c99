"""Modules: Parameter, Module and the layers that MLPs and GPTs are built from (Linear, ...)."""

import math
from dataclasses import dataclass
from typing import Any, Iterator, Mapping

import numpy as np

from minimp import backend, functional
from minimp.precision import casting
from minimp.tensor import Tensor


class Parameter(Tensor):
    """A tensor the optimizer updates. In mixed precision it holds the compute copy
    (float16/bfloat16); the float32 master lives in the optimizer."""

    def __init__(self, data: Any):
        super().__init__(data, requires_grad=True)


class Module:
    """A block of computation with named parameters and sub-modules, like torch.nn.Module."""

    _parameters: dict[str, Parameter]
    _modules: dict[str, "Module"]

    def __init__(self) -> None:
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})
        self.training = True  # False after eval(): dropout then passes its input through

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)

    def forward(self, *args: Any) -> Any:
        raise NotImplementedError

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(name, Parameter) pairs, stable and depth first: own parameters, then each child's."""
        for name, parameter in self._parameters.items():
            yield prefix + name, parameter
        for child_name, child in self._modules.items():
            yield from child.named_parameters(prefix + child_name + ".")

    def parameters(self) -> list[Parameter]:
        return [parameter for _, parameter in self.named_parameters()]

    def modules(self) -> Iterator["Module"]:
        """This module and every sub-module, depth first (as torch.nn.Module.modules)."""
        yield self
        for child in self._modules.values():
            yield from child.modules()

    def train(self, mode: bool = True) -> "Module":
        """Set training mode here and in every sub-module (dropout is active only in it)."""
        for module in self.modules():
            module.training = mode
        return self

    def eval(self) -> "Module":
        return self.train(False)

    def state_dict(self) -> dict[str, Any]:
        """{name: array} of every parameter (the arrays themselves, as PyTorch returns them)."""
        return {name: parameter.data for name, parameter in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).
        Names and shapes must match."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"state_dict does not fit this model: missing {missing}, unexpected {unexpected}"
            )
        for name, parameter in own.items():
            if tuple(state[name].shape) != parameter.shape:
                raise ValueError(
                    f"state_dict: {name} has shape {tuple(state[name].shape)}, "
                    f"the model expects {parameter.shape}"
                )
        for name, parameter in own.items():
            array = backend.to_device(backend.to_numpy(state[name]))
            parameter.data = casting.round_to(array, parameter.dtype).copy()

    def __repr__(self) -> str:
        """The module's class and its sub-modules, indented (as PyTorch prints a model)."""
        children = "".join(
            f"\n  ({name}): " + repr(child).replace("\n", "\n  ")
            for name, child in self._modules.items()
        )
        return f"{type(self).__name__}({children}\n)" if children else f"{type(self).__name__}()"

    def to(self, dtype: Any) -> "Module":
        """Round every parameter into dtype (mixed precision's compute copies). Returns self."""
        for parameter in self.parameters():
            parameter.data = parameter.data.astype(dtype, copy=False)  # float32 stays the master
        return self


def _uniform(rng, bound, shape):
    """U(-bound, bound) in float32, drawn on the host in float64 (reproducible on any device)."""
    values = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return backend.to_device(values)


class Linear(Module):
    """y = x @ weight^T + bias; weight is (out_features, in_features) and starts as PyTorch's does,
    U(-1/sqrt(in), 1/sqrt(in)), from the given NumPy Generator."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        rng: np.random.Generator | None = None,
    ):
        super().__init__()
        rng = np.random.default_rng() if rng is None else rng
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform(rng, bound, (out_features, in_features)))
        self.bias = Parameter(_uniform(rng, bound, (out_features,))) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return functional.linear(x, self.weight, self.bias)

    def __repr__(self) -> str:
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.relu()

    def __repr__(self) -> str:
        return "ReLU()"


class Tanh(Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()

    def __repr__(self) -> str:
        return "Tanh()"


class LayerNorm(Module):
    """Normalize the last axis (statistics in float32), then scale by weight and shift by bias."""

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


def _normal(rng, std, shape):
    """N(0, std^2) in float32, drawn on the host in float64 (reproducible on any device)."""
    return backend.to_device((rng.standard_normal(shape) * std).astype(np.float32))


class Embedding(Module):
    """A table of vectors: forward(indices) = weight[indices]; weight (num_embeddings,
    embedding_dim) starts as PyTorch's does, N(0, 1), from the given NumPy Generator."""

    def __init__(
        self, num_embeddings: int, embedding_dim: int, rng: np.random.Generator | None = None
    ):
        super().__init__()
        rng = np.random.default_rng() if rng is None else rng
        self.weight = Parameter(_normal(rng, 1.0, (num_embeddings, embedding_dim)))

    def forward(self, indices: Any) -> Tensor:
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
    sample_indices: Any


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

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.p == 0.0:
            return x
        if self.state is None:
            raise RuntimeError(
                f"Dropout(p={self.p}) in training mode needs the rows' seed, step and global "
                "sample indices: call nn.set_dropout_state(model, seed, step, sample_indices) "
                "before the forward (or model.eval(), or p=0)"
            )
        state = self.state
        return functional.dropout(
            x, self.p, state.seed, state.step, self.layer, state.sample_indices
        )

    def __repr__(self) -> str:
        return f"Dropout(p={self.p}, layer={self.layer})"


def set_dropout_state(model: Module, seed: int, step: int, sample_indices: Any) -> None:
    """Tell every Dropout in model which (seed, step) this forward belongs to and which global
    samples its rows are. Set it before each forward (each micro-batch has its own rows)."""
    state = DropoutState(seed, step, np.asarray(backend.to_numpy(sample_indices)))
    for module in model.modules():
        if isinstance(module, Dropout):
            module.state = state
