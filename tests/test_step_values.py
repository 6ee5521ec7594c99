"""The mixed-precision step pinned against the same update computed by hand in float32: on steps
where the scale grows, backs off or holds (hysteresis), the gradients are unscaled by the scale
they carry; the float32 master moves where its float16 copy cannot; logged losses and the initial
broadcast are what they claim."""

import numpy as np
import pytest

from minimp import DynamicLossScaler, Tensor, nn, optim
from minimp import distributed as dist
from minimp import functional as F
from minimp.parallel import DataParallel, ReplicaMismatchError
from minimp.precision import mixed_precision_step
from minimp.train import TrainConfig, train

F16, F32 = np.float16, np.float32


def fp16_linear(seed=0):
    rng = np.random.default_rng(seed)
    model = nn.Sequential(nn.Linear(4, 3, rng=rng))
    optimizer = optim.SGD(model.parameters(), lr=0.125)
    model.to(F16)
    return model, optimizer


def scaled_gradients(model, scaler, x, targets):
    """Backward of the scaled loss; returns each parameter's float16 gradient (kept aside)."""
    loss = F.cross_entropy(model(Tensor(x)), targets)
    scaler.scale(loss).backward()
    return [p.grad.copy() for p in model.parameters()]


@pytest.mark.parametrize(
    "scaler_arguments, overflow_at",
    [
        (dict(init_scale=2.0**10, growth_interval=1), None),  # the scale doubles after every step
        (dict(init_scale=2.0**10, growth_interval=1), 2),  # ... and halves on an overflow
        (dict(init_scale=2.0**10, growth_interval=3, hysteresis=2), 1),  # the overflow is tolerated
    ],
)
def test_each_step_unscales_by_the_scale_its_gradients_carry(scaler_arguments, overflow_at):
    model, optimizer = fp16_linear()
    scaler = DynamicLossScaler(**scaler_arguments)
    rng = np.random.default_rng(1)
    masters = [m.copy() for m in optimizer.master_weights]
    for step in range(4):
        x = rng.standard_normal((8, 4)).astype(F16)
        targets = rng.integers(0, 3, 8)
        carried = scaler.loss_scale
        grads = scaled_gradients(model, scaler, x, targets)
        if step == overflow_at:
            model.parameters()[0].grad[0, 0] = np.inf
        result = mixed_precision_step(optimizer, scaler)
        assert result.loss_scale == carried and result.skipped == (step == overflow_at)
        if not result.skipped:  # by hand: widen, divide by the carried scale, SGD, all float32
            for index, grad in enumerate(grads):
                unscaled = grad.astype(F32) * F32(1.0 / carried)
                masters[index] = masters[index] - F32(0.125) * unscaled
        for mine, theirs in zip(optimizer.master_weights, masters):
            assert mine.tobytes() == theirs.astype(F32).tobytes()
        for parameter, master in zip(model.parameters(), optimizer.master_weights):
            assert parameter.data.tobytes() == master.astype(F16).tobytes()


def test_an_update_below_half_a_float16_gap_moves_the_master_and_not_the_copy():
    parameter = nn.Parameter(np.ones(1, F32))
    sgd = optim.SGD([parameter], lr=1.0)
    parameter.data = parameter.data.astype(F16)  # the compute copy; the master stays float32
    scaler, weight16 = DynamicLossScaler(init_scale=1.0), F16(1.0)
    for step in range(1, 4):
        parameter.grad = np.full(1, 2.0**-13, F16)  # below half the 2^-11 gap under 1.0
        scaler.applied = True
        assert not mixed_precision_step(sgd, scaler).skipped
        weight16 = F16(weight16 - F16(2.0**-13))  # the same update applied in float16 alone
        assert sgd.master_weights[0][0] == F32(1.0 - step * 2.0**-13)  # float32 moves each step
        if step == 1:
            assert parameter.data[0] == F16(1.0)  # one update rounds away in the copy
    assert weight16 == F16(1.0)  # in float16 alone the weight never moves
    assert parameter.data[0] == F16(1.0 - 2.0**-11)  # the master's sum reached the copy


def test_the_logged_loss_is_the_mean_over_every_micro_batch():
    common = dict(precision="fp32", steps=3, hidden=16, layers=1, batch_size=64, log_every=100)
    whole = train(TrainConfig(micro_batches=1, **common), log=lambda line: None)["history"]
    split = train(TrainConfig(micro_batches=4, **common), log=lambda line: None)["history"]
    assert split[0]["loss"] == pytest.approx(whole[0]["loss"], rel=1e-6)  # step 1: same weights


def test_the_initial_broadcast_is_what_makes_replicas_start_equal(monkeypatch):
    """Every rank builds the same weights from the seed, so a missing broadcast would go unseen;
    here rank 1 starts different, and the replicas must still agree after every step."""
    from minimp.train import loop

    original = loop.build_stage

    def rank_1_starts_elsewhere(config, task, topology, dtype):
        stage = original(config, task, topology, dtype)
        if topology.dp_rank == 1:
            for index, master in enumerate(stage.optimizer.master_weights):
                stage.optimizer.set_master_weight(index, master + 1.0)
        return stage

    monkeypatch.setattr(loop, "build_stage", rank_1_starts_elsewhere)
    config = TrainConfig(steps=3, hidden=16, layers=1, check_replicas=1, log_every=100)
    config.validate(2)
    results = dist.simulate(2, lambda comm: train(config, log=lambda line: None, comm=comm))
    assert results[0]["skipped"] == results[1]["skipped"]

    monkeypatch.setattr(DataParallel, "broadcast_parameters", lambda self, root=0: None)
    with pytest.raises(ReplicaMismatchError):
        dist.simulate(2, lambda comm: train(config, log=lambda line: None, comm=comm))
