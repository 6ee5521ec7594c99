"""Lesson 15 (eight bits): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/15_eight_bits.ipynb became false, or a checker passes a wrong answer."""

import functools
import math

import ml_dtypes
import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor, nn, no_grad, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_shakespeare, text_batch
from minimp.models.gpt import GPT, GPTConfig
from minimp.precision import (
    BFLOAT16,
    E4M3,
    E5M2,
    DelayedScaling,
    Float8CurrentScaling,
    Fp8Quantizer,
    NoLossScaler,
    NoScaling,
    fp8,
    mixed_precision_step,
    update_scales,
)

CONFIG = GPTConfig(vocab_size=65, context=32, layers=2, heads=2, width=32)
WATCHED = ("1.attn.c_attn.input", "1.attn.c_attn.weight", "1.attn.c_attn.grad_output")
RECIPES = {"delayed": DelayedScaling, "current": Float8CurrentScaling, "none": NoScaling}
GRADIENT = "1.attn.c_attn.grad_output"
CODES = np.arange(256, dtype=np.uint8)


def loss_of(model, ids, targets):
    logits = model(Tensor(ids))
    return F.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1))


@functools.cache
def run(recipe=None, gradients="E5M2"):
    """The notebook's train(): (model, losses, validation loss, {tensor: {column: per step}})."""
    data = load_shakespeare()
    with limit_cpu_threads(1):
        model = GPT(CONFIG, np.random.default_rng(0))
        optimizer = optim.AdamW(model.parameters(), lr=3e-3)
        model.to(BFLOAT16)
        if recipe is not None:
            nn.enable_fp8(model, RECIPES[recipe]())
            for _, meta in nn.fp8_metas(model):
                meta.grad_output = Fp8Quantizer({"E4M3": E4M3, "E5M2": E5M2}[gradients],
                                                meta.recipe)
        quantizers = dict(nn.fp8_quantizers(model))
        losses, rows = [], {name: [] for name in WATCHED if name in quantizers}
        for step in range(1, 101):
            ids, targets = text_batch(data.train, seed=0, step=step, batch_size=16, context=32)
            loss = loss_of(model, ids, targets)
            loss.backward()
            mixed_precision_step(optimizer, NoLossScaler())
            for name, kept in rows.items():
                q = quantizers[name]
                kept.append((q.scale, q.step_amax, q.underflow / q.count, q.saturated / q.count))
            update_scales(list(quantizers.values()))
            losses.append(loss.item())
        model.eval()
        with no_grad():
            ids, targets = text_batch(data.validation, seed=1, step=1, batch_size=128, context=32)
            validation = loss_of(model, ids, targets).item()
    columns = ("scale", "amax", "underflow", "saturated")
    return model, losses, validation, {
        name: dict(zip(columns, np.array(kept).T)) for name, kept in rows.items()}


def linear_tensors(model):
    """Each Linear's input, weight and output gradient on the first batch, by kind."""
    kept = {}
    for name, linear in model.named_modules():
        if isinstance(linear, nn.Linear):
            kept[name] = store = {"weight": linear.weight.data}

            def forward(x, linear=linear, store=store):
                store["input"] = x.data
                y = nn.Linear.forward(linear, x)
                y.register_hook(lambda grad: store.update(grad_output=grad.copy()))
                return y

            linear.forward = forward
    ids, targets = text_batch(load_shakespeare().train, seed=0, step=1, batch_size=16, context=32)
    loss_of(model, ids, targets).backward()
    for _, linear in model.named_modules():
        vars(linear).pop("forward", None)
    return {kind: {name: np.asarray(store[kind], np.float32) for name, store in kept.items()}
            for kind in ("input", "weight", "grad_output")}


def relative(tensors):
    return np.concatenate([np.abs(x[x != 0]) / np.abs(x).max() for x in tensors.values()])


def stored(fraction, fmt):
    """(share below the normals, share zero, median relative error) with the amax on fmt.max."""
    values = fp8.to_float32(fp8.quantize(fraction * fmt.max, 1.0, fmt)) / fmt.max
    return (np.mean(fraction * fmt.max < fmt.smallest_normal), np.mean(values == 0),
            np.median(np.abs(values - fraction) / fraction))


