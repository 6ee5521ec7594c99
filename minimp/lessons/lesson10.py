"""Lesson 10 (mixed precision meets attention): the lesson's model, data and measurements, shared
by the notebook and its claims tests (tests/lessons/test_lesson10.py), and the checkers of its
exercises: the fused softmax's forward and backward, the bytes one GPT block keeps for backward,
dropout's counter-based keep mask. Reference solutions: lessons/solutions/lesson10.py."""

import math
from typing import Any, Callable

import ml_dtypes
import numpy as np

from minimp import Tensor, optim
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import text_batch
from minimp.lessons.checking import Report, call, expect
from minimp.lessons.lesson02 import ATOL, RTOL, numerical_gradient
from minimp.models.gpt import GPT, GPTConfig
from minimp.precision import NoLossScaler, mixed_precision_step
from minimp.sample import generate
from minimp.tensor import saved_bytes

F16 = np.float16

# ----- the lesson's model and data (the notebook and its tests use these, nothing else) ------
# tiny-shakespeare's 65 characters; 2 blocks of width 64, 4 heads of 16, a context of 32
CONFIG = GPTConfig(vocab_size=65, context=32, layers=2, heads=4, width=64)
STEPS, BATCH_SIZE, LR = 200, 16, 3e-3  # float32 training: AdamW at 3e-3 on 16 windows a step
EVAL_BATCH_SIZE = 64  # the validation windows every measurement looks at
CAUSAL = np.tri(CONFIG.context, dtype=bool)  # (T, T): where query i may attend (keys 0..i)


def new_model() -> GPT:
    """The lesson's GPT, initialised from seed 0 (GPT-2's initialisation)."""
    return GPT(CONFIG, np.random.default_rng(0))


def loss_of(model: GPT, ids: np.ndarray, targets: np.ndarray) -> Tensor:
    """The cross-entropy averaged over every character of the batch, in nats."""
    logits = model(Tensor(ids))  # (B, T, V)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def train(model: GPT, data: Any) -> list[float]:
    """STEPS steps of AdamW in float32 on the training split; the loss of each step."""
    optimizer, losses = optim.AdamW(model.parameters(), lr=LR), []
    with limit_cpu_threads(1):  # products this small run fastest on one BLAS thread
        for step in range(1, STEPS + 1):
            ids, targets = text_batch(data.train, seed=0, step=step, batch_size=BATCH_SIZE,
                                      context=CONFIG.context)
            loss = loss_of(model, ids, targets)
            loss.backward()
            mixed_precision_step(optimizer, NoLossScaler())  # float32: accumulate, step, zero
            losses.append(loss.item())
    return losses


def sample(model: GPT, data: Any) -> str:
    """160 characters after "ROMEO:", drawn at temperature 0.8 from seed 0."""
    model.eval()
    ids = generate(model, data.encode("ROMEO:"), tokens=160, temperature=0.8, top_k=0, seed=0)
    model.train()
    return data.decode(ids)


def eval_batch(data: Any) -> tuple[np.ndarray, np.ndarray]:
    """The validation windows every measurement of the lesson looks at: (ids, targets) (B, T)."""
    return text_batch(data.validation, seed=1, step=1, batch_size=EVAL_BATCH_SIZE,
                      context=CONFIG.context)


def block_forward(block, x, record):
    """Block.forward (minimp/models/gpt.py) sub-module by sub-module, keeping the intermediate
    Tensors in `record` under a name."""
    attn = block.attn
    batch, tokens, width = x.shape
    heads, head_width = attn.heads, width // attn.heads
    record["residual stream"] = x
    h = record["ln_1 output"] = block.ln_1(x)
    q, k, v = F.split(attn.c_attn(h), width, axis=2)
    q, k, v = (t.reshape(batch, tokens, heads, head_width).transpose(0, 2, 1, 3)
               for t in (q, k, v))  # (B, H, T, D) each
    scores = record["q.k"] = q @ k.transpose(0, 1, 3, 2)  # (B, H, T, T), not yet scaled
    softmax = record["softmax"] = F.scaled_masked_softmax(scores, 1 / math.sqrt(head_width))
    y = (softmax @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, width)  # (B, T, C)
    x = x + attn.c_proj(y)
    hidden = record["mlp hidden"] = block.mlp.c_fc(block.ln_2(x))  # (B, T, 4C)
    return x + block.mlp.c_proj(block.mlp.gelu(hidden))


def recorded_forward(model: GPT, ids: np.ndarray) -> tuple[Tensor, list[dict]]:
    """The logits, and one record of named Tensors per block."""
    x, records = model[0](ids), list[dict]()
    for block in model.layers[1:-1]:
        records.append({})
        x = block_forward(block, x, records[-1])
    return model[-1](x), records


