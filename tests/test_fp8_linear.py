"""The fp8 Linear: E4M3 inputs forward, E5M2 output gradients backward, the product of the
dequantized values rounded once, the bias gradient summed from the unquantized output gradient;
which layers a model puts in fp8; evaluation changes no scale."""

import numpy as np
import pytest

from minimp import Tensor, nn, no_grad
from minimp import functional as F
from minimp.models.gpt import GPT, GPTConfig
from minimp.precision import BFLOAT16, DelayedScaling, Float8CurrentScaling, Fp8Meta, NoScaling
from minimp.precision import fp8


def tensors(*arrays, dtype=BFLOAT16):
    """Leaf tensors in bf16 that want gradients."""
    return [Tensor(np.asarray(a, np.float32).astype(dtype), requires_grad=True) for a in arrays]


def test_values_fp8_holds_exactly_give_the_bf16_linears_results(rng):
    """Inputs and weights that E4M3 holds and output gradients that E5M2 holds, at scale 1: the
    fp8 product is exact, so forward and every gradient equal the 16-bit Linear's, bit for bit."""
    x = rng.choice([-3.0, -1.5, -0.5, 0.5, 1.0, 2.0], (6, 8))
    weight = rng.choice([-0.375, -0.125, 0.25, 0.5], (4, 8))
    grad = rng.choice([-1.5, -0.5, 1.0, 1.25], (6, 4)).astype(np.float32).astype(BFLOAT16)
    bias = rng.standard_normal(4)
    plain, quantized = tensors(x, weight, bias), tensors(x, weight, bias)
    expected = F.linear(*plain)
    output = F.linear(*quantized, fp8_meta=Fp8Meta(DelayedScaling()))  # first step: scale 1
    assert output.data.tobytes() == expected.data.tobytes()
    expected.backward(grad)
    output.backward(grad)
    for ours, theirs in zip(quantized, plain):
        assert ours.grad.dtype == BFLOAT16 and ours.grad.tobytes() == theirs.grad.tobytes()


def test_forward_is_the_product_of_the_dequantized_values_rounded_once(rng):
    x, weight = rng.standard_normal((32, 16)), rng.standard_normal((8, 16)) * 0.05
    bias = rng.standard_normal(8)
    meta = Fp8Meta(Float8CurrentScaling())
    inputs = tensors(x, weight, bias)
    output = F.linear(*inputs, fp8_meta=meta)
    x_fp8 = fp8.quantize(inputs[0].data, meta.input.scale, fp8.E4M3)
    w_fp8 = fp8.quantize(inputs[1].data, meta.weight.scale, fp8.E4M3)
    x_values = fp8.dequantize(x_fp8, meta.input.scale).astype(np.float64)
    w_values = fp8.dequantize(w_fp8, meta.weight.scale).astype(np.float64)
    exact = x_values @ w_values.T + inputs[2].data.astype(np.float64)
    # float32 sums and one rounding to bf16 (8 significant bits): within a bf16 rounding.
    np.testing.assert_allclose(output.data.astype(np.float64), exact, rtol=2.0**-8, atol=1e-6)
    error = np.abs(output.data.astype(np.float64) - (x @ weight.T + bias)).max()
    assert 0 < error < 0.1  # fp8 costs precision, not the answer


def test_forward_saturates_in_e4m3_and_backward_reads_e5m2():
    """Unscaled, an input of 1000 saturates at E4M3's 448; an output gradient of 1000 is E5M2's
    1024 (E4M3 would have saturated it too), and the weight gradient shows which."""
    x, weight, bias = tensors([[1000.0, 1.0]], [[0.5, 2.0]], [0.0])
    output = F.linear(x, weight, bias, fp8_meta=Fp8Meta(NoScaling()))
    assert output.data.astype(np.float32).tolist() == [[448.0 * 0.5 + 2.0]]  # not 502
    output.backward(np.array([[1000.0]], np.float32).astype(BFLOAT16))
    assert weight.grad.astype(np.float32).tolist() == [[1024.0 * 448.0, 1024.0]]
    assert x.grad.astype(np.float32).tolist() == [[512.0, 2048.0]]


