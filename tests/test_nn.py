"""Modules: parameter names and order, state_dict round trips, clear errors on mismatched state,
forward hooks."""

import numpy as np
import pytest

from minimp import Tensor, nn


def mlp(rng):
    return nn.Sequential(
        nn.Linear(4, 8, rng=rng), nn.ReLU(), nn.LayerNorm(8), nn.Linear(8, 2, rng=rng)
    )


def test_parameter_names_are_stable_and_ordered():
    names = [name for name, _ in mlp(np.random.default_rng(0)).named_parameters()]
    assert names == ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight", "3.bias"]


def test_linear_weight_layout_and_init_follow_pytorch():
    layer = nn.Linear(16, 3, rng=np.random.default_rng(0))
    assert layer.weight.shape == (3, 16) and np.abs(layer.weight.data).max() <= 1 / 4


def test_state_dict_round_trip_and_cast():
    source, target = mlp(np.random.default_rng(0)), mlp(np.random.default_rng(1)).to(np.float16)
    target.load_state_dict(source.state_dict())
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert b.dtype == np.float16
        np.testing.assert_array_equal(a.data.astype(np.float16), b.data, err_msg=name)


def test_load_state_dict_names_what_does_not_fit():
    model = mlp(np.random.default_rng(0))
    state = dict(model.state_dict())
    state.pop("0.bias")
    with pytest.raises(KeyError, match=r"missing \['0.bias'\]"):
        model.load_state_dict(state)
    state = dict(model.state_dict(), **{"0.bias": np.zeros(5)})
    with pytest.raises(ValueError, match="0.bias has shape"):
        model.load_state_dict(state)


def test_sequential_indexing_and_length():
    model = mlp(np.random.default_rng(0))
    assert len(model) == 4 and isinstance(model[1], nn.ReLU) and len(list(model)) == 4


def test_the_optimizer_steps_not_the_model():
    """Lesson 9: there is no model.step(); optimizers own the update."""
    from minimp import optim

    assert not hasattr(nn.Module, "step") and hasattr(optim.Optimizer, "step")


def test_module_tree_walk_train_eval_and_repr():
    model = nn.Sequential(nn.Linear(4, 8, rng=np.random.default_rng(0)), nn.Dropout(0.1), nn.GELU())
    names = [type(m).__name__ for m in model.modules()]
    assert names == ["Sequential", "Linear", "Dropout", "GELU"]
    assert model.eval() is model and not any(m.training for m in model.modules())
    assert all(m.training for m in model.train().modules())
    assert repr(model).splitlines()[1] == "  (0): Linear(4, 8, bias=True)"


def test_embedding_and_layer_norm_without_bias():
    table = nn.Embedding(5, 3, rng=np.random.default_rng(0))
    assert table.weight.shape == (5, 3) and table(np.array([[4, 0]])).shape == (1, 2, 3)
    norm = nn.LayerNorm(3, bias=False)
    assert [name for name, _ in norm.named_parameters()] == ["weight"]
    assert norm(table(np.array([1, 2]))).shape == (2, 3)


def test_forward_hooks_replace_arguments_and_output_until_removed():
    layer = nn.ReLU()
    calls = []
    pre = layer.register_forward_pre_hook(lambda module, args: Tensor(args[0].data - 1.0))
    post = layer.register_forward_hook(lambda module, args, output: calls.append(output) or None)
    x = Tensor(np.array([0.5, 2.0]))
    np.testing.assert_array_equal(layer(x).data, [0.0, 1.0])  # relu(x - 1)
    np.testing.assert_array_equal(calls[0].data, [0.0, 1.0])  # a None return keeps the output
    doubled = layer.register_forward_hook(lambda module, args, output: output * 2.0)
    np.testing.assert_array_equal(layer(x).data, [0.0, 2.0])
    for handle in (pre, post, doubled):
        handle.remove()
    np.testing.assert_array_equal(layer(x).data, [0.5, 2.0])
