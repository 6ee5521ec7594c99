"""--master-weights none and --stochastic-rounding: bf16 weights without float32 masters.

One optimizer step to the bit (to nearest: a hand computation; stochastic: the mean over all 2^16
values of the random bits is the float32 update exactly), the float32 optimizer state, the stream
of random bits (the same on every replica, continued by a resumed run), the memory by kind against
its formula, and the combinations the trainer refuses."""

import ml_dtypes
import numpy as np
import pytest

from minimp import distributed as dist
from minimp import nn, optim
from minimp.checkpoints.errors import ConfigError
from minimp.precision.casting import BFLOAT16
from minimp.precision.stochastic import RANDOM_BITS, StochasticWeights, to_nearest
from minimp.train import TrainConfig, train

SMALL = dict(hidden=32, layers=2, batch_size=32, log_every=1000, precision="bf16")
BF16 = ml_dtypes.bfloat16


def bf16_parameter(values: np.ndarray) -> nn.Parameter:
    """A Parameter built in float32 (as the trainer builds the optimizer first), then cast."""
    return nn.Parameter(np.asarray(values, np.float32))


def one_step(parameter, optimizer, grad):
    """Cast the parameter to bf16 after building the optimizer (as build_stage does), give it a
    float32 gradient, and step once."""
    parameter.data = parameter.data.astype(BF16)
    parameter.grad = np.asarray(grad, np.float32)
    optimizer.accumulate_gradients()
    optimizer.step()


def test_one_sgd_step_without_masters_is_the_hand_computation_rounded_to_nearest():
    # Near 1 a bf16 ulp is 2^-7 above and 2^-8 below: lr * g of 2^-10 is below half of either
    # (lost), 3 * 2^-9 rounds to 2^-8 or 2^-7, and -3 holds 2^-6 ulps (2^-9 is lost there too).
    w0 = np.array([1.0, 1.0, 1.0, -3.0, 0.3], np.float32)
    g = np.array([2.0**-10, -(2.0**-10), 3 * 2.0**-9, 2.0**-9, 2.0**-5], np.float32) * 10
    parameter = bf16_parameter(w0)
    optimizer = optim.SGD([parameter], lr=0.1, master_weights=False)
    one_step(parameter, optimizer, g)
    by_hand = (w0.astype(BF16).astype(np.float32) - np.float32(0.1) * g).astype(BF16)
    assert parameter.data.dtype == BF16
    assert parameter.data.tobytes() == by_hand.tobytes()
    assert parameter.data[0] == 1.0 and parameter.data[1] == 1.0  # the small updates are lost
    assert optimizer.master_weights[0] is parameter.data  # no float32 copy is kept


def test_adam_without_masters_keeps_its_state_in_float32_and_updates_a_widened_copy():
    rng = np.random.default_rng(0)
    w0, g = rng.normal(size=(4, 8)).astype(np.float32), rng.normal(size=(4, 8)).astype(np.float32)
    parameter = bf16_parameter(w0)
    optimizer = optim.AdamW([parameter], lr=1e-2, master_weights=False)
    one_step(parameter, optimizer, g)
    widened = w0.astype(BF16).astype(np.float32)
    m, v = optim.adam(widened, g.copy(), None, None, step=1, lr=1e-2, betas=(0.9, 0.999),
                      eps=1e-8, weight_decay=0.01, decoupled_weight_decay=True)
    assert parameter.data.tobytes() == widened.astype(BF16).tobytes()
    slots = optimizer.slots[0]
    assert slots["exp_avg"].dtype == slots["exp_avg_sq"].dtype == np.float32
    assert slots["exp_avg"].tobytes() == m.tobytes()
    assert slots["exp_avg_sq"].tobytes() == v.tobytes()


def test_a_16_bit_gradient_of_zeros_still_meets_the_update_rule_in_float32():
    """Data parallelism fills a gradient no loss reached with zeros like the parameter's array,
    bf16 here; SGD's weight decay must still add in float32 (in bf16 this one gives 0.703125)."""
    parameter = bf16_parameter(np.array([1.0 + 2.0**-7], np.float32))
    optimizer = optim.SGD([parameter], lr=1.0, weight_decay=0.3, master_weights=False)
    parameter.data = parameter.data.astype(BF16)
    gradients = optimizer.accumulate_gradients()
    gradients[0] = np.zeros(1, BF16)  # as data_parallel.py's _gradient_or_zeros
    optimizer.step()
    w = np.float32(1.0 + 2.0**-7)
    assert parameter.data[0] == (w - np.float32(0.3) * w).astype(BF16) == 0.70703125


class EveryRandomValue(StochasticWeights):
    """Row r of the weight is rounded with random bits r: all 2^16 values, once each."""

    def random_bits(self, shape, step, index):
        rows = np.arange(1 << RANDOM_BITS, dtype=np.uint32).reshape(-1, 1)
        return np.broadcast_to(rows, shape)


