"""Adam and AdamW pinned step by step against the update rule written out in float64 (PyTorch's
torch.optim.Adam / AdamW formulas), defaults included."""

import numpy as np
import pytest

from minimp import nn, optim

# Gradients over four steps, per element: ordinary ones, a sign change, and 1e-8, where the
# square root of the second moment is as small as eps and eps shows
GRADIENTS = [
    [0.5, -2.0, 1e-8],
    [0.25, 3.0, 1e-8],
    [-1.0, 0.5, 1e-8],
    [0.125, -0.75, 1e-8],
]


def reference(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, decoupled=False):
    """The weights after each step, in float64, from weights [1, -1, 0.5]."""
    beta1, beta2 = betas
    weight, m, v, trajectory = np.array([1.0, -1.0, 0.5]), np.zeros(3), np.zeros(3), []
    for step, gradient in enumerate(GRADIENTS, start=1):
        g = np.array(gradient)
        if decoupled:
            weight = weight * (1 - lr * weight_decay)  # AdamW: the weight shrinks directly
        else:
            g = g + weight_decay * weight  # Adam: the decay joins the gradient
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        m_hat, v_hat = m / (1 - beta1**step), v / (1 - beta2**step)
        weight = weight - lr * m_hat / (np.sqrt(v_hat) + eps)
        trajectory.append(weight)
    return trajectory


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda p: optim.Adam(p), reference()),  # the defaults
        (lambda p: optim.Adam(p, lr=0.1, weight_decay=0.5), reference(lr=0.1, weight_decay=0.5)),
        (lambda p: optim.AdamW(p), reference(weight_decay=0.01, decoupled=True)),
        (
            lambda p: optim.AdamW(p, lr=0.1, weight_decay=0.5),
            reference(lr=0.1, weight_decay=0.5, decoupled=True),
        ),
        (
            lambda p: optim.Adam(p, lr=0.1, weight_decay=0.5, decoupled_weight_decay=True),
            reference(lr=0.1, weight_decay=0.5, decoupled=True),
        ),
    ],
    ids=["adam-defaults", "adam-decay", "adamw-defaults", "adamw-decay", "adam-decoupled"],
)
def test_adam_follows_the_float64_rule_step_by_step(make, expected):
    parameter = nn.Parameter(np.array([1.0, -1.0, 0.5], np.float32))
    optimizer = make([parameter])
    for step, gradient in enumerate(GRADIENTS):
        parameter.grad = np.array(gradient, np.float32)
        optimizer.accumulate_gradients()
        optimizer.step()
        # float32 arithmetic against float64: a few float32 ulps over four steps
        np.testing.assert_allclose(parameter.data, expected[step], rtol=1e-6, atol=1e-7)