def values(arrays: dict, name: str) -> np.ndarray:
    """The values of `name`, flat; attention's (B, H, T, T) arrays only where a query may attend."""
    array = arrays[name]
    return (array[..., CAUSAL] if array.ndim == 4 else array).ravel()


def float16_shares(array: np.ndarray) -> tuple[float, float, float]:
    """Where float16 puts the non-zero values: the shares that become zero, subnormal, inf."""
    stored = np.abs(array[array != 0]).astype(F16)
    return (float(np.mean(stored == 0)), float(np.mean((stored > 0) & (stored < 2**-14))),
            float(np.mean(np.isinf(stored))))


def in_float16(array: np.ndarray, log2: bool = False) -> str:
    """float16_shares as a line, after the largest magnitude (as a power of two with `log2`), to
    digits that other BLAS kernels (other orders of the float32 sums) print alike."""
    zero, subnormal, inf = float16_shares(array)
    largest = np.abs(array).max()
    shown = f"2^{np.log2(largest):.1f}" if log2 else f"{largest:.2g}"
    return f"largest {shown:>7}  zero {zero:4.0%}  subnormal {subnormal:4.0%}  inf {inf:2.0%}"


def unfused_softmax(scores, scale, keep, shift):
    """Attention's softmax as separate operations in the scores' own dtype."""
    dtype = scores.dtype.type
    logits = np.where(keep, scores * dtype(scale), dtype(-np.inf))
    if shift:
        logits = logits - logits.max(axis=-1, keepdims=True)
    exps = np.exp(logits)
    return exps / exps.sum(axis=-1, keepdims=True)


def row_ulps(probabilities: np.ndarray, exact: np.ndarray) -> np.ndarray:
    """Each row's largest |error|, in units of float16's gap at the exact value (NaN rows: NaN)."""
    gaps = np.spacing(np.abs(exact).astype(F16)).astype(np.float64)
    return np.max(np.abs(probabilities.astype(np.float64) - exact) / gaps, axis=-1)


def layer_norm_float16(x):
    """LayerNorm (without weight and bias) with every sum and square rounded to float16: running
    sums, as np.cumsum adds (lesson 1). Returns the output and the per-row variance."""
    width = np.float16(x.shape[-1])
    mean = np.cumsum(x, axis=-1, dtype=np.float16)[..., -1:] / width
    centered = x - mean
    variance = np.cumsum(centered * centered, axis=-1, dtype=np.float16)[..., -1:] / width
    return centered / np.sqrt(variance + np.float16(1e-5)), variance


def exact_layer_norm(x: np.ndarray) -> np.ndarray:
    """LayerNorm without weight and bias, in float64 from the given x (widening is exact)."""
    x = x.astype(np.float64)
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5)


LAYER_NORM_SCALES = (0, 2, 4, 5)  # block 2's residual stream times 2^k, for these k


# ----- the fused softmax ------------------------------------------------------------------------
def exact_softmax(scores: np.ndarray, scale: float, mask: Any = None) -> np.ndarray:
    """softmax(scale * scores) with the causal mask (and `mask`), in float64 from the given
    scores (widening is exact), fully masked rows 0: what every other result is compared with."""
    keep = np.tril(np.ones(scores.shape[-2:], bool))  # query i sees keys 0 to i
    keep = keep & np.asarray(True if mask is None else mask, bool)
    logits = np.where(keep, scores.astype(np.float64) * scale, -np.inf)
    row_max = logits.max(axis=-1, keepdims=True)
    exps = np.exp(logits - np.where(row_max == -np.inf, 0.0, row_max))
    total = exps.sum(axis=-1, keepdims=True)
    return exps / np.where(total == 0, 1.0, total)


def ulps_off(got: np.ndarray, exact: np.ndarray) -> float:
    """The largest |got - exact|, in units of float16's gap at each exact value (inf for NaN)."""
    got64 = np.asarray(got).astype(np.float64)
    if not np.isfinite(got64).all():
        return float("inf")
    with np.errstate(over="ignore"):
        gaps = np.spacing(np.abs(exact).astype(F16)).astype(np.float64)
    return float(np.max(np.abs(got64 - exact) / gaps))


def _near_the_top(rng: np.random.Generator, shape: tuple) -> np.ndarray:
    """float16 scores within a few hundred of +-65504, on float16's grid (gap 32 up there)."""
    magnitudes = 65504 - 32 * rng.integers(0, 12, shape)
    return (np.where(rng.random(shape) < 0.8, 1, -1) * magnitudes).astype(F16)  # 80% positive


