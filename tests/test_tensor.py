"""Tensor and backward: accumulation, shared inputs, no_grad, freed graphs, dtypes, saved bytes."""

import re

import ml_dtypes
import numpy as np
import pytest

from minimp import Tensor, no_grad, nn
from minimp import functional as F
from minimp.tensor import as_tensor, saved_bytes


def test_python_floats_become_float32_and_arrays_keep_their_dtype():
    assert Tensor([1.0, 2.0]).dtype == np.float32
    assert Tensor(np.zeros(2, np.float16)).dtype == np.float16
    # scalars take the tensor's dtype
    assert (Tensor(np.ones(2, np.float16)) * 0.5).dtype == np.float16


def test_gradients_accumulate_across_backward_calls():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True)
    (x * 3.0).sum().backward()
    (x * 3.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [6.0, 6.0])


def test_a_tensor_used_twice_gets_both_gradients():
    x = Tensor(np.array([3.0]), requires_grad=True)
    (x * x).sum().backward()
    assert x.grad[0] == 6.0


def test_no_grad_records_nothing():
    x = Tensor(np.ones(2), requires_grad=True)
    with no_grad():
        y = x * 2.0
    assert not y.requires_grad and y.node is None


def test_backward_twice_through_a_freed_graph_is_an_error():
    x = Tensor(np.ones(2), requires_grad=True)
    y = (x * x).sum()
    y.backward()
    with pytest.raises(RuntimeError, match="already freed"):
        y.backward()


def test_backward_needs_a_scalar_or_a_gradient():
    with pytest.raises(RuntimeError, match="needs a scalar"):
        (Tensor(np.ones(2), requires_grad=True) * 2.0).backward()


def test_a_deep_graph_does_not_hit_the_recursion_limit():
    x = Tensor(np.ones(1), requires_grad=True)
    y = x
    for _ in range(5000):
        y = y * 1.0
    y.sum().backward()
    assert x.grad[0] == 1.0


def test_float16_graph_keeps_half_the_bytes_of_float32():
    """What backward keeps for a float16 MLP is float16: about half the float32 graph's bytes."""
    measured = {}
    for dtype in (np.float32, np.float16):
        rng = np.random.default_rng(0)
        model = nn.Sequential(
            nn.Linear(32, 64, rng=rng),
            nn.ReLU(),
            nn.Linear(64, 64, rng=rng),
            nn.ReLU(),
            nn.Linear(64, 10, rng=rng),
        ).to(dtype)
        x = Tensor(rng.standard_normal((128, 32)).astype(dtype))
        loss = F.cross_entropy(model(x), rng.integers(0, 10, 128))
        measured[dtype] = saved_bytes(loss, exclude=[p.data for p in model.parameters()])
    assert measured[np.float16] / measured[np.float32] <= 0.52


# ----- the numerics promise holds for Python numbers; misuse is one clear error ----------------
def test_a_python_number_is_not_rounded_to_float16_before_the_op():
    x = Tensor(np.array([60000.0, 3.0], np.float16))
    quotient = (x / 70000.0).data  # 70000 would be inf in float16; float32 math, rounded once
    assert quotient.dtype == np.float16
    np.testing.assert_array_equal(quotient, np.float16(np.float32([60000, 3]) / np.float32(70000)))
    product = (x * 1e-8).data  # 1e-8 would be 0 in float16
    np.testing.assert_array_equal(product, np.float16(np.float32([60000, 3]) * np.float32(1e-8)))
    assert product[0] != 0 and (1e-8 * x).data[0] == product[0]
    reference = np.float16(np.float32(1e5) - np.float32([60000, 3]))  # [40000, inf]: round once
    np.testing.assert_array_equal((1e5 - x).data, reference)


def test_python_floats_promote_integer_tensors_instead_of_truncating():
    ints = Tensor([1, 2, 3])
    assert ints.dtype == np.int64
    np.testing.assert_array_equal((ints * 0.5).data, np.float32([0.5, 1.0, 1.5]))
    assert (ints * 0.5).dtype == np.float32 and (ints * 2).dtype == np.int64
    np.testing.assert_array_equal((ints / 2).data, np.float32([0.5, 1.0, 1.5]))


