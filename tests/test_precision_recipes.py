"""The Recipe interface: a Linear's forward and backward under each block-scaled recipe equal a
reference written here from blocks.quantize and float32 matmuls, bit for bit; the per-tensor
recipes describe themselves through the same interface; a short GPT run per recipe (slow)."""

import numpy as np
import pytest

from minimp import Tensor
from minimp import functional as F
from minimp.precision import BFLOAT16, blocks
from minimp.precision.accumulate import limited_accumulation
from minimp.precision.fp8_scaling import DelayedScaling, Float8CurrentScaling, Fp8Meta, NoScaling
from minimp.precision.recipes import (RECIPES, BlockScaledMeta, Gemm, Operand, saved_scale_bytes,
                                      scaled_gemm)

F32 = np.float32
# Each recipe's groups, written out here (not read from RECIPES): (x and dy along K, W in the
# forward and grad_input GEMMs, rule, dy's format, accumulation).
EXPECTED = {
    "rowwise": ((1, None), (1, None), "current", "E5M2", "fp32"),
    "blockwise": ((1, 128), (128, 128), "current", "E4M3", "limited"),
    "mxfp8": ((1, 32), (1, 32), "mx_floor", "E4M3", "fp32"),
    "mxfp8-round-up": ((1, 32), (1, 32), "mx_round_up", "E4M3", "fp32"),
}


