"""Modules: Parameter, Module, and the layers an MLP needs (Linear, ReLU, Tanh, LayerNorm,
Sequential)."""

import math

import numpy as np

from minimp import backend, functional
from minimp.tensor import Tensor


class Parameter(Tensor):
    """A tensor the optimizer updates. In mixed precision it holds the compute copy
    (float16/bfloat16); the float32 master lives in the optimizer."""

    def __init__(self, data):
        super().__init__(data, requires_grad=True)


class Module:
    """A block of computation with named parameters and sub-modules, like torch.nn.Module."""

    def __init__(self):
        object.__setattr__(self, "_parameters", {})
        object.__setattr__(self, "_modules", {})

    def __setattr__(self, name, value):
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args):
        return self.forward(*args)

    def forward(self, *args):
        raise NotImplementedError

    def named_parameters(self, prefix=""):
        """(name, Parameter) pairs in a stable order: own parameters, then each child's, depth
        first."""
        for name, parameter in self._parameters.items():
            yield prefix + name, parameter
        for child_name, child in self._modules.items():
            yield from child.named_parameters(prefix + child_name + ".")

    def parameters(self):
        return [parameter for _, parameter in self.named_parameters()]

    def state_dict(self):
        """{name: array} of every parameter (the arrays themselves, as PyTorch returns them)."""
        return {name: parameter.data for name, parameter in self.named_parameters()}

    def load_state_dict(self, state):
        """Copy arrays into the parameters (cast to each parameter's dtype); names and shapes
        must match."""
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
            parameter.data = backend.to_device(backend.to_numpy(state[name])).astype(
                parameter.dtype
            )

    def to(self, dtype):
        """Round every parameter into dtype (the compute copies of mixed precision). Returns
        self."""
        for parameter in self.parameters():
            parameter.data = parameter.data.astype(dtype, copy=False)  # float32 stays the master
        return self


def _uniform(rng, bound, shape):
    """U(-bound, bound) drawn on the host in float64 (reproducible on any device), stored
    float32."""
    values = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return backend.to_device(values)


class Linear(Module):
    """y = x @ weight^T + bias; weight is (out_features, in_features) and starts as PyTorch's does,
    U(-1/sqrt(in), 1/sqrt(in)), from the given NumPy Generator."""

    def __init__(self, in_features, out_features, bias=True, rng=None):
        super().__init__()
        rng = np.random.default_rng() if rng is None else rng
        bound = 1.0 / math.sqrt(in_features)
        self.in_features, self.out_features = in_features, out_features
        self.weight = Parameter(_uniform(rng, bound, (out_features, in_features)))
        self.bias = Parameter(_uniform(rng, bound, (out_features,))) if bias else None

    def forward(self, x):
        return functional.linear(x, self.weight, self.bias)

    def __repr__(self):
        return f"Linear({self.in_features}, {self.out_features}, bias={self.bias is not None})"


class ReLU(Module):
    def forward(self, x):
        return x.relu()

    def __repr__(self):
        return "ReLU()"


class Tanh(Module):
    def forward(self, x):
        return x.tanh()

    def __repr__(self):
        return "Tanh()"


class LayerNorm(Module):
    """Normalize the last axis (statistics in float32), then scale by weight and shift by bias."""

    def __init__(self, features, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = Parameter(backend.to_device(np.ones(features, np.float32)))
        self.bias = Parameter(backend.to_device(np.zeros(features, np.float32)))

    def forward(self, x):
        return functional.layer_norm(x, self.weight, self.bias, self.eps)

    def __repr__(self):
        return f"LayerNorm({self.weight.shape[0]})"


class Sequential(Module):
    """Layers applied in order. The ordered list is what pipeline parallelism splits into stages."""

    def __init__(self, *layers):
        super().__init__()
        for index, layer in enumerate(layers):
            setattr(self, str(index), layer)

    @property
    def layers(self):
        return list(self._modules.values())

    def __len__(self):
        return len(self._modules)

    def __getitem__(self, index):
        return self.layers[index]

    def __iter__(self):
        return iter(self.layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x

    def __repr__(self):
        inner = "\n".join(f"  ({i}): {layer!r}" for i, layer in enumerate(self.layers))
        return f"Sequential(\n{inner}\n)"