def test_forward_keeps_fp8_copies_for_backward_and_evaluation_records_nothing(rng):
    meta = Fp8Meta(DelayedScaling())
    x, weight, bias = tensors(rng.standard_normal((4, 8)), rng.standard_normal((3, 8)), np.zeros(3))
    output = F.linear(x, weight, bias, fp8_meta=meta)
    saved = output.node.context.saved_arrays
    assert [a.dtype for a in saved] == [fp8.E4M3.dtype] * 2 and saved[0].nbytes == 32
    counts = [(q.step_amax, q.count) for _, q in meta.quantizers()]
    with no_grad():
        F.linear(x, weight, bias, fp8_meta=meta)
    assert [(q.step_amax, q.count) for _, q in meta.quantizers()] == counts


def test_a_gpt_puts_its_linears_in_fp8_and_nothing_else():
    model = GPT(GPTConfig(layers=2, width=32, heads=2, context=8), np.random.default_rng(0))
    model.to("bf16")
    nn.enable_fp8(model, DelayedScaling())
    names = [name for name, _ in nn.fp8_metas(model)]
    per_block = ["attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"]
    assert names == [f"{block}.{layer}" for block in (1, 2) for layer in per_block]
    assert [name for name, _ in nn.fp8_quantizers(model)][:3] == [
        "1.attn.c_attn.input", "1.attn.c_attn.weight", "1.attn.c_attn.grad_output"
    ]  # fmt: skip
    ids = np.random.default_rng(1).integers(0, 65, (2, 8))
    logits = model(ids)
    logits.sum().backward()
    assert logits.dtype == BFLOAT16
    assert all(meta.grad_output.count > 0 for _, meta in nn.fp8_metas(model))
    state = nn.fp8_state_dict(model)
    assert len(state) == 2 * 3 * len(names) and state["1.mlp.c_fc.input/scale"].dtype == np.float32


@pytest.mark.parametrize("bias", [True, False])
def test_a_linear_without_bias_works_in_fp8(bias, rng):
    layer = nn.Linear(8, 3, bias=bias, rng=rng).to("bf16")
    nn.enable_fp8(layer, Float8CurrentScaling())
    x = Tensor(rng.standard_normal((5, 8)).astype(BFLOAT16), requires_grad=True)
    layer(x).sum().backward()
    assert x.grad.shape == (5, 8) and layer.weight.grad.shape == (3, 8)


@pytest.mark.parametrize(
    "needs", [(False, True, False), (True, False, False), (False, False, True)]
)
def test_the_fp8_backward_skips_the_gradients_nobody_asked_for(needs):
    """Fp8Linear's own contract, as the other ops': a gradient not asked for is None (through the
    graph node_backward drops it anyway, so only a direct call tells)."""
    from minimp.function import Context
    from minimp.ops.linalg import Fp8Linear

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    weight = rng.standard_normal((2, 3)).astype(np.float32)
    bias = np.zeros(2, np.float32)
    ctx = Context(needs)
    Fp8Linear.forward(ctx, x, weight, bias, Fp8Meta(DelayedScaling()))
    grads = Fp8Linear.backward(ctx, np.ones((4, 2), np.float32))
    for grad, needed in zip(grads, needs):
        assert (grad is None) != needed


def test_the_bias_gradient_is_the_float32_sum_of_the_unquantized_output_gradient(rng):
    """dL/db is summed from the bf16 dL/dy before its E5M2 quantization (as Transformer Engine's
    fused cast computes it), over the 64 rows in float32, and rounded once. From the quantized
    dL/dy (2 fraction bits) it would be off by percents; summed in bf16 (8 significant bits),
    its last bits would move."""
    x, weight, bias = tensors(rng.standard_normal((64, 8)), rng.standard_normal((4, 8)),
                              rng.standard_normal(4))
    grad = rng.standard_normal((64, 4)).astype(np.float32).astype(BFLOAT16)
    F.linear(x, weight, bias, fp8_meta=Fp8Meta(DelayedScaling())).backward(grad)
    expected = grad.astype(np.float32).sum(axis=0).astype(BFLOAT16)
    assert bias.grad.dtype == BFLOAT16 and bias.grad.tobytes() == expected.tobytes()