# What a Tensor holds: every dtype the package makes tensors of (labels and ids are int64, the
# char dataset's ids uint8, attention masks bool, compute copies float16 and bfloat16).
HELD = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.int8, np.int32, np.int64,
        np.uint8, np.uint64, np.bool_]
# What NumPy can make that minimp cannot compute in.
REFUSED = [([1, None], "object"), (["a", "b"], "<U1"), ([b"ab"], "|S2"), ([1 + 2j], "complex128"),
           (np.array(["2024-01-01"], "datetime64[D]"), "datetime64[D]"),
           (np.zeros(2, ml_dtypes.float8_e4m3fn), "float8_e4m3fn"),
           (np.zeros(2, [("a", np.float32)]), "[('a', '<f4')]")]


@pytest.mark.parametrize("dtype", HELD)
def test_floats_integers_and_bools_are_held_as_given(dtype):
    array = np.zeros(3, dtype)
    assert Tensor(array).data is array and Tensor(array[0]).dtype == dtype
    tensor = Tensor(np.ones(3, np.float32))
    tensor.data = array
    assert tensor.data is array


@pytest.mark.parametrize("data, dtype", REFUSED)
def test_data_minimp_cannot_compute_in_is_refused_where_it_arrives(data, dtype):
    """Tensor(...), `.data = ...`, and the paths that build Tensors from data (as_tensor, an
    operator's other operand) each refuse it with one line naming the dtype and the fix."""
    pattern = rf"dtype {re.escape(dtype)}, which minimp cannot compute in.*float32 or float64"
    with pytest.raises(TypeError, match=r"^Tensor\(data\): .*" + pattern):
        Tensor(data)
    with pytest.raises(TypeError, match=r"^tensor\.data = data: .*" + pattern):
        Tensor(np.ones(2, np.float32)).data = data
    with pytest.raises(TypeError, match=pattern):
        as_tensor(data)
    with pytest.raises(TypeError, match=pattern):
        Tensor(np.ones(2, np.float32)) + data


def test_a_refusal_names_what_was_given():
    with pytest.raises(TypeError, match=r"^Tensor\(data\): data is a list, which NumPy makes an "
                                        r"array of dtype object, which minimp cannot compute in"):
        Tensor([1, None])
    with pytest.raises(TypeError, match=r"^Tensor\(data\): data has dtype complex64"):
        Tensor(np.ones(2, np.complex64))
    with pytest.raises(TypeError, match=r"data is a Tensor, not an array; pass its .data instead"):
        Tensor(np.ones(2, np.float32)).data = Tensor(np.ones(2, np.float32))


def test_integer_tensors_cannot_require_grad():
    """At construction and on assignment, as in PyTorch; the refused tensor is left as it was."""
    with pytest.raises(TypeError, match="only floating-point tensors can require gradients"):
        Tensor(np.arange(3), requires_grad=True)
    for dtype in (np.int64, np.uint8, np.bool_):
        ids = Tensor(np.zeros(3, dtype))
        with pytest.raises(TypeError, match=f"can require gradients, got {np.dtype(dtype)}"):
            ids.requires_grad = True
        assert not ids.requires_grad
        ids.requires_grad = False  # always allowed
    weight = Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match="data has dtype int64, but this tensor requires grad"):
        weight.data = np.arange(3)
    assert weight.dtype == np.float32
    weight.requires_grad = False
    weight.data = np.arange(3)  # an integer array is fine where no gradient is wanted


@pytest.mark.parametrize("value", ["yes", "False", 1, 0, None, 1.0])
def test_requires_grad_takes_only_a_bool(value):
    # "False" and 1 are truthy, 0 and None falsy: each used to be accepted as that truth value,
    # hiding a typo or a mix-up; the tensor is left as it was
    weight = Tensor(np.ones(2, np.float32))
    message = rf"^requires_grad must be a bool \(True or False\), got {re.escape(repr(value))} "
    with pytest.raises(TypeError, match=message):
        weight.requires_grad = value
    assert weight.requires_grad is False
    with pytest.raises(TypeError, match=message):
        Tensor(np.ones(2, np.float32), requires_grad=value)


