"""Modules: Parameter, Module and an MLP's layers (Linear, ReLU, Tanh, LayerNorm, Sequential)."""

import math
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

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args: Any) -> Any:
        return self.forward(*args)

    def forward(self, *args: Any) -> Any:
        """The computation; subclasses write it (calling the module calls forward)."""
        raise NotImplementedError

    def named_parameters(self, prefix: str = "") -> Iterator[tuple[str, Parameter]]:
        """(name, Parameter) pairs, stable and depth first: own parameters, then each child's."""
        for name, parameter in self._parameters.items():
            yield prefix + name, parameter
        for child_name, child in self._modules.items():
            yield from child.named_parameters(prefix + child_name + ".")

    def parameters(self) -> list[Parameter]:
        """Every Parameter, in named_parameters() order."""
        return [parameter for _, parameter in self.named_parameters()]

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

    def to(self, dtype: Any) -> "Module":
        """Round every parameter into dtype (mixed precision's compute copies): a NumPy dtype or
        the training command's names "fp16", "bf16", "fp32". Returns self."""
        dtype = casting.dtype_named(dtype)
        for parameter in self.parameters():
            # No copy when already there: a float32 parameter stays its optimizer's master.
            parameter.data = casting.round_to(parameter.data, dtype)
        return self


def _uniform(rng, bound, shape):
    """U(-bound, bound) in float32, drawn on the host in float64 (reproducible on any device)."""
    values = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return backend.to_device(values)


class Linear(Module):
    """y = x @ weight^T + bias; weight is (out_features, in_features) and starts as PyTorch's does,
    U(-1/sqrt(in), 1/sqrt(in)), from the given NumPy Generator.

    Linear(in_features, out_features, bias=True, rng=None): rng is a numpy.random.Generator (a new
    unseeded one when None). Parameters are float32; model.to(...) makes the compute copies."""

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
    """max(x, 0), elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return x.relu()

    def __repr__(self) -> str:
        return "ReLU()"


class Tanh(Module):
    """tanh(x), elementwise."""

    def forward(self, x: Tensor) -> Tensor:
        return x.tanh()

    def __repr__(self) -> str:
        return "Tanh()"


class LayerNorm(Module):
    """Normalize the last axis (statistics in float32), then scale by weight and shift by bias."""

    def __init__(self, features: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(backend.to_device(np.ones(features, np.float32)))
        self.bias = Parameter(backend.to_device(np.zeros(features, np.float32)))

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

    def __repr__(self) -> str:
        inner = "\n".join(f"  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n)"