def test_stochastic_rounding_in_the_optimizer_is_exact_on_average_over_all_random_bits():
    # Each column is one weight, repeated on 2^16 rows; its update is below half a bf16 ulp for
    # the first two (to nearest would lose it), larger for the third, a subnormal's for the last.
    w0 = np.array([1.0, -3.0, 0.3, 1e-39], np.float32)
    g = np.array([2.0**-10, -(2.0**-9), 0.123, 3e-39], np.float32)
    parameter = bf16_parameter(np.tile(w0, (1 << RANDOM_BITS, 1)))
    optimizer = optim.SGD([parameter], lr=0.3, master_weights=False, rounding=EveryRandomValue(0))
    one_step(parameter, optimizer, np.tile(g, (1 << RANDOM_BITS, 1)))
    update = w0.astype(BF16).astype(np.float32) - np.float32(0.3) * g  # by hand, in float32
    assert (update != update.astype(BF16).astype(np.float32)).all()  # none is a bf16 value
    # 2^16 bf16 values (8 significant bits) sum exactly in float64; / 2^16 is exact too.
    mean = parameter.data.astype(np.float64).mean(axis=0)
    assert mean.tolist() == update.astype(np.float64).tolist()


def test_the_random_bits_depend_on_seed_step_and_parameter_only():
    bits = StochasticWeights(7).random_bits
    assert bits((5,), 3, 1).tolist() == StochasticWeights(7).random_bits((5,), 3, 1).tolist()
    others = [bits((5,), 4, 1), bits((5,), 3, 2), StochasticWeights(8).random_bits((5,), 3, 1)]
    assert all(other.tolist() != bits((5,), 3, 1).tolist() for other in others)


def test_a_stochastic_rounding_needs_an_optimizer_without_masters():
    with pytest.raises(ValueError, match="master_weights=False"):
        optim.SGD([bf16_parameter(np.ones(2))], rounding=StochasticWeights(0))
    with pytest.raises(ValueError, match="no float32 masters"):
        optimizer = optim.SGD([bf16_parameter(np.ones(2))], master_weights=False)
        optimizer.master_weights = [None]  # what ZeRO does to shard the masters


def run(world_size=1, log=lambda line: None, **flags):
    config = TrainConfig(**{**SMALL, **flags})
    config.validate(world_size)
    return dist.simulate(world_size, lambda comm: train(config, log=log, comm=comm))


@pytest.mark.parametrize("optimizer, slots", [("adam", 2), ("sgd", 1)])
@pytest.mark.parametrize("masters", ["fp32", "none"])
def test_the_memory_by_kind_is_the_formula(optimizer, slots, masters):
    """Bytes per parameter: 2 (bf16 weight) + 4 (float32 gradient sum) + 4 (master, or 0) +
    4 per float32 slot: 18 / 14 with Adam, 14 / 10 with SGD's momentum."""
    result = run(steps=2, optimizer=optimizer, master_weights=masters)[0]
    count = sum(weight.size for weight in result["master_weights"].values())
    expected = dict(parameters=2 * count, gradients=0, accumulators=4 * count,
                    masters=4 * count if masters == "fp32" else 0,
                    optimizer_state=4 * slots * count, buffers=0, gathered=0)
    assert result["model_state_by_kind"][0] == expected


def test_replicas_draw_the_same_bits_and_a_resumed_run_continues_the_stream(tmp_path):
    flags = dict(master_weights="none", stochastic_rounding=True)
    whole = run(steps=4, **flags)[0]["master_weights"]
    said = []
    run(2, said.append, steps=4, check_replicas=1, **flags)  # raises if the replicas differ
    assert ("step 4: replicas identical (the 2 replicas' bf16 weights have the same checksum)"
            in said)
    run(steps=2, save=str(tmp_path / "a.npz"), **flags)
    resumed = run(steps=4, resume=str(tmp_path / "a.npz"), **flags)[0]["master_weights"]
    assert all(resumed[name].tobytes() == whole[name].tobytes() for name in whole)
    nearest = run(steps=4, master_weights="none")[0]["master_weights"]
    assert any(nearest[name].tobytes() != whole[name].tobytes() for name in whole)


@pytest.mark.parametrize("flags, message", [
    (dict(stochastic_rounding=True), "--stochastic-rounding rounds weights kept without"),
    (dict(master_weights="none", precision="fp16"), "needs --precision bf16, got fp16"),
    (dict(master_weights="none", precision="fp32"), "needs --precision bf16, got fp32"),
    (dict(master_weights="none", precision="fp8"), "needs --precision bf16, got fp8"),
    (dict(master_weights="none", zero=1, dp=2), "--master-weights none with --zero 1: not built"),
    (dict(master_weights="none", pp=2), "--master-weights none with --pp 2: not built"),
    (dict(master_weights="none", stochastic_rounding=True, device="gpu"), "emulated on the CPU"),
])
def test_the_bad_combinations_are_refused_in_one_line(flags, message):
    with pytest.raises(ConfigError, match=message) as refused:
        TrainConfig(**{**SMALL, **flags}).validate(2)
    assert "\n" not in str(refused.value)


def test_to_nearest_is_the_cast():
    x = np.random.default_rng(1).normal(size=100).astype(np.float32)
    assert to_nearest(x, BFLOAT16, 1, 0).tobytes() == x.astype(BF16).tobytes()
