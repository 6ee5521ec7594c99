"""What `help()` shows: every public class, function and method of the public modules has a
docstring (its own, or the one of the contract it implements)."""

import importlib
import inspect

import pytest

PUBLIC_MODULES = [
    "minimp",
    "minimp.nn",
    "minimp.optim",
    "minimp.functional",
    "minimp.precision",
    "minimp.distributed",
    "minimp.parallel",
    "minimp.tensor",
    "minimp.train",
]


def public_objects():
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        names = getattr(module, "__all__", None) or [n for n in dir(module) if n[0] != "_"]
        for name in names:
            value = getattr(module, name)
            if inspect.ismodule(value) or not getattr(value, "__module__", "").startswith("minimp"):
                continue
            yield f"{module_name}.{name}", value
            if inspect.isclass(value):
                for attribute, member in vars(value).items():
                    if attribute.startswith("_") or not (
                        callable(member) or isinstance(member, (property, staticmethod))
                    ):
                        continue
                    yield f"{module_name}.{name}.{attribute}", getattr(value, attribute)


@pytest.mark.parametrize("name, value", list(public_objects()), ids=lambda x: str(x)[:60])
def test_public_api_has_a_docstring(name, value):
    assert inspect.getdoc(value), f"{name} has no docstring for help() to show"


def test_the_tensor_docstring_says_what_its_attributes_hold():
    from minimp import Tensor

    text = inspect.getdoc(Tensor)
    assert "requires_grad=False" in text and "`.data`" in text and "`.grad`" in text
