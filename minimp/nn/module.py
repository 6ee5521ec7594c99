"""What a module is: Parameter (a tensor the optimizer updates) and Module (named parameters and
sub-modules, state_dict, train/eval, forward hooks, and the cast into mixed precision's compute
copies)."""

from typing import Any, Callable, Iterator, Mapping

import numpy.typing as npt

from minimp import backend
from minimp.backend import Array
from minimp.precision import casting
from minimp.tensor import RemovableHandle, Tensor

# A forward pre-hook gets (module, args) and a forward hook (module, args, output); a non-None
# return value replaces the arguments or the output.
ForwardPreHook = Callable[["Module", tuple], object]
ForwardHook = Callable[["Module", tuple, Any], object]


class Parameter(Tensor):
    """A tensor the optimizer updates, made from `data`, a floating-point array (kept as it is,
    as by Tensor) and always requiring grad. In mixed precision it holds the compute copy
    (float16/bfloat16); the float32 master lives in the optimizer."""

    def __init__(self, data: npt.ArrayLike):
        super().__init__(data, requires_grad=True)


class Module:
    """A block of computation with named parameters and sub-modules, like torch.nn.Module."""

    _parameters: dict[str, Parameter]
    _modules: dict[str, "Module"]
    _forward_pre_hooks: list[ForwardPreHook]
    _forward_hooks: list[ForwardHook]

    def __init__(self) -> None:
        self._parameters, self._modules = {}, {}  # filled by __setattr__ below
        self._forward_pre_hooks, self._forward_hooks = [], []
        self.training = True  # False after eval(): dropout then passes its input through

    def __setattr__(self, name: str, value: object) -> None:
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        object.__setattr__(self, name, value)

    def __call__(self, *args: object) -> Any:
        for pre_hook in tuple(self._forward_pre_hooks):
            replaced = pre_hook(self, args)
            if replaced is not None:
                args = replaced if isinstance(replaced, tuple) else (replaced,)
        output = self.forward(*args)
        for hook in tuple(self._forward_hooks):
            replaced = hook(self, args, output)
            output = output if replaced is None else replaced
        return output

    def register_forward_pre_hook(self, hook: ForwardPreHook) -> RemovableHandle:
        """Call hook(module, args) before each forward; a non-None return replaces the arguments
        (as torch.nn.Module's). Tensor parallelism moves a layer's input between ranks here
        without changing the layer (minimp/parallel/tensor/models.py)."""
        self._forward_pre_hooks.append(hook)
        return RemovableHandle(self._forward_pre_hooks, hook)

    def register_forward_hook(self, hook: ForwardHook) -> RemovableHandle:
        """Call hook(module, args, output) after each forward; a non-None return replaces the
        output (as torch.nn.Module's)."""
        self._forward_hooks.append(hook)
        return RemovableHandle(self._forward_hooks, hook)

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

    def modules(self) -> Iterator["Module"]:
        """This module and every sub-module, depth first (as torch.nn.Module.modules)."""
        return (module for _, module in self.named_modules())

    def named_modules(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        """(name, module) for this module ("") and every sub-module ("3.attn.c_attn"), depth
        first (as torch.nn.Module.named_modules)."""
        yield prefix.rstrip("."), self
        for child_name, child in self._modules.items():
            yield from child.named_modules(prefix + child_name + ".")

    def train(self, mode: bool = True) -> "Module":
        """Set training mode here and in every sub-module (dropout is active only in it)."""
        for module in self.modules():
            module.training = mode
        return self

    def eval(self) -> "Module":
        """Evaluation mode (dropout off), for this module and every sub-module; returns self."""
        return self.train(False)

    def state_dict(self) -> dict[str, Array]:
        """{name: array} of every parameter (the arrays themselves, as PyTorch returns them)."""
        return {name: parameter.data for name, parameter in self.named_parameters()}

    def load_state_dict(self, state: Mapping[str, Array]) -> None:
        """Copy arrays into the parameters (cast to each parameter's dtype).
        Names and shapes must match."""
        own = dict(self.named_parameters())
        missing, unexpected = sorted(set(own) - set(state)), sorted(set(state) - set(own))
        if missing or unexpected:
            raise KeyError(
                f"state_dict does not fit this model: missing {missing}, unexpected {unexpected}")
        for name, parameter in own.items():
            if tuple(state[name].shape) != parameter.shape:
                raise ValueError(f"state_dict: {name} has shape {tuple(state[name].shape)}, "
                                 f"the model expects {parameter.shape}")
        for name, parameter in own.items():
            array = backend.to_device(backend.to_numpy(state[name]))
            parameter.data = casting.round_to(array, parameter.dtype).copy()

    def __repr__(self) -> str:
        """The module's class and its sub-modules, indented (as PyTorch prints a model)."""
        children = "".join(f"\n  ({name}): " + repr(child).replace("\n", "\n  ")
                           for name, child in self._modules.items())
        return f"{type(self).__name__}({children}\n)" if children else f"{type(self).__name__}()"

    def to(self, dtype: npt.DTypeLike) -> "Module":
        """Round every parameter into dtype (mixed precision's compute copies): a NumPy dtype or
        the training command's names "fp16", "bf16", "fp32". Returns self."""
        dtype = casting.dtype_named(dtype)
        for parameter in self.parameters():
            # No copy when already there: a float32 parameter stays its optimizer's master.
            parameter.data = casting.round_to(parameter.data, dtype)
        return self


def reachable_parameters(module: Module) -> list[Parameter]:
    """Every Parameter a module's forward can read: its own and those of any module it holds,
    registered or not (the GPT's head holds the token embedding without registering it)."""
    found: dict[int, Parameter] = {}
    stack, seen = [module], set()
    while stack:
        current = stack.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for value in vars(current).values():
            if isinstance(value, Parameter):
                found.setdefault(id(value), value)
            elif isinstance(value, Module):
                stack.append(value)
    return list(found.values())