def check_scaled_masked_softmax(scaled_masked_softmax: Callable, quiet: bool = False) -> Report:
    """scaled_masked_softmax(scores, scale, mask=None): softmax(scale * scores) over the last axis,
    each query seeing itself and earlier keys (and only keys where `mask` is True), computed in
    float32 (float64 for float64 scores), returned in the scores' dtype; fully masked rows give
    zeros."""
    report = Report("scaled_masked_softmax", quiet)
    rng = np.random.default_rng(10)

    def compare16(scores, scale, mask=None):
        got = call(scaled_masked_softmax, scores.copy(), scale, mask)
        expect(got.dtype == scores.dtype and got.shape == scores.shape, f"returned {got.dtype} "
               f"{got.shape} for {scores.dtype} scores of shape {scores.shape}")
        off = ulps_off(got, exact_softmax(scores, scale, mask))
        expect(off <= 1, f"up to {off:.3g} float16 ulps from the exact softmax of these scores "
               "(rounding once from float32 stays within 1)")

    @report.case(
        "float32 scores: softmax(scale x scores), each query seeing itself and earlier keys",
        hint="keep = np.tri(T, dtype=bool): True on and below the diagonal; masked logits are "
        "-inf; subtract each row's maximum, exp, divide by the row's sum",
    )
    def _():
        scores = rng.standard_normal((2, 3, 6, 6)).astype(np.float32) * 3
        got = call(scaled_masked_softmax, scores.copy(), 0.5)
        expect(got.dtype == np.float32, f"float32 scores gave {got.dtype}")
        want = exact_softmax(scores, 0.5)
        expect(np.all(got[..., ~np.tri(6, dtype=bool)] == 0), "a key after its query got weight")
        worst = float(np.max(np.abs(got - want) - RTOL * np.abs(want)))
        expect(worst <= ATOL, f"differs from the softmax by up to {np.max(np.abs(got - want)):.3g}")

    @report.case(
        "float16 scores, scale 1/sqrt(48): float16 out, within 1 ulp of the exact result",
        hint="widen first (scores.astype(np.float32) * scale): scaling in float16 rounds the "
        "logits a second time; round to float16 once, at the very end",
    )
    def _():
        compare16((rng.standard_normal((2, 4, 8, 8)) * 8).astype(F16), 1 / np.sqrt(48))

    @report.case(
        "float16 scores near 65504, scale 1/8 (logits near 8188): no inf, no NaN, within 1 ulp",
        hint="exp overflows float16 past 11.09 and float32 past 88.7: subtract each row's "
        "maximum before exp, so every exp is at most 1; take that maximum after masking (over "
        "the keys the query sees), or a later key's large score zeroes every kept exp",
    )
    def _():
        compare16(_near_the_top(rng, (3, 2, 7, 7)), 1 / 8)

    @report.case(
        "a padding mask that hides every key from the first queries: those rows are zeros",
        hint="a row of -inf has maximum -inf and -inf - (-inf) is NaN: shift such a row by 0 "
        "instead, and divide its zero sum by 1 (a finite stand-in for -inf, like -1e9, gives "
        "such a row equal weights, not zeros); `mask` hides keys, the last axis, as it "
        "broadcasts",
    )
    def _():
        scores = (rng.standard_normal((2, 2, 6, 6)) * 4).astype(F16)
        padding = np.arange(6) >= 3  # keys 0-2 are padding: queries 0-2 see nothing
        got = call(scaled_masked_softmax, scores.copy(), 0.25, padding)
        expect(np.all(np.asarray(got)[..., :3, :] == 0), "a fully masked row is not all zeros")
        compare16(scores, 0.25, padding)

    return report.finish()


# ----- its backward -----------------------------------------------------------------------------
def _softmax(scores: np.ndarray, scale: float, mask: Any = None) -> np.ndarray:
    """minimp's fused op, forward only."""
    return F.scaled_masked_softmax(Tensor(scores), scale, mask=mask).data


