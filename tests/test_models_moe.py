"""The mixture-of-experts block: routing and admission by hand, the auxiliary losses by hand, every
gradient against float64 central differences, the router in float32 in 16-bit models."""

import math

import numpy as np
import pytest
from gradcheck import numerical_gradient

from minimp import Tensor, nn
from minimp.models.gpt import GPT, GPTConfig
from minimp.models.moe import (AttachAuxLoss, AuxLossWeights, MoE, capacity,
                               load_balancing_loss, route, z_loss)
from minimp.split_backward import backward_input, backward_weight
from minimp.precision.casting import BFLOAT16

# One group (sample) of T = 4 tokens over E = 3 experts, each row a token's router probabilities.
PROBS = np.array([[0.6, 0.3, 0.1],    # first choice 0, second 1
                  [0.6, 0.3, 0.1],    # 0, then 1
                  [0.5, 0.4, 0.1],    # 0, then 1
                  [0.2, 0.7, 0.1]])   # 1, then 0


def test_top_k_choices_are_best_first_and_ties_go_to_the_lower_expert():
    routing = route(np.array([[[0.2, 0.5, 0.3], [0.4, 0.2, 0.4]]]), top_k=2, capacity_factor=0)
    np.testing.assert_array_equal(routing.experts, [[[1, 2], [0, 2]]])


def test_admission_is_first_choices_first_then_token_order_and_drops_exactly_those_pairs():
    """Capacity ceil(1.0 x 4 x 2 / 3) = 3. Expert 0: the first choices of tokens 0, 1, 2 fill it,
    so token 3's second choice (expert 0) is dropped. Expert 1: token 3's FIRST choice is admitted
    before the second choices of tokens 0 and 1, so token 2's second choice is the one dropped
    (token order alone would have dropped token 3's first choice instead)."""
    routing = route(PROBS[None], top_k=2, capacity_factor=1.0)
    assert routing.capacity == 3 == capacity(4, 2, 3, 1.0)
    np.testing.assert_array_equal(routing.kept, [[[1, 1], [1, 1], [1, 0], [1, 0]]])
    np.testing.assert_array_equal(routing.counts, [[4, 4, 0]])  # before dropping
    # the same tokens in another order: the drops follow them (token order alone: the last two)
    np.testing.assert_array_equal(route(PROBS[None, [3, 0, 1, 2]], 2, 1.0).kept,
                                  [[[1, 0], [1, 1], [1, 1], [1, 0]]])
    assert route(PROBS[None], 2, capacity_factor=0).kept.all()  # dropless keeps every pair
    assert route(PROBS[None], 2, capacity_factor=2.0).kept.all()  # ceil(2 x 8 / 3) = 6
    assert capacity(4, 2, 3, 0) == 8


