"""The optimizer's float32 accumulators: a step's first gradient becomes the accumulator when
nothing else holds it (no copy), is copied when something does, and the training is the same."""

import numpy as np

from minimp import StaticLossScaler, Tensor, nn, optim
from minimp import functional as F
from minimp.backend import data_address
from minimp.precision import mixed_precision_step


def mlp(seed=0):
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(6, 8, rng=rng), nn.ReLU(), nn.Linear(8, 3, rng=rng))
    return model, optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)


def backward(model, scaler, seed=1):
    rng = np.random.default_rng(seed)
    x = Tensor(rng.standard_normal((5, 6)).astype(np.float32))
    scaler.scale(F.cross_entropy(model(x), rng.integers(0, 3, 5))).backward()


def test_a_gradient_nothing_else_holds_becomes_the_accumulator():
    model, optimizer = mlp()
    backward(model, StaticLossScaler(8.0))
    addresses = [data_address(parameter.grad) for parameter in optimizer.params]
    gradients = optimizer.accumulate_gradients()
    assert [data_address(gradient) for gradient in gradients] == addresses
    assert all(a is g for a, g in zip(optimizer.accumulators, gradients))


def test_a_gradient_someone_holds_is_copied_and_never_changed_by_the_step():
    model, optimizer = mlp()
    scaler = StaticLossScaler(8.0)
    backward(model, scaler)
    held = [parameter.grad for parameter in optimizer.params]
    before = [array.copy() for array in held]
    mixed_precision_step(optimizer, scaler)  # unscales and adds weight decay in place
    for array, copy, accumulator in zip(held, before, optimizer.accumulators):
        assert array.tobytes() == copy.tobytes()
        assert not np.shares_memory(array, accumulator)


def test_an_accumulator_someone_holds_is_kept():
    model, optimizer = mlp()
    backward(model, StaticLossScaler(8.0))
    optimizer.accumulate_gradients()
    views = [accumulator.reshape(-1) for accumulator in optimizer.accumulators]
    optimizer.zero_grad()
    backward(model, StaticLossScaler(8.0), seed=2)
    optimizer.accumulate_gradients()
    assert all(view.base is a for view, a in zip(views, optimizer.accumulators))


def test_training_is_the_same_whether_gradients_are_adopted_or_copied():
    weights = []
    for hold in (False, True):
        model, optimizer = mlp()
        held = []
        if hold:  # a hook that keeps every gradient forces the copy
            for parameter in optimizer.params:
                parameter.register_hook(held.append)
        scaler = StaticLossScaler(8.0)
        for step in range(4):
            backward(model, scaler, seed=step)
            addresses = [data_address(parameter.grad) for parameter in optimizer.params]
            mixed_precision_step(optimizer, scaler)
            accumulators = [data_address(array) for array in optimizer.accumulators]
            assert (accumulators == addresses) != hold  # adopted unless held
        weights.append([parameter.data.tobytes() for parameter in optimizer.params])
    assert weights[0] == weights[1]
