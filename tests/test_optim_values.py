"""Optimizer values: defaults and state round trips pinned to exact float32 results."""

import numpy as np
import pytest

from minimp import nn, optim
from minimp.precision import unscale_


def step_with(optimizer, grad):
    """One optimizer step with this gradient on its single parameter."""
    optimizer.params[0].grad = np.array(grad, np.float32)
    optimizer.accumulate_gradients()
    optimizer.step()


def test_sgd_without_an_lr_steps_by_0_01_times_the_gradient():
    parameter = nn.Parameter(np.array([1.0, -2.0, 0.5], np.float32))
    optimizer = optim.SGD([parameter])
    step_with(optimizer, [3.0, 100.0, -0.25])
    # the update is float32: w - lr * g, the product and the difference each rounded in float32
    weight, grad = np.array([1.0, -2.0, 0.5], np.float32), np.array([3.0, 100.0, -0.25], np.float32)
    expected = weight - np.float32(0.01) * grad
    assert optimizer.lr == 0.01
    np.testing.assert_array_equal(parameter.data, expected)


def test_a_state_saved_before_the_first_step_loads_as_no_momentum_yet():
    # state_dict leaves out the slots not made yet; loading it must bring back "none yet"
    # (not a KeyError), so the next step starts the momentum from that step's gradient alone
    fresh = optim.SGD([nn.Parameter(np.zeros(2, np.float32))], lr=0.5, momentum=0.9)
    state = fresh.state_dict()
    assert state["slots"] == [{}]
    parameter = nn.Parameter(np.zeros(2, np.float32))
    optimizer = optim.SGD([parameter], lr=0.5, momentum=0.9)
    step_with(optimizer, [1.0, 1.0])  # makes a momentum buffer of [1, 1]
    optimizer.load_state_dict(state)
    assert optimizer.slots == [{"momentum_buffer": None}] and optimizer.step_count == 0
    step_with(optimizer, [2.0, -4.0])  # buffer = g: w = -0.5 - 0.5 * g, no 0.9 * [1, 1] in it
    np.testing.assert_array_equal(parameter.data, np.array([-1.5, 1.5], np.float32))


def test_a_zero_learning_rate_is_refused():
    with pytest.raises(ValueError, match="^learning rate must be positive, got 0$"):
        optim.SGD([nn.Parameter(np.zeros(2, np.float32))], lr=0)


def test_an_optimizer_subclass_that_gives_no_weight_decay_gets_none():
    # the base class is the extension point (subclasses supply update): its default is no decay
    class Plain(optim.Optimizer):
        def update(self, master, grad, slots, weight_decay):
            master -= self.lr * (grad + weight_decay * master)

    parameter = nn.Parameter(np.ones(2, np.float32))
    optimizer = Plain([parameter], lr=0.5)
    assert optimizer.weight_decays == [0.0]
    step_with(optimizer, [2.0, -2.0])
    np.testing.assert_array_equal(parameter.data, np.array([0.0, 2.0], np.float32))


def test_step_count_counts_every_step():
    optimizer = optim.Adam([nn.Parameter(np.ones(2, np.float32))], lr=0.1)
    for _ in range(3):
        step_with(optimizer, [1.0, 1.0])
    assert optimizer.step_count == 3 and optimizer.state_dict()["step_count"] == 3


def test_a_gradient_that_views_another_array_is_copied_not_adopted():
    # the step changes its accumulator in place (here: the unscale, unscale_); adopting a view
    # would write into the array it views
    buffer = np.arange(8, dtype=np.float32)
    parameter = nn.Parameter(np.zeros(4, np.float32))
    optimizer = optim.SGD([parameter], lr=1.0)
    parameter.grad = buffer[2:6]  # float32, the right shape, contiguous, not its own memory
    optimizer.accumulate_gradients()
    assert not np.shares_memory(optimizer.master_gradients[0], buffer)
    unscale_(optimizer.master_gradients, 2.0)
    optimizer.step()
    np.testing.assert_array_equal(buffer, np.arange(8, dtype=np.float32))
    np.testing.assert_array_equal(parameter.data, -np.arange(2, 6, dtype=np.float32) / 2)


def test_set_master_weight_rounds_it_into_the_float16_copy_with_numpys_bits():
    # a signalling NaN shows the cast: float32 -> float16 directly keeps its payload (0x7C01),
    # a detour through float64 would quiet it first (0x7E00)
    model = nn.Linear(3, 1, rng=np.random.default_rng(0))
    optimizer = optim.SGD(model.parameters(), lr=0.1)
    model.to(np.float16)
    bits = np.array([[0x3F800001, 0x7F800001, 0xC0490FDB]], np.uint32)  # 1 + 2^-23, sNaN, -pi
    optimizer.set_master_weight(0, bits.view(np.float32))
    np.testing.assert_array_equal(optimizer.master_weights[0].view(np.uint32), bits)
    expected = bits.view(np.float32).astype(np.float16).view(np.uint16)
    assert expected[0, 1] == 0x7C01
    np.testing.assert_array_equal(model.parameters()[0].data.view(np.uint16), expected)


def test_parameter_groups_set_their_own_weight_decay_and_nothing_else():
    decayed, plain = nn.Parameter(np.ones(2, np.float32)), nn.Parameter(np.ones(2, np.float32))
    groups = [{"params": [decayed], "weight_decay": 0.5}, {"params": [plain]}]
    optimizer = optim.SGD(groups, lr=0.25, weight_decay=0.125)
    assert optimizer.weight_decays == [0.5, 0.125]
    assert [id(p) for p in optimizer.params] == [id(decayed), id(plain)]  # in the groups' order
    with pytest.raises(ValueError, match=r"^optimizer: unknown parameter group settings \['lr'\]$"):
        optim.SGD([{"params": [plain], "lr": 1.0}], lr=0.25)