def test_lesson15_the_formats_table_and_their_ranges():
    infos = {name: ml_dtypes.finfo(t) for name, t in (("fp32", np.float32), ("bf16", BFLOAT16),
             ("fp16", np.float16), ("E5M2", E5M2.dtype), ("E4M3", E4M3.dtype))}
    assert [(infos[n].nexp, infos[n].nmant) for n in ("E4M3", "E5M2")] == [(4, 3), (5, 2)]
    assert float(infos["E5M2"].smallest_normal) == float(infos["fp16"].smallest_normal) == 2**-14
    assert (E4M3.max, E5M2.max, float(infos["fp16"].max)) == (448, 57344, 65504)
    binades = {n: math.log2(float(i.max) / float(i.smallest_subnormal)) for n, i in infos.items()}
    assert [round(binades[n], 1) for n in ("E4M3", "E5M2", "fp16")] == [17.8, 31.8, 40.0]
    assert binades["bf16"] > 260 and binades["fp32"] > 260
    assert [float(infos[n].eps) for n in ("E4M3", "E5M2", "bf16")] == [1 / 8, 1 / 4, 1 / 128]


def test_lesson15_every_bit_pattern_and_e5m2_is_float16s_high_byte():
    counts = {}
    for fmt in (E4M3, E5M2):
        values = fp8.to_float32(CODES.view(fmt.dtype))
        positive = values[np.isfinite(values) & (values > 0)]
        from_1_to_2 = int(np.sum((positive >= 1) & (positive < 2)))
        counts[fmt.name] = (positive.size, int(np.isnan(values).sum()),
                            int(np.isinf(values).sum()), from_1_to_2,
                            f"0b{CODES[values == fmt.max][0]:08b}")
    assert counts == {"E4M3": (126, 2, 0, 8, "0b01111110"), "E5M2": (123, 6, 2, 4, "0b01111011")}
    nan_codes = np.array([0b01111111, 0b11111111], np.uint8).view(E4M3.dtype)  # S.1111.111
    assert np.isnan(fp8.to_float32(nan_codes)).all()
    high = (CODES.astype(np.uint16) << 8).view(np.float16).astype(np.float32)
    assert np.array_equal(high, fp8.to_float32(CODES.view(E5M2.dtype)), equal_nan=True)
    assert 448 == 1.75 * 2**8 and 1.875 * 2**7 == 240  # an E4M3 with infinities stops at 240
    if hasattr(ml_dtypes, "float8_e4m3"):  # ml_dtypes 0.5 has the IEEE-like E4M3
        assert float(ml_dtypes.finfo(ml_dtypes.float8_e4m3).max) == 240


def test_lesson15_ml_dtypes_rounds_past_the_maximum_and_minimp_saturates():
    beyond = np.array([448, 463.9, 464, 465, 1000, 57344, 61439, 61440, 1e6], np.float32)
    with np.errstate(invalid="ignore", over="ignore"):
        e4m3 = beyond.astype(E4M3.dtype).astype(np.float32)
        e5m2 = beyond.astype(E5M2.dtype).astype(np.float32)
    assert e4m3[:3].tolist() == [448] * 3 and np.isnan(e4m3[3:]).all()
    assert e5m2[4:7].tolist() == [1024, 57344, 57344] and np.isposinf(e5m2[7:]).all()
    for fmt in (E4M3, E5M2):
        saturated = fp8.to_float32(fp8.cast_saturating(beyond, fmt))
        assert np.all(saturated[beyond >= fmt.max] == fmt.max)
    assert 448 == 0b1110 * 2**5 and 57344 == 0b111 * 2**13  # last fraction bits 0 and 1
    assert round(464 / 448, 3) == 1.036


def test_lesson15_the_gpt_has_eight_linears_with_three_quantizers_each():
    model = nn.enable_fp8(GPT(CONFIG, np.random.default_rng(0)), DelayedScaling())
    assert len(nn.fp8_metas(model)) == 8 and len(list(nn.fp8_quantizers(model))) == 24
    assert [name for name, _ in nn.fp8_metas(model)][:4] == [
        "1.attn.c_attn", "1.attn.c_proj", "1.mlp.c_fc", "1.mlp.c_proj"]