def test_the_load_balancing_loss_and_the_z_loss_by_hand():
    """Group 1 (PROBS): f = (4, 4, 0)/8, P = (0.475, 0.425, 0.1): 3 x 0.45 = 1.35. Group 2, every
    token (1/3, 1/3, 1/3) choosing experts 0 and 1 (ties): f = (1/2, 1/2, 0), P = 1/3: 3 x 1/3 = 1.
    The loss is their mean, 1.175."""
    probs = np.stack([PROBS, np.full((4, 3), 1 / 3)])  # (B=2, T=4, E=3)
    routing = route(probs, top_k=2, capacity_factor=1.0)
    aux = load_balancing_loss(Tensor(probs.astype(np.float32)), routing, top_k=2)
    assert aux.dtype == np.float32 and math.isclose(aux.item(), 1.175, rel_tol=1e-6)
    logits = np.array([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    expected = np.mean(np.log(np.exp(logits).sum(axis=1)) ** 2)
    assert math.isclose(z_loss(Tensor(logits)).item(), expected, rel_tol=1e-12)


def tiny_moe(capacity_factor, rng, top_k=2):
    return MoE(width=4, experts=3, top_k=top_k, capacity_factor=capacity_factor, hidden=5,
               bias=True, dropout=nn.Dropout(0.0, layer=3), rng=rng)


def test_the_output_is_the_renormalised_gate_weighted_sum_of_the_admitted_experts():
    rng = np.random.default_rng(2)
    moe = tiny_moe(1.0, rng).to(np.float64)
    x = rng.standard_normal((2, 6, 4))
    y = moe(Tensor(x)).data
    probs = np.exp(moe.router_logits.data)
    probs /= probs.sum(axis=1, keepdims=True)  # (N, E)
    routing, rows = moe.routing, x.reshape(12, 4)
    assert not routing.kept.all()
    expected = np.zeros((12, 4))
    for token, (experts, kept) in enumerate(zip(routing.experts.reshape(12, 2),
                                                routing.kept.reshape(12, 2))):
        chosen = probs[token, experts]
        for expert, gate, admitted in zip(experts, chosen / chosen.sum(), kept):
            if admitted:
                output = moe.experts[expert](Tensor(rows[token : token + 1])).data[0]
                expected[token] += gate * output
    np.testing.assert_allclose(y.reshape(12, 4), expected, rtol=1e-12, atol=1e-14)


# What the training loop tells the mixtures in the gradient checks: the coefficients, and the
# root's gradient 0.25 (a loss scale of 1 over 4 micro-batches), not 1, so a scale lost is seen.
AUX_WEIGHTS = AuxLossWeights(aux_loss_coef=1.0, router_z_loss_coef=0.5, grad_scale=0.25)


@pytest.mark.parametrize("capacity_factor, top_k", [(0.0, 2), (1.0, 2), (1.0, 1)],
                         ids=["dropless", "capacity 1.0", "top-1"])
def test_every_gradient_matches_float64_central_differences(capacity_factor, top_k):
    """The input, the router (through the gates, the load-balancing loss and the z-loss) and
    every expert's weights; with capacity 1.0 some pairs are dropped (asserted). The auxiliary
    losses reach backward as a training forward attaches them (AttachAuxLoss, grad_scale 0.25):
    backward from 0.25 x sum(y w) gives the gradient of 0.25 x (sum(y w) + aux + 0.5 z)."""
    rng = np.random.default_rng(5)
    moe = tiny_moe(capacity_factor, rng, top_k).to(np.float64)
    moe.aux_weights = AUX_WEIGHTS
    x = rng.standard_normal((2, 6, 4))
    weights = rng.standard_normal((2, 6, 4))

    def scalar(arrays):
        for parameter, array in zip(moe.parameters(), arrays[1:]):
            parameter.data = array
        y = moe(Tensor(arrays[0]))
        losses = (y.data * weights).sum() + moe.aux_loss.item() + 0.5 * moe.z_loss.item()
        return float(0.25 * losses)

    originals = [x] + [parameter.data.copy() for parameter in moe.parameters()]
    tensor = Tensor(x, requires_grad=True)
    y = moe(tensor)
    if capacity_factor:
        assert not moe.routing.kept.all()  # the check covers dropped pairs
    ((y * Tensor(weights)).sum() * 0.25).backward()
    analytic = [tensor.grad] + [parameter.grad.copy() for parameter in moe.parameters()]
    names = ["x"] + [name for name, _ in moe.named_parameters()]
    for index, (name, got) in enumerate(zip(names, analytic)):
        positions = list(np.ndindex(originals[index].shape))
        expected = numerical_gradient(scalar, [a.copy() for a in originals], index, positions)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7, err_msg=name)


def test_attach_aux_loss_is_the_identity_forward_and_gives_the_aux_the_roots_gradient():
    """AttachAuxLoss(x, aux) against float64 central differences of sum(y w) + 0.25 aux, which
    is what its backward computes (grad_scale 0.25): dL/dx = w, and aux's 0.25."""
    rng = np.random.default_rng(3)
    x, w, aux = rng.standard_normal((2, 3)), rng.standard_normal((2, 3)), np.array(1.5)
    tensors = [Tensor(x, requires_grad=True), Tensor(aux, requires_grad=True)]
    y = AttachAuxLoss.apply(*tensors, grad_scale=0.25)
    np.testing.assert_array_equal(y.data, x)
    (y * Tensor(w)).sum().backward()

    def scalar(arrays):
        return float((arrays[0] * w).sum() + 0.25 * arrays[1])

    for index, tensor in enumerate(tensors):
        positions = list(np.ndindex(tensor.shape))
        expected = numerical_gradient(scalar, [x.copy(), aux.copy()], index, positions)
        np.testing.assert_allclose(tensor.grad, expected, rtol=1e-7, atol=1e-9)


def test_the_aux_gradient_reaches_the_router_in_w_when_backward_is_split():
    """zb-h1 splits backward into B (inputs) and W (weights): the router's gradient, aux part
    included, waits for W, and B then W gives one backward's bits; without the attached losses
    the router's gradient differs (they reached it)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 6, 4)).astype(np.float32)

    def router_gradient(split, weights=AUX_WEIGHTS):
        moe = tiny_moe(1.0, np.random.default_rng(7))
        moe.aux_weights = weights
        tensor = Tensor(x, requires_grad=True)
        y = moe(tensor).sum()
        if not split:
            y.backward()
            return moe.router.weight.grad, tensor.grad
        pending = backward_input(y, None, list(moe.parameters()))
        assert moe.router.weight.grad is None and tensor.grad is not None
        backward_weight(pending)
        return moe.router.weight.grad, tensor.grad

    (whole, x_whole), (split, x_split) = router_gradient(False), router_gradient(True)
    np.testing.assert_array_equal(split, whole)
    np.testing.assert_array_equal(x_split, x_whole)
    without, _ = router_gradient(False, AuxLossWeights())
    assert not np.allclose(without, whole, rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float16, BFLOAT16], ids=["fp16", "bf16"])
def test_the_router_runs_in_float32_in_a_16_bit_model(dtype):
    rng = np.random.default_rng(0)
    moe = tiny_moe(1.0, rng).to(dtype)
    x = Tensor(rng.standard_normal((2, 6, 4)).astype(dtype), requires_grad=True)
    y = moe(x)
    assert moe.router_logits.dtype == np.float32 and moe.aux_loss.dtype == np.float32
    assert y.dtype == dtype
    (y.astype(np.float32).sum() + moe.aux_loss).backward()
    assert x.grad.dtype == dtype and moe.router.weight.grad.dtype == dtype
    assert np.isfinite(moe.router.weight.grad.astype(np.float32)).all()


def test_a_gpt_with_experts_replaces_each_mlp_and_keeps_the_dense_one_without():
    config = GPTConfig(vocab_size=7, context=5, layers=2, heads=2, width=8, experts=3, top_k=2,
                       expert_hidden=6)
    model = GPT(config, np.random.default_rng(0))
    shapes = {name: p.shape for name, p in model.named_parameters()}
    assert shapes["1.mlp.router.weight"] == (3, 8) and "1.mlp.router.bias" not in shapes
    assert shapes["2.mlp.experts.2.c_fc.weight"] == (6, 8) and "1.mlp.c_fc.weight" not in shapes
    logits = model(np.zeros((2, 5), np.int64))
    assert logits.shape == (2, 5, 7)
    dense = GPT(GPTConfig(vocab_size=7, context=5, layers=2, heads=2, width=8),
                np.random.default_rng(0))
    assert "1.mlp.c_fc.weight" in dict(dense.named_parameters())


def test_an_expert_no_token_chose_gets_a_zero_gradient_not_none():
    """Every data-parallel replica must reduce the same parameters, whatever its tokens chose."""
    rng = np.random.default_rng(0)
    moe = tiny_moe(0.0, rng, top_k=1)
    moe.router.weight.data[...] = 0.0
    moe.router.weight.data[0, 0] = 1.0  # every token with x[..., 0] > 0 picks expert 0
    x = Tensor(np.abs(rng.standard_normal((1, 3, 4))).astype(np.float32))
    moe(x).sum().backward()
    assert (moe.routing.experts == 0).all()
    for name, parameter in moe.experts.named_parameters():
        assert parameter.grad is not None, name
        assert (parameter.grad == 0).all() == (not name.startswith("0.")), name