def reference_gemm(a, bt, a_group, b_group, a_fmt, b_fmt, rule, accumulate):
    """A @ B from A (M, K) and B^T (N, K): blocks.quantize each along K, then for each K block (in
    order) the float32 product of the values (or the 14-bit accumulator's), times the two groups'
    scales multiplied in float32, added in float32."""
    qa = blocks.quantize(a, a_fmt, a_group, rule)
    qb = blocks.quantize(bt, b_fmt, b_group, rule)
    block = qa.group_shape[1]
    rows_a = np.arange(a.shape[0]) // qa.group_shape[0]  # each row's group
    rows_b = np.arange(bt.shape[0]) // qb.group_shape[0]
    out = np.zeros((a.shape[0], bt.shape[0]), F32)
    for q in range(a.shape[1] // block):
        va = qa.data[:, q * block:(q + 1) * block].astype(F32)
        vb = qb.data[:, q * block:(q + 1) * block].astype(F32)
        if accumulate == "limited":
            partial = limited_accumulation(va, vb.T, interval=block)
        else:
            partial = np.matmul(va[None], vb.T[None])[0]
        scales = (qa.scale_inv.astype(F32)[rows_a, q][:, None]
                  * qb.scale_inv.astype(F32)[rows_b, q][None, :])
        out = out + partial * scales
    return out


def bf16(array):
    return np.asarray(array, F32).astype(BFLOAT16)


@pytest.mark.parametrize("name", list(EXPECTED))
def test_a_linear_under_each_recipe_equals_the_hand_written_reference(name, rng):
    """Forward, dL/dx and dL/dW bit for bit; x and dy quantized along each GEMM's K (tokens for
    dL/dW: DeepSeek-V3's 128x1 tiles of x), W along in (forward) and out (dL/dx)."""
    group, weight_group, rule, dy_fmt, accumulate = EXPECTED[name]
    tokens, features_in, features_out = 128, 128, 256
    spread = np.exp(rng.standard_normal((1, features_in)))  # channels of different magnitudes
    x = bf16(rng.standard_normal((tokens, features_in)) * spread)
    weight = bf16(rng.standard_normal((features_out, features_in)) * 0.05)
    bias = bf16(rng.standard_normal(features_out))
    grad = bf16(rng.standard_normal((tokens, features_out)) * 1e-3)
    inputs = [Tensor(a, requires_grad=True) for a in (x, weight, bias)]
    output = F.linear(*inputs, fp8_meta=BlockScaledMeta(RECIPES[name]))
    output.backward(grad)
    x32, w32, g32 = (a.astype(F32) for a in (x, weight, grad))
    forward = reference_gemm(x32, w32, group, weight_group, "E4M3", "E4M3", rule, accumulate)
    grad_x = reference_gemm(g32, w32.T, group, weight_group, dy_fmt, "E4M3", rule, accumulate)
    grad_w = reference_gemm(g32.T, x32.T, group, group, dy_fmt, "E4M3", rule, accumulate)
    assert output.data.tobytes() == bf16(forward + bias.astype(F32)).tobytes()
    assert inputs[0].grad.tobytes() == bf16(grad_x).tobytes()
    assert inputs[1].grad.tobytes() == bf16(grad_w).tobytes()
    assert inputs[2].grad.tobytes() == bf16(g32.sum(axis=0)).tobytes()


def test_rowwise_and_blockwise_beat_one_scale_per_tensor_with_an_outlier_channel(rng):
    """One input channel 100x the rest: rowwise and blockwise forwards are closer to the float64
    product than per-tensor current scaling's; MXFP8's floor scale is not (its amax above 448's
    mantissa saturates: the issue's 4.3e-2 against 3.4e-2), and its round-up variant less so."""
    x = rng.standard_normal((128, 128))
    x[:, 3] *= 100
    weight = rng.standard_normal((128, 128)) * 0.05
    exact = x @ weight.T
    metas = {"current": Fp8Meta(Float8CurrentScaling()),
             **{name: BlockScaledMeta(recipe) for name, recipe in RECIPES.items()}}
    errors = {}
    for name, meta in metas.items():
        inputs = [Tensor(bf16(a)) for a in (x, weight, np.zeros(128))]
        y = F.linear(*inputs, fp8_meta=meta).data.astype(np.float64)
        errors[name] = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    print({name: round(float(error), 4) for name, error in errors.items()})
    assert errors["rowwise"] < errors["current"] and errors["blockwise"] < errors["current"]
    assert errors["current"] < errors["mxfp8"] and errors["mxfp8-round-up"] < errors["mxfp8"]


def test_the_per_tensor_recipes_describe_themselves_through_the_same_interface():
    for recipe, rule in ((DelayedScaling(), "delayed"), (Float8CurrentScaling(), "current"),
                         (NoScaling(), "none")):
        gemms = recipe.gemms
        e4m3 = Operand("E4M3", "tensor", rule)
        assert gemms.forward == Gemm(e4m3, e4m3)
        assert gemms.grad_input.a == gemms.grad_weight.a == Operand("E5M2", "tensor", rule)
    assert not any(recipe.has_state for recipe in RECIPES.values())


def test_scaled_gemm_refuses_mismatched_k_blocks(rng):
    """(NVFP4's tensor scales, which it once refused, are tests/test_precision_nvfp4.py's.)"""
    a = blocks.quantize(rng.standard_normal((4, 64)), "E4M3", "1x32", "mx_floor")
    b = blocks.quantize(rng.standard_normal((4, 64)), "E4M3", "rowwise", "current")
    with pytest.raises(ValueError, match="same K and K blocks"):
        scaled_gemm(a, b, "fp32")


@pytest.mark.parametrize("overrides, message", [
    (dict(fp8_recipe="blockwise", hidden=96, heads=2), "--hidden a multiple of 128 .* got 96"),
    (dict(fp8_recipe="mxfp8", batch_size=5, context=16), "5 rows x --context 16 = 80, to be a "
     "multiple of 32 .* change --batch-size"),
    (dict(fp8_recipe="rowwise", tp=2), "rowwise with --tp is not built"),
    (dict(fp8_recipe="blockwise", dataset="digits"), "the MLP's input and class counts"),
], ids=["hidden", "tokens", "tp", "mlp"])
def test_sizes_a_group_does_not_tile_are_refused_in_one_line(overrides, message):
    from minimp.checkpoints.errors import ConfigError
    from minimp.train.config import TrainConfig

    config = TrainConfig(**{"dataset": "shakespeare", "precision": "fp8", **overrides})
    with pytest.raises(ConfigError, match=message):
        config.validate(overrides.get("tp", 1))
    nanogpt_cpu = TrainConfig(dataset="shakespeare", precision="fp8", fp8_recipe="blockwise")
    nanogpt_cpu.validate()  # width 128, 12 x 64 = 768 tokens: accepted


def three_steps(**overrides):
    """Each step's (loss, peak activation bytes) over 3 steps of a one-block GPT of width 128 on
    one process (8 x 16 = 128 tokens a step: one 128-token block for the weight gradient's K)."""
    from minimp import backend, distributed as dist
    from minimp.train.config import TrainConfig
    from minimp.train.loop import Run

    config = TrainConfig(dataset="shakespeare", layers=1, hidden=128, heads=2, context=16,
                         batch_size=8, steps=3, warmup=1, eval_every=0, log_every=1000,
                         **overrides)
    config.validate(1)

    def body(comm):
        run = Run(config, comm, log=lambda line: None)
        for step in range(1, config.steps + 1):
            run.step(step)
        return [(record["loss"], record["peak_activation_bytes"])
                for record in run.history.records]

    with backend.limit_cpu_threads(1):
        (losses,) = dist.simulate(1, body)
    return losses


@pytest.mark.slow
def test_three_steps_of_each_recipe_stay_finite_and_near_bf16():
    """And the activations they keep are delayed scaling's plus the scales of their groups,
    saved_scale_bytes of each Linear (c_attn 128 -> 384, c_proj 128 -> 128, c_fc 128 -> 512,
    c_proj 512 -> 128, 128 tokens), exactly."""
    bf16_losses = [loss for loss, _ in three_steps(precision="bf16")]
    delayed_peak = max(peak for _, peak in three_steps(precision="fp8"))
    linears = ((128, 384), (128, 128), (128, 512), (512, 128))
    for name in EXPECTED:
        losses, peaks = zip(*three_steps(precision="fp8", fp8_recipe=name))
        assert np.all(np.isfinite(losses)), (name, losses)
        # measured: within 0.05% of bf16's 3.8481 at step 3 (3.8489 to 3.8495)
        assert abs(losses[-1] - bf16_losses[-1]) < 0.005 * bf16_losses[-1], (name, losses)
        scales = sum(saved_scale_bytes(RECIPES[name], i, o, 128) for i, o in linears)
        assert max(peaks) == delayed_peak + scales, (name, max(peaks), delayed_peak, scales)