def test_lesson15_where_the_linears_tensors_lie_against_each_format():
    assert [round(math.log2(f.max / f.smallest_normal), 1) for f in (E4M3, E5M2)] == [14.8, 29.8]
    zero = [math.log2(f.max / (f.smallest_subnormal / 2)) for f in (E4M3, E5M2)]
    assert [round(z, 1) for z in zero] == [18.8, 32.8]  # 4 and 3 binades below the normals
    at_step_1 = linear_tensors(GPT(CONFIG, np.random.default_rng(0)).to(BFLOAT16))
    after_100 = linear_tensors(run()[0])
    for tensors in (at_step_1, after_100):
        for kind in ("input", "weight"):
            (below, zero4, error4), (_, _, error5) = (stored(relative(tensors[kind]), f)
                                                      for f in (E4M3, E5M2))
            assert below < 0.000225 and zero4 < 0.0000175  # "at most 0.022%", "0.0017%"
            assert 0.021 <= error4 < 0.0225 and 0.0415 <= error5 < 0.0445
        assert stored(relative(tensors["grad_output"]), E5M2)[:2] == (0, 0)
    below, zero, _ = stored(relative(at_step_1["grad_output"]), E4M3)
    assert round(below, 3) == 0.016 and round(zero, 4) == 0.0013
    below, zero, _ = stored(relative(after_100["grad_output"]), E4M3)
    assert round(below, 4) == 0.0041 and round(zero, 5) == 0.00026
    q, k, v = np.split(np.abs(at_step_1["grad_output"]["1.attn.c_attn"]), 3, axis=-1)
    assert all(120 < v.max() / part.max() < 140 for part in (q, k))  # "about 130 times (2^7)"


def test_lesson15_the_runs_validation_losses_against_bf16():
    bf16 = run()[2]
    above = {name: run(*key)[2] / bf16 - 1 for name, key in (
        ("delayed", ("delayed",)), ("current", ("current",)), ("none", ("none",)),
        ("e4m3", ("delayed", "E4M3")))}
    assert [round(above[n] * 100, 2) for n in ("delayed", "current")] == [-0.10, 0.50]
    assert round(above["none"] * 100, 1) == 6.5 and round(above["e4m3"] * 100, 2) == 0.55
    assert np.mean(run("none")[1][20:30]) - np.mean(run()[1][20:30]) > 0.03  # behind by step 30

    def running_mean(losses):
        return np.convolve(losses, np.ones(10) / 10, mode="valid")

    for recipe in ("delayed", "current"):  # "their curves stay within 0.025 of bf16's"
        assert np.abs(running_mean(run(recipe)[1]) - running_mean(run()[1])).max() < 0.025


def test_lesson15_delayed_scaling_step_by_step():
    delayed, current, none = (run(r)[3] for r in ("delayed", "current", "none"))
    for tensor in WATCHED:  # step 1: scale 1, as with no scaling
        assert delayed[tensor]["underflow"][0] == none[tensor]["underflow"][0]
        assert current[tensor]["saturated"].max() == 0
    assert round(delayed[GRADIENT]["underflow"][0], 2) == 0.79
    assert round(delayed["1.attn.c_attn.weight"]["underflow"][0], 3) == 0.041
    saturated_steps = {t: int(np.sum(delayed[t]["saturated"] > 0)) for t in WATCHED}
    assert list(saturated_steps.values()) == [3, 0, 5]
    assert round(delayed[GRADIENT]["saturated"].max() * 100, 2) == 0.11
    amax, aim = delayed[GRADIENT]["amax"], E5M2.max / delayed[GRADIENT]["scale"]
    assert np.min(np.diff(np.log2(amax))) < -5  # "fell by more than 5 binades" in a step
    assert round(np.log2(amax[1:] / aim[1:]).min(), 1) == -5.7
    assert 512 * 96 == 49152 and delayed[GRADIENT]["underflow"][1:].max() <= 1 / 49152
    weight = delayed["1.attn.c_attn.weight"]
    assert round(weight["amax"][0], 3) == 0.074 and round(weight["amax"][-1], 2) == 0.12
    outran = np.max(weight["amax"][1:] / (E4M3.max / weight["scale"][1:]))
    assert round(outran - 1, 3) == 0.031 and outran < E4M3.saturation_threshold / E4M3.max


