"""What `help()` shows of a public class's constructor: every argument of its `__init__` (dataclass
and named-tuple fields included) is named in the class docstring or in the `__init__` docstring.

The rule for "public": the classes minimp defines that a package namespace offers under a name
without a leading underscore, for `minimp` and every package under it (each `__init__.py`:
`minimp.nn`, `minimp.optim`, `minimp.precision`, `minimp.distributed`, `minimp.parallel`,
`minimp.models`, `minimp.train`, ...). minimp has no `__all__`, so a package's namespace is what
`from minimp.<package> import Name` offers without reaching into a module; a new package is
walked without editing this file. "Named" means the argument's name appears as a whole word, in
prose or in a `name: ...` list, the convention of the existing docstrings (Optimizer's
"params: Parameters, or groups ...", DynamicLossScaler's "hysteresis=h > 1 tolerates ...").
"""

import enum
import importlib
import inspect
import pkgutil
import re

import pytest

import minimp


def public_classes() -> dict[str, type]:
    """{'package.Name': class} for every public class, each under the first package offering it."""
    packages = ["minimp"] + [
        module.name for module in pkgutil.walk_packages(minimp.__path__, "minimp.") if module.ispkg]
    found: dict[type, str] = {}
    for package in packages:
        for name, value in vars(importlib.import_module(package)).items():
            if (not name.startswith("_") and inspect.isclass(value)
                    and value.__module__.startswith("minimp")):
                found.setdefault(value, f"{package}.{name}")
    return {name: cls for cls, name in found.items()}


def own_docstring(cls: type) -> str:
    """The class's own docstring; "" for none, or for the signature a dataclass or a named tuple
    writes in its place (it names every field, so it would document nothing yet pass)."""
    doc = cls.__dict__.get("__doc__") or ""
    generated = [cls.__name__ + str(inspect.signature(cls)).replace(" -> None", "")]
    if hasattr(cls, "_fields"):
        generated.append(f"{cls.__name__}({', '.join(cls._fields)})")
    return "" if doc in generated else doc


def undocumented_arguments(cls: type) -> list[str]:
    """The arguments of cls's constructor that neither docstring names (*args and **kwargs aside:
    they forward to a documented parent or a protocol), and a dataclass field with a `help`
    in its metadata aside: that text is its flag's `--help` line (TrainConfig's fields)."""
    if issubclass(cls, enum.Enum):  # Tag(3) looks a member up: an enum is not constructed
        return []
    try:
        parameters = inspect.signature(cls).parameters.values()  # __init__'s, or a tuple's __new__
    except ValueError:  # an exception's builtin __init__: nothing of its own to name
        return []
    text = own_docstring(cls) + "\n" + (getattr(cls.__init__, "__doc__", None) or "")
    fields = getattr(cls, "__dataclass_fields__", {})
    return [parameter.name for parameter in parameters
            if parameter.kind not in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD)
            and not re.search(rf"\b{re.escape(parameter.name)}\b", text)
            and "help" not in getattr(fields.get(parameter.name), "metadata", {})]


PUBLIC_CLASSES = public_classes()


def test_the_walk_finds_the_classes_of_every_layer():
    """So the test below cannot pass by walking nothing."""
    for name in ("minimp.Tensor", "minimp.optim.Adam", "minimp.DynamicLossScaler",
                 "minimp.nn.Linear", "minimp.models.GPTConfig", "minimp.train.TrainConfig",
                 "minimp.distributed.SimulatedWorld", "minimp.parallel.ZeroDataParallel"):
        assert name in PUBLIC_CLASSES
    assert len(PUBLIC_CLASSES) > 80


@pytest.mark.parametrize("name", sorted(PUBLIC_CLASSES))
def test_help_names_every_constructor_argument(name):
    missing = undocumented_arguments(PUBLIC_CLASSES[name])
    assert not missing, (f"help({name}) does not name its constructor arguments {missing}: say "
                         "what each is in the class or __init__ docstring")


def test_a_generated_dataclass_docstring_documents_nothing():
    """The check above, tried on classes made to fail it."""
    from dataclasses import dataclass
    from typing import NamedTuple

    @dataclass
    class Settings:
        width: int

    class Pair(NamedTuple):
        left: int
        right: int

    class Scaled(Exception):
        """Multiplies (what by is not said)."""

        def __init__(self, factor: float, *args: object, **kwargs: object):
            pass

    assert undocumented_arguments(Settings) == ["width"]
    assert undocumented_arguments(Pair) == ["left", "right"]
    assert undocumented_arguments(Scaled) == ["factor"]