def test_requires_grad_takes_numpys_bools_as_the_bools_they_are():
    weight = Tensor(np.ones(2, np.float32), requires_grad=np.bool_(True))
    assert weight.requires_grad is True
    weight.requires_grad = np.bool_(False)
    assert weight.requires_grad is False


@pytest.mark.parametrize("grad", [2.0, [1.0, 1.0], "ones"])
def test_backward_given_something_not_an_array_says_what_it_takes(grad):
    # 2.0 used to be an AttributeError about `.shape`
    y = Tensor(np.ones(2, np.float32), requires_grad=True) * 2.0
    message = (rf"^backward\(grad\): grad is a {type(grad).__name__}; pass an array \(or a "
               r"Tensor\) of this tensor's shape \(2,\) and dtype float32, or nothing for a "
               "scalar loss$")
    with pytest.raises(TypeError, match=message):
        y.backward(grad)


def test_backward_checks_the_gradient_it_is_given():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    y = x * 2.0
    with pytest.raises(ValueError, match=r"grad has shape \(1,\)"):
        y.backward(np.ones(1, np.float32))  # would have been broadcast silently
    with pytest.raises(ValueError, match="dtype float16"):
        y.backward(np.ones(3, np.float16))
    with pytest.raises(RuntimeError, match="needs a scalar"):
        y.backward()
    y.backward(Tensor(np.full(3, 0.5, np.float32)))
    np.testing.assert_array_equal(x.grad, np.ones(3, np.float32))


def test_a_numpy_array_where_a_tensor_belongs_names_the_fix():
    layer = nn.Linear(3, 2, rng=np.random.default_rng(0))
    with pytest.raises(TypeError, match=r"numpy.ndarray, not a Tensor \(wrap it"):
        layer.forward(np.ones((1, 3), np.float32))


def test_gradient_hooks_see_and_replace_the_gradient():
    x = Tensor(np.ones(2, np.float32), requires_grad=True)
    seen = []
    handle = x.register_hook(lambda grad: seen.append(grad.copy()) or grad * 3)
    (x * 2.0).sum().backward()
    np.testing.assert_array_equal(seen[0], [2.0, 2.0])
    np.testing.assert_array_equal(x.grad, [6.0, 6.0])
    handle.remove()
    x.grad = None
    (x * 2.0).sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0, 2.0])


def test_backward_completes_each_layer_s_weights_right_after_the_layer():
    """The last layer's gradients are in .grad before the first layer's backward starts: what
    lets ZeRO reduce-scatter (and stage 3 free) layer by layer."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    events = []
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
    x = Tensor(np.ones((3, 4), np.float32))
    for index, layer in enumerate(model.layers):
        x = layer(x)
        x.register_hook(lambda grad, index=index: events.append(f"output {index}"))
    x.sum().backward()
    assert events == [
        "output 4", "4.bias", "4.weight", "output 3", "output 2", "2.bias", "2.weight",
        "output 1", "output 0", "0.bias", "0.weight",
    ]  # fmt: skip


def test_saved_tensors_hooks_pack_and_unpack_what_ops_save():
    """Weights packed into names while the graph lives, found again for backward: the same
    gradients, and saved_bytes counts only what stayed an array."""
    from minimp.function import saved_tensors_hooks

    def gradients(hooks):
        model = nn.Sequential(nn.Linear(3, 5, rng=np.random.default_rng(0)), nn.ReLU())
        weights = {id(p.data): name for name, p in model.named_parameters()}
        arrays = {name: p.data for name, p in model.named_parameters()}
        x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
        if hooks:
            pack = lambda array: weights.get(id(array), array)  # noqa: E731
            unpack = lambda packed: arrays[packed] if isinstance(packed, str) else packed  # noqa
            with saved_tensors_hooks(pack, unpack):
                loss = model(x).sum()
        else:
            loss = model(x).sum()
        kept = saved_bytes(loss)
        loss.backward()
        return kept, [p.grad for p in model.parameters()]

    (plain, expected), (packed, actual) = gradients(False), gradients(True)
    assert plain - packed == 5 * 3 * 4  # the weight, packed into its name
    for a, b in zip(actual, expected):
        np.testing.assert_array_equal(a, b)