def test_lesson15_what_e5m2_buys_and_what_no_scaling_loses():
    lost = run("delayed", "E4M3")[3][GRADIENT]["underflow"][1:]
    assert round(lost.max(), 2) == 0.21 and round(lost.mean(), 3) == 0.020
    none = run("none")[3][GRADIENT]
    assert round(none["underflow"][0], 2) == 0.79 and round(none["underflow"].max(), 2) == 0.98
    binades = np.log2(E5M2.max / none["amax"])
    assert 23 <= binades.min() and binades.max() <= 31.5  # "23 to 31 binades below"


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def round_with_ml_dtypes(x, fmt):
    """ml_dtypes' own cast: NaN (E4M3) or inf (E5M2) past the largest number."""
    with np.errstate(invalid="ignore", over="ignore"):
        return x.astype(fmt.dtype).astype(np.float32)


def round_fp8_half_up(x, fmt):
    magnitude = np.minimum(np.abs(x.astype(np.float64)), fmt.max)
    _, exponent = np.frexp(np.maximum(magnitude, fmt.smallest_normal))
    gap = np.ldexp(1.0, exponent - 1 - fmt.mantissa_bits)
    return np.copysign(np.floor(magnitude / gap + 0.5) * gap, x).astype(np.float32)


def round_flushing_subnormals(x, fmt):
    rounded = solutions(14).round_to_fp8(x, fmt)
    return np.where(np.abs(rounded) < fmt.smallest_normal, np.float32(0), rounded)


def round_losing_the_sign_of_zero(x, fmt):
    rounded = solutions(14).round_to_fp8(x, fmt)
    return np.where(rounded == 0, np.float32(0), rounded)


def update_from_this_step_only(amax_history, amax, scale, fp8_max, margin):
    """The history kept, but the scale from this step's amax alone: current scaling, a step late."""
    history, _ = solutions(14).delayed_scaling_update(amax_history, amax, scale, fp8_max, margin)
    one_step = np.zeros(1, np.float32)
    _, new_scale = solutions(14).delayed_scaling_update(one_step, amax, scale, fp8_max, margin)
    return history, new_scale


def update_dividing_by_anything(amax_history, amax, scale, fp8_max, margin):
    history = np.roll(amax_history, 1)
    history[0] = amax
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return history, np.float32(fp8_max * 2.0**-margin / history.max())


def update_without_the_margin(amax_history, amax, scale, fp8_max, margin):
    return solutions(14).delayed_scaling_update(amax_history, amax, scale, fp8_max, 0)


def linear_without_scales(x, weight, bias):
    round_to_fp8 = solutions(14).round_to_fp8
    x_q = round_to_fp8(x.astype(np.float32), E4M3)
    w_q = round_to_fp8(weight.astype(np.float32), E4M3)
    return (x_q @ w_q.T + bias.astype(np.float32)).astype(BFLOAT16)


def linear_rounding_twice(x, weight, bias):
    product = solutions(14).fp8_linear(x, weight, np.zeros_like(bias))  # rounded to bf16 here
    return (product.astype(np.float32) + bias.astype(np.float32)).astype(BFLOAT16)


def linear_in_e5m2(x, weight, bias):
    def quantized(array):
        amax = np.float32(np.abs(array.astype(np.float32)).max())
        scale = np.float32(E5M2.max) / amax if amax > 0 else np.float32(1)
        return solutions(14).round_to_fp8(array.astype(np.float32) * scale, E5M2), scale

    (x_q, x_scale), (w_q, w_scale) = quantized(x), quantized(weight)
    inverses = (np.float32(1) / x_scale) * (np.float32(1) / w_scale)
    return ((x_q @ w_q.T) * inverses + bias.astype(np.float32)).astype(BFLOAT16)


WRONG = {
    "check_round_to_fp8": [
        Wrong(round_with_ml_dtypes, ""),
        Wrong(round_fp8_half_up, ""),
        Wrong(round_flushing_subnormals, ""),
        Wrong(round_losing_the_sign_of_zero, ""),
    ],
    "check_delayed_scaling_update": [
        Wrong(update_from_this_step_only, ""),
        Wrong(update_dividing_by_anything, ""),
        Wrong(update_without_the_margin, ""),
    ],
    "check_fp8_linear": [
        Wrong(linear_without_scales, ""),
        Wrong(linear_rounding_twice, ""),
        Wrong(linear_in_e5m2, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(15, WRONG)
