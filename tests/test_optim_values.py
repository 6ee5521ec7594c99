"""Optimizer values: defaults and state round trips pinned to exact float32 results."""

import numpy as np

from minimp import nn, optim


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
