"""Backward in two passes (B: the input's gradient, W: the weights'): the same bits as one backward,
weights untouched until W, each weight's hooks once, after its last op."""

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp.models import GPT, GPTConfig
from minimp.precision.casting import FLOAT16
from minimp.split_backward import backward_input, backward_weight

CONFIG = GPTConfig(vocab_size=7, context=5, layers=2, heads=2, width=8, dropout=0.0)


def gpt_block_and_input(dtype=np.float32, seed=0):
    """The middle of a GPT (its blocks, as a pipeline stage holds them) and a leaf input."""
    model = GPT(CONFIG, np.random.default_rng(seed)).to(dtype)
    stage = nn.Sequential(model[1], model[2])
    x = np.random.default_rng(seed + 1).standard_normal((3, 5, 8)).astype(dtype)
    return stage, Tensor(x, requires_grad=True)


def mlp_and_input(dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    stage = nn.Sequential(nn.Linear(6, 16, rng=rng), nn.ReLU(), nn.Linear(16, 4, rng=rng)).to(dtype)
    return stage, Tensor(rng.standard_normal((10, 6)).astype(dtype), requires_grad=True)


def run(build, dtype, split):
    stage, x = build(dtype)
    y = stage(x)
    grad = np.random.default_rng(7).standard_normal(y.shape).astype(dtype)
    weights = list(stage.parameters())
    if split:
        pending = backward_input(y, grad, weights)
        assert x.grad is not None and all(w.grad is None for w in weights)
        assert pending.deferred  # the ops that read a weight wait for W
        backward_weight(pending)
    else:
        y.backward(grad)
    return x.grad, [w.grad for w in weights]


@pytest.mark.parametrize("build", [mlp_and_input, gpt_block_and_input], ids=["mlp", "gpt"])
@pytest.mark.parametrize("dtype", [np.float32, FLOAT16], ids=["fp32", "fp16"])
def test_b_then_w_gives_the_bits_of_one_backward(build, dtype):
    whole_input, whole_weights = run(build, dtype, split=False)
    split_input, split_weights = run(build, dtype, split=True)
    assert np.array_equal(split_input, whole_input)
    for split, whole in zip(split_weights, whole_weights):
        assert split.dtype == whole.dtype and np.array_equal(split, whole)


def test_b_skips_the_weight_products_and_keeps_what_w_needs():
    """The Linear's dL/dW is not computed in B: its saved arrays stay until W, then go."""
    layer = nn.Linear(4, 3, rng=np.random.default_rng(0))
    x = Tensor(np.ones((2, 4), np.float32), requires_grad=True)
    y = layer(x)
    pending = backward_input(y, np.ones((2, 3), np.float32), list(layer.parameters()))
    (node, grad_output), = pending.deferred
    assert node.context.saved_arrays is not None and grad_output.shape == (2, 3)
    assert layer.weight.grad is None and layer.bias.grad is None
    backward_weight(pending)
    assert node.context.saved_arrays is None and pending.deferred == []
    assert np.array_equal(layer.weight.grad, np.full((3, 4), 2.0, np.float32))


def test_a_weight_read_twice_gets_its_hooks_once_with_the_sum():
    w = Tensor(np.array([[2.0]], np.float32), requires_grad=True)
    x = Tensor(np.array([[3.0]], np.float32), requires_grad=True)
    seen = []
    w.register_hook(lambda g: seen.append(("hook", float(g[0, 0]))))
    w.register_post_accumulate_grad_hook(lambda t: seen.append(("after", float(t.grad[0, 0]))))
    y = (x @ w) @ w  # x w w: dy/dw = 2 x w = 12
    pending = backward_input(y, np.ones((1, 1), np.float32), [w])
    assert seen == [] and float(x.grad[0, 0]) == 4.0
    backward_weight(pending)
    assert seen == [("hook", 12.0), ("after", 12.0)]


def test_backward_input_refuses_a_tensor_without_a_graph():
    with pytest.raises(RuntimeError, match="does not require grad"):
        backward_input(Tensor(np.ones(2, np.float32)), None, [])
