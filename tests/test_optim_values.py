"""Optimizer values: defaults and state round trips pinned to exact float32 results, and every
setting and parameter an optimizer cannot work with refused when it is built."""

import re

import numpy as np
import pytest

from minimp import Tensor, nn, optim
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


NAN, INF = float("nan"), float("inf")
POSITIVE, NON_NEGATIVE, DECAY_RATE = "a positive finite number", "a finite number >= 0", "in [0, 1)"
# (optimizer, the bad setting, the message's start and rule): each would have given NaN weights,
# an exception at the first step, or a run that diverges, had it been accepted
BAD_SETTINGS = [
    (optim.SGD, {"lr": 0}, "learning rate: lr=0", POSITIVE),
    (optim.Adam, {"lr": NAN}, "learning rate: lr=nan", POSITIVE),
    (optim.Adam, {"lr": INF}, "learning rate: lr=inf", POSITIVE),
    (optim.AdamW, {"lr": -1e-3}, "learning rate: lr=-0.001", POSITIVE),
    (optim.Adam, {"betas": (1, 1)}, r"beta parameter at index 0: betas\[0\]=1", DECAY_RATE),
    (optim.Adam, {"betas": (0.9, NAN)}, r"beta parameter at index 1: betas\[1\]=nan", DECAY_RATE),
    (optim.Adam, {"betas": (-0.1, 0.9)}, r"beta parameter at index 0: betas\[0\]=-0.1",
     DECAY_RATE),
    (optim.Adam, {"eps": 0}, "epsilon value: eps=0", POSITIVE),
    (optim.AdamW, {"eps": -1}, "epsilon value: eps=-1", POSITIVE),
    (optim.Adam, {"weight_decay": NAN}, "weight_decay value: weight_decay=nan", NON_NEGATIVE),
    (optim.SGD, {"weight_decay": -0.1}, "weight_decay value: weight_decay=-0.1", NON_NEGATIVE),
    (optim.AdamW, {"weight_decay": INF}, "weight_decay value: weight_decay=inf", NON_NEGATIVE),
    (optim.SGD, {"momentum": NAN}, "momentum value: momentum=nan", DECAY_RATE),
    (optim.SGD, {"momentum": 2}, "momentum value: momentum=2", DECAY_RATE),
    (optim.SGD, {"momentum": 1.0}, "momentum value: momentum=1.0", DECAY_RATE),
]


@pytest.mark.parametrize("make, setting, named, rule", BAD_SETTINGS,
                         ids=[f"{m.__name__}-{s}" for m, s, _, _ in BAD_SETTINGS])
def test_a_setting_outside_its_range_is_refused_naming_it_its_value_and_the_rule(
        make, setting, named, rule):
    with pytest.raises(ValueError, match=rf"^Invalid {named}; it must be {re.escape(rule)}$"):
        make([nn.Parameter(np.zeros(2, np.float32))], **setting)


@pytest.mark.parametrize("make, setting, named", [
    (optim.SGD, {"lr": "0.1"}, "learning rate: lr='0.1' is a str"),
    (optim.Adam, {"lr": True}, "learning rate: lr=True is a bool"),
    (optim.SGD, {"momentum": None}, "momentum value: momentum=None is a NoneType"),
    (optim.Adam, {"eps": np.bool_(True)}, "epsilon value: eps=np.True_ is a bool"),
])
def test_a_setting_that_is_not_a_number_is_a_type_error(make, setting, named):
    with pytest.raises(TypeError, match=rf"^Invalid {named}; it must be "):
        make([nn.Parameter(np.zeros(2, np.float32))], **setting)


@pytest.mark.parametrize("betas", [0.9, (0.9,), (0.9, 0.99, 0.999), "ab"])
def test_betas_that_are_not_a_pair_are_a_type_error_before_the_first_step(betas):
    # 0.9 used to be accepted and fail at the first step's unpacking
    with pytest.raises(TypeError, match=r"^Invalid betas: .*; betas must be a pair \(beta1, beta2"):
        optim.Adam([nn.Parameter(np.zeros(2, np.float32))], betas=betas)


def test_the_edges_of_each_range_are_accepted_as_the_numbers_they_are():
    # the closed ends: no momentum, no decay, beta 0; a tiny but positive learning rate
    # (1e-50 is 0 in float32, but the rate is a Python float, never stored in float32); NumPy
    # numbers are numbers
    parameter = nn.Parameter(np.zeros(2, np.float32))
    sgd = optim.SGD([parameter], lr=1e-50, momentum=0, weight_decay=0)
    assert (sgd.lr, sgd.momentum, sgd.weight_decays) == (1e-50, 0.0, [0.0])
    adam = optim.Adam([parameter], lr=np.float32(0.5), betas=[0, np.float64(0.5)], eps=1e-300)
    assert (adam.lr, adam.betas, adam.eps) == (0.5, (0.0, 0.5), 1e-300)
    assert type(adam.lr) is float and all(type(beta) is float for beta in adam.betas)


def test_a_groups_weight_decay_is_checked_as_the_optimizers():
    parameter = nn.Parameter(np.zeros(2, np.float32))
    message = "^Invalid weight_decay value: weight_decay=nan; it must be a finite number >= 0$"
    with pytest.raises(ValueError, match=message):
        optim.AdamW([{"params": [parameter], "weight_decay": NAN}])


def test_parameters_the_optimizer_cannot_update_are_refused_naming_which():
    weight, other = nn.Parameter(np.zeros(2, np.float32)), nn.Parameter(np.ones(2, np.float32))
    empty = optim.Adam([])  # allowed: a pipeline stage may hold no parameters
    empty.step()
    assert empty.step_count == 1 and empty.master_weights == []
    # twice: its update would be applied twice a step, through two masters that disagree
    with pytest.raises(ValueError, match="^optimizer: parameter 2 is parameter 0 again; pass each"):
        optim.SGD([weight, other, weight])
    with pytest.raises(ValueError, match="^optimizer: parameter 1 is parameter 0 again"):
        optim.Adam([{"params": [weight]}, {"params": [weight], "weight_decay": 0.1}])
    # an integer tensor: every update would round away, silently
    ids = Tensor(np.arange(2))
    with pytest.raises(TypeError, match="^optimizer: parameter 1 has dtype int64; only floating"):
        optim.Adam([weight, ids])
    with pytest.raises(TypeError, match="^optimizer: parameter 0 is a ndarray, not a Tensor"):
        optim.SGD([np.zeros(2, np.float32)])


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
