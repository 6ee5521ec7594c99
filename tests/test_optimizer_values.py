"""Optimizer (base class) values: micro-batch gradients summed into the float32 accumulators."""

import numpy as np

from minimp import nn, optim


def test_a_second_micro_batch_gradient_is_added_to_the_first():
    # gradient accumulation: each micro-batch's gradient joins this step's float32 sum (not
    # replacing it, not subtracted from it), and the step uses the sum
    parameter = nn.Parameter(np.ones(3, np.float32))
    optimizer = optim.SGD([parameter], lr=0.5)
    parameter.grad = np.array([1.0, 2.0, -0.25], np.float32)
    optimizer.accumulate_gradients()
    parameter.grad = np.array([0.5, -3.0, 0.75], np.float32)
    (summed,) = optimizer.accumulate_gradients()
    np.testing.assert_array_equal(summed, np.array([1.5, -1.0, 0.5], np.float32))
    assert summed.dtype == np.float32 and parameter.grad is None
    optimizer.step()
    np.testing.assert_array_equal(parameter.data, np.array([0.25, 1.5, 0.75], np.float32))


def test_float16_micro_batch_gradients_are_summed_in_float32():
    # 2048 + 1 is not a float16 number (it rounds back to 2048); in float32 the 1 is kept
    parameter = nn.Parameter(np.zeros(1, np.float32))
    optimizer = optim.SGD([parameter], lr=1.0)
    for grad in (2048.0, 1.0, 1.0):
        parameter.grad = np.array([grad], np.float16)
        optimizer.accumulate_gradients()
    np.testing.assert_array_equal(optimizer.master_gradients[0], np.array([2050.0], np.float32))