def check_softmax_backward(softmax_backward: Callable, quiet: bool = False) -> Report:
    """softmax_backward(y, grad_output, scale): dL/dscores of y = scaled_masked_softmax(scores,
    scale) from y alone (what backward keeps), computed in float32 for 16-bit inputs (float64
    for float64), returned in y's dtype."""
    report = Report("softmax_backward", quiet)
    rng = np.random.default_rng(11)

    @report.case(
        "float64: matches central differences of the forward (scale 0.3, a fully masked row)",
        hint="dL/ds = scale * y * (dL/dy - sum(dL/dy * y)), the sum over the keys (the last "
        "axis, keepdims=True)",
    )
    def _():
        scores, mask = rng.standard_normal((2, 2, 5, 5)) * 2, np.arange(5) >= 1
        weights = rng.standard_normal(scores.shape)
        got = call(softmax_backward, _softmax(scores, 0.3, mask), weights.copy(), 0.3)
        expect(got.shape == scores.shape, f"returned shape {got.shape}, expected {scores.shape}")
        want = numerical_gradient(
            lambda arrays: float((_softmax(arrays[0], 0.3, mask) * weights).sum()), [scores], 0)
        worst = float(np.max(np.abs(got - want) - RTOL * np.abs(want)))
        expect(worst <= ATOL, "differs from central differences by up to "
               f"{np.max(np.abs(got - want)):.3g}")

    def compare16(y, grad_output, scale):
        got = call(softmax_backward, y.copy(), grad_output.copy(), scale)
        expect(got.dtype == F16, f"float16 inputs gave {got.dtype}")
        y64, g64 = y.astype(np.float64), grad_output.astype(np.float64)
        exact = scale * y64 * (g64 - (g64 * y64).sum(axis=-1, keepdims=True))
        off = ulps_off(got, exact)
        expect(off <= 1, f"up to {off:.3g} float16 ulps from the exact gradient of these inputs")

    @report.case(
        "float16 in, float16 out, within 1 ulp of the exact gradient of the same inputs",
        hint="widen y and dL/dy to float32, compute, round to float16 once",
    )
    def _():
        y = _softmax((rng.standard_normal((2, 4, 8, 8)) * 3).astype(F16), 0.25)
        compare16(y, rng.standard_normal(y.shape).astype(F16), 0.25)

    @report.case(
        "nearly one-hot rows (scores near 65504): the small difference, in float32",
        hint="where y is almost 1, dL/dy - sum(dL/dy * y) is a small difference of two large "
        "numbers: in float16 the sum's rounding error is as large as the difference itself",
    )
    def _():
        y = _softmax(_near_the_top(rng, (2, 2, 8, 8)), 1 / 8)
        compare16(y, (rng.standard_normal(y.shape) * 100).astype(F16), 1 / 8)

    return report.finish()


# ----- the bytes a block keeps --------------------------------------------------------------------
def measured_block_bytes(s: int, b: int, h: int, a: int, dtype: Any, dropout: bool) -> int:
    """What one minimp GPT Block keeps for backward (parameters excluded), measured."""
    config = GPTConfig(vocab_size=5, context=s, layers=1, heads=a, width=h,
                       dropout=0.1 if dropout else 0.0)
    model = GPT(config, np.random.default_rng(0))
    model.to(dtype)
    model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    x = Tensor(np.random.default_rng(1).standard_normal((b, s, h)).astype(dtype),
               requires_grad=True)
    return saved_bytes(model[1](x), exclude=[p.data for p in model.parameters()])


SHAPES = ((8, 2, 16, 2), (16, 3, 32, 4), (5, 1, 12, 3))  # (s, b, h, a)


def check_block_bytes(block_bytes: Callable, quiet: bool = False) -> Report:
    """block_bytes(s, b, h, a, itemsize, dropout): bytes one GPT block keeps for backward, for
    context s, batch b, width h, a heads, activations of `itemsize` bytes (LayerNorm's statistics
    in float32, in float64 for 8-byte activations), dropout True or False; measured."""
    report = Report("block_bytes", quiet)

    def compare(dtypes, dropout):
        for dtype in dtypes:
            for s, b, h, a in SHAPES:
                itemsize = np.dtype(dtype).itemsize
                got = call(block_bytes, s, b, h, a, itemsize, dropout)
                want = measured_block_bytes(s, b, h, a, dtype, dropout)
                expect(got == want, f"{np.dtype(dtype).name}, s={s} b={b} h={h} a={a}, dropout "
                       f"{dropout}: you say {got}, the block keeps {want} bytes")

    @report.case(
        "float32, no dropout, three shapes",
        hint="per block: ln_1 and ln_2 keep their inputs (and a float32 mean and 1/std per "
        "row); every Linear its input; q @ k^T its q and k; the softmax its output; the product "
        "with v its v (the softmax output is already counted); GELU its input (4h wide)",
    )
    def _():
        compare([np.float32], False)

    @report.case("float16 and bfloat16, no dropout",
                 hint="the activations take 2 bytes; LayerNorm's statistics stay float32 (4 bytes)")
    def _():
        compare([F16, ml_dtypes.bfloat16], False)

    @report.case(
        "with dropout, float32 and float16",
        hint="each dropout keeps its mask, 1 byte per element (attention's s x s per head, the "
        "two residual ones s x h); the product with v now keeps the dropped-out attention, a "
        "second s x s per head, while the softmax keeps its own output",
    )
    def _():
        compare([np.float32, F16], True)

    @report.case("float64 (as in a gradient check)", hint="in float64 LayerNorm's statistics are "
                 "float64 too: they are never narrower than the activations")
    def _():
        compare([np.float64], True)
        compare([np.float64], False)

    return report.finish()


# ----- dropout's keep mask ------------------------------------------------------------------------
def check_keep_mask(keep_mask: Callable, quiet: bool = False) -> Report:
    """keep_mask(shape, p, seed, step, layer, sample_indices): a bool array of `shape` (batch axis
    first), True where dropout keeps an element; row r holds global sample sample_indices[r], and
    its mask depends on (seed, step, layer, that sample, the position) only."""
    report = Report("keep_mask", quiet)

    def mask(shape, p, seed, step, layer, samples):
        got = np.asarray(call(keep_mask, shape, p, seed, step, layer, np.asarray(samples)))
        expect(got.dtype == bool and got.shape == tuple(shape),
               f"returned {got.dtype} of shape {got.shape}, expected bool {tuple(shape)}")
        return got

    @report.case(
        "a bool array of the shape; a share of about 1 - p kept (p = 0, 0.1, 0.5)",
        hint="keep = uniform bits >= p * 2^64 (or a uniform number in [0, 1) >= p)",
    )
    def _():
        expect(mask((4, 8), 0.0, 1, 1, 0, np.arange(4)).all(), "p = 0 dropped an element")
        for p in (0.1, 0.5):
            kept = mask((64, 32, 32), p, 1, 1, 0, np.arange(64)).mean()
            expect(abs(kept - (1 - p)) < 0.01, f"p = {p} kept {kept:.3f} of the elements")

    @report.case(
        "the same mask for a sample wherever it is: a shard, a micro-batch, another order",
        hint="draw nothing in sequence: hash a counter made of (sample index, position within "
        "the sample) with a key made of (seed, step, layer)",
    )
    def _():
        shape, samples = (3, 4, 5), np.arange(10, 18)
        whole = mask((8,) + shape, 0.5, 7, 3, 2, samples)
        for rows in ([5, 6, 7], [7, 0, 3], [4]):
            part = mask((len(rows),) + shape, 0.5, 7, 3, 2, samples[rows])
            expect(np.array_equal(part, whole[rows]), f"samples {[int(n) for n in samples[rows]]} "
                   "alone differ from the same samples in the batch")

    @report.case(
        "every (seed, step, layer) draws its own masks, (seed 1, step 2) not (seed 2, step 1)",
        hint="mix each key word in turn (key = mix(key + word + g)), so no two keys collide "
        "by a sum",
    )
    def _():
        reference = mask((16, 256), 0.5, 1, 2, 3, np.arange(16))  # 4,096 bits: sd 0.8%
        for seed, step, layer in ((2, 1, 3), (1, 3, 2), (1, 2, 4), (4, 2, 3), (0, 0, 6)):
            same = (mask((16, 256), 0.5, seed, step, layer, np.arange(16)) == reference).mean()
            expect(abs(same - 0.5) < 0.05, f"seed {seed}, step {step}, layer {layer} agrees "
                   f"with seed 1, step 2, layer 3 on {same:.0%} of the elements (expected ~50%)")

    @report.case(
        "no pattern: neighbouring positions, samples and layers are uncorrelated",
        hint="a multiply-xorshift finalizer (SplitMix64's) spreads each counter's bits over "
        "all 64; a plain sum or product of indices does not",
    )
    def _():
        drawn, neighbour = (mask((64, 32, 64), 0.5, 5, 6, layer, np.arange(64)).astype(float)
                            for layer in (7, 8))
        pairs = {"positions i and i + 1": (drawn[..., :-1], drawn[..., 1:]),
                 "rows j and j + 1 of a sample": (drawn[:, :-1], drawn[:, 1:]),
                 "samples n and n + 1": (drawn[:-1], drawn[1:]),
                 "layers 7 and 8": (drawn, neighbour)}
        for name, (first, second) in pairs.items():
            correlation = np.corrcoef(first.ravel(), second.ravel())[0, 1]
            expect(abs(correlation) < 0.05, f"{name}: correlation {correlation:.2f}")

    return report.finish()


EXERCISES = [
    ("scaled_masked_softmax", check_scaled_masked_softmax),
    ("softmax_backward", check_softmax_backward),
    ("block_bytes", check_block_bytes),
    ("keep_mask", check_keep_mask),
]
