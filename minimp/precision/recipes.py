"""One interface for quantized matmuls: for each GEMM of a Linear, how each operand is split into
scaling groups, how a group's scale is chosen, what format its values take, how the product sums.

A Linear y = x W^T runs three GEMMs C (M, N) = A (M, K) B (K, N), each with its own K:

    forward      y  = x    W^T   K = in features   A = x    (tokens, in)   B^T = W   (out, in)
    grad_input   dx = dy   W     K = out features  A = dy   (tokens, out)  B^T = W^T (in, out)
    grad_weight  dW = dy^T x     K = tokens        A = dy^T (out, tokens)  B^T = x^T (in, tokens)

An `Operand` describes A or B^T as the GEMM reads it, K last, so a group shape is always (rows,
values along K): "rowwise" (1, K) is one scale per token row of x and per output row of W in the
forward GEMM; "1x128" on x^T in the weight-gradient GEMM is DeepSeek-V3's 128x1 tile of x (128
tokens of one channel). Each operand is quantized along its own GEMM's K, so a tensor read by two
GEMMs along different axes (x by forward and grad_weight) is quantized twice, as Transformer
Engine's rowwise and columnwise copies are.

The recipes (`--fp8-recipe`):

    delayed, current, none  one scale per tensor (precision/fp8_scaling.py, with its state):
                            E4M3 x and W, E5M2 dy, fp32 sums (Transformer Engine's HYBRID)
    rowwise                 a current scale per row along K: E4M3 x and W, E5M2 dy, fp32 sums.
                            torchao's rowwise recipe casts dy to E4M3 too (with power-of-two
                            scales); E5M2 here keeps the per-tensor recipes' HYBRID formats, so the
                            comparison with them changes the groups alone
    blockwise               DeepSeek-V3 (report section 3.3): E4M3 everywhere, 1 x 128 tiles for
                            x and dy, 128 x 128 blocks for W, current scales; each 128-wide K
                            block summed in the 14-bit accumulator and promoted to fp32
                            (accumulate.blockwise_matmul, accumulate="limited")
    mxfp8                   OCP MX v1.0: E4M3 everywhere, an E8M0 scale per 32 values along K
                            (the floor rule of section 6.3); fp32 sums
    mxfp8-round-up          the same with NVIDIA's round-up scale, 2^ceil(log2(amax / 448))

Every block-scaled product is `scaled_gemm`: per K block of `block` values (K itself when the
groups span K), the fp32 product of the values, times the two groups' scales multiplied in
float32, then the blocks' results added in fp32, then times alpha = fl32(A's tensor scale *
B's tensor scale) once (1 for every rule but nvfp4, an exact no-op). A power-of-two scale (MX)
makes each block's scaling exact.

`--precision nvfp4` (not an --fp8-recipe: its values are 4-bit) is `NVFP4`, NVIDIA's recipe
("Pretraining Large Language Models with NVFP4", 2025; Transformer Engine's NVFP4BlockScaling):
E2M1 values everywhere, 1 x 16 groups along K for x and dy, 16 x 16 blocks for W, each group's
scale in E4M3 times a float32 scale per tensor (blocks.py's "nvfp4" rule), fp32 sums. The
hardware (Blackwell's block-scaled MMA) applies the two E4M3 scales inside the product and the
two tensor scales' product once to the fp32 result, as the GEMM's epilogue alpha: `scaled_gemm`
does the same. dy's E2M1 cast rounds stochastically in both backward GEMMs
(Operand.stochastic), everything else to nearest. The weight-gradient GEMM reads both operands
through the same 16 x 16 random Hadamard transform along its K, the tokens (Gemm.hadamard;
precision/hadamard.py), the forward and grad_input GEMMs none. W's 16 x 16 blocks are square, so
W^T in 16 x 16 blocks is W's quantization transposed, scales and values bit for bit: forward
and grad_input read the same quantized weight, and BlockScaledLinear quantizes it once.
"""

from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import numpy as np

from minimp.precision import blocks, codes
from minimp.precision.accumulate import Accumulate, blockwise_matmul
from minimp.precision.blocks import BlockQuantized, GroupShape
from minimp.precision.hadamard import random_hadamard_matrix
from minimp.precision.stochastic import draw_random_bits

FLOAT32 = np.dtype(np.float32)
GEMMS = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Operand:
    """How one operand of one GEMM is quantized, read as (rows, K): its element format's name
    (blocks.ELEMENT_FORMATS), its group shape (a name of blocks.GROUP_SHAPES or (rows, cols)) and
    the rule that chooses each group's scale (blocks.RULES; "delayed" and "none" for the
    per-tensor recipes, whose scales fp8_scaling.Fp8Quantizer keeps); stochastic: its values
    round stochastically (NVFP4's gradients), with random bits BlockScaledMeta draws."""

    fmt: str
    group: GroupShape | str
    rule: str
    stochastic: bool = False


@dataclass(frozen=True)
class Gemm:
    """One GEMM's two operands, A (M, K) and B^T (N, K), and how its products are summed;
    hadamard: both operands are first multiplied by the same random 16 x 16 Hadamard matrix in
    blocks of 16 along K (NVFP4's weight-gradient GEMM, K the tokens)."""

    a: Operand
    b: Operand
    accumulate: Accumulate = "fp32"
    hadamard: bool = False


@dataclass(frozen=True)
class LinearGemms:
    """The three GEMMs of a Linear, each with its own operands (see the module docstring)."""

    forward: Gemm
    grad_input: Gemm
    grad_weight: Gemm


class Recipe(Protocol):
    """What every fp8 recipe says: its --fp8-recipe name, whether its scales carry from step to
    step (then checkpointed and agreed across ranks), and its three GEMMs."""

    @property
    def name(self) -> str: ...

    @property
    def has_state(self) -> bool: ...

    @property
    def gemms(self) -> LinearGemms: ...


def per_tensor_gemms(rule: str) -> LinearGemms:
    """One scale per tensor chosen by rule: E4M3 x and W, E5M2 dy, fp32 sums."""
    x, w, dy = (Operand(fmt, "tensor", rule) for fmt in ("E4M3", "E4M3", "E5M2"))
    return LinearGemms(Gemm(x, w), Gemm(dy, w), Gemm(dy, x))


def _along_k(group: str, weight_group: str, rule: str, dy_fmt: str,
             accumulate: Accumulate) -> LinearGemms:
    """E4M3 x and W, dy in dy_fmt; x and dy in `group` along every GEMM's K, W in weight_group."""
    x, w = Operand("E4M3", group, rule), Operand("E4M3", weight_group, rule)
    dy = Operand(dy_fmt, group, rule)
    return LinearGemms(Gemm(x, w, accumulate), Gemm(dy, w, accumulate), Gemm(dy, x, accumulate))


@dataclass(frozen=True)
class BlockScaling:
    """A recipe whose scales are chosen afresh for each group of each quantization: no state."""

    name: str
    gemms: LinearGemms
    has_state: bool = field(default=False, init=False)


RECIPES = {
    "rowwise": BlockScaling("rowwise", _along_k("rowwise", "rowwise", "current", "E5M2", "fp32")),
    "blockwise": BlockScaling("blockwise",
                              _along_k("1x128", "128x128", "current", "E4M3", "limited")),
    "mxfp8": BlockScaling("mxfp8", _along_k("1x32", "1x32", "mx_floor", "E4M3", "fp32")),
    "mxfp8-round-up": BlockScaling("mxfp8-round-up",
                                   _along_k("1x32", "1x32", "mx_round_up", "E4M3", "fp32")),
}


def nvfp4_gemms() -> LinearGemms:
    """NVFP4 (module docstring): E2M1 x and dy in 1 x 16 groups, W in 16 x 16 blocks, the nvfp4
    rule; dy rounded stochastically; the Hadamard transform on grad_weight's two operands."""
    x, w = Operand("E2M1", "1x16", "nvfp4"), Operand("E2M1", "16x16", "nvfp4")
    dy = Operand("E2M1", "1x16", "nvfp4", stochastic=True)
    return LinearGemms(Gemm(x, w), Gemm(dy, w), Gemm(dy, x, hadamard=True))


NVFP4 = BlockScaling("nvfp4", nvfp4_gemms())


def quantize(array: np.ndarray, operand: Operand,
             random_bits: np.ndarray | None = None) -> BlockQuantized:
    """array (rows, K) in operand's format with a scale per group (blocks.quantize), rounded
    stochastically with random_bits (an operand marked stochastic), else to nearest."""
    if operand.stochastic != (random_bits is not None):
        raise ValueError(f"{operand}: random bits are for (and needed by) stochastic operands")
    return blocks.quantize(array, operand.fmt, operand.group, operand.rule, random_bits)


def weight_shared(gemms: LinearGemms) -> bool:
    """Whether forward and grad_input read W in the same square blocks (NVFP4's 16 x 16,
    blockwise's 128 x 128), so W^T's quantization is W's transposed: one cast serves both."""
    operand = gemms.forward.b
    rows, cols = blocks.GROUP_SHAPES.get(operand.group, operand.group)  # type: ignore[arg-type]
    return operand == gemms.grad_input.b and rows == cols and rows is not None


def transposed(q: BlockQuantized) -> BlockQuantized:
    """q's array transposed, in groups transposed: what quantizing the transpose gives when the
    rule's scales depend only on each group's and the tensor's amax (every rule's)."""
    rows, cols = q.group_shape
    return BlockQuantized(q.data.T, q.scale_inv.T, q.tensor_scale_inv, (cols, rows), q.fmt,
                          q.rule)


def k_block(a: BlockQuantized, bt: BlockQuantized) -> int:
    """The values along K that share a scale in both operands; a ValueError unless they agree."""
    if a.data.shape[1] != bt.data.shape[1] or a.group_shape[1] != bt.group_shape[1]:
        raise ValueError(f"A {a.data.shape} in groups {a.group_shape} and B^T {bt.data.shape} in "
                         f"groups {bt.group_shape}: a GEMM needs the same K and K blocks")
    return a.group_shape[1]


def scaled_gemm(a: BlockQuantized, bt: BlockQuantized, accumulate: Accumulate) -> np.ndarray:
    """A @ B (M, N) in float32 from A (M, K) and B^T (N, K), each quantized along K: for each K
    block, the product of the values times fl32(scale of A's group * scale of B's group), the
    blocks summed in fp32 (accumulate.blockwise_matmul, which sums each block's products in fp32
    or in the 14-bit accumulator), then the sum times alpha = fl32(A's tensor scale * B's), once
    (NVFP4's; 1 for the other rules, which leaves every bit as it is)."""
    block = k_block(a, bt)
    a_scales = np.repeat(codes.to_float32(a.scale_inv), a.group_shape[0], axis=0)  # (M, K/block)
    b_scales = np.repeat(codes.to_float32(bt.scale_inv), bt.group_shape[0], axis=0)  # (N, K/block)
    product = blockwise_matmul(codes.to_float32(a.data), a_scales, codes.to_float32(bt.data).T,
                               b_scales.T, block, accumulate)
    alpha = np.float32(a.tensor_scale_inv) * np.float32(bt.tensor_scale_inv)
    return product * alpha  # the epilogue's alpha: float32 times float32


# The bytes of one group's scale under each rule: float32 (current), E8M0 (mx), E4M3 (nvfp4).
SCALE_BYTES = {"current": 4, "mx_floor": 1, "mx_round_up": 1, "nvfp4": 1}
TENSOR_SCALE_BYTES = {"nvfp4": 4}  # the float32 scale per tensor, saved beside its groups'


def saved_scale_bytes(recipe: BlockScaling, features_in: int, features_out: int,
                      tokens: int) -> int:
    """The scales a BlockScaledLinear keeps for backward beside its fp8 values (1 byte each, as
    Fp8Linear's x and W): W^T's (in, out) for grad_input and x^T's (in, tokens) for grad_weight,
    one per group, and NVFP4's float32 tensor scale of each. What a block-scaled recipe adds
    to the activations of a per-tensor one."""
    total = 0
    for operand, shape in ((recipe.gemms.grad_input.b, (features_in, features_out)),
                           (recipe.gemms.grad_weight.b, (features_in, tokens))):
        rows, cols = blocks.resolve_group_shape(shape, operand.group)
        total += shape[0] // rows * (shape[1] // cols) * SCALE_BYTES[operand.rule]
        total += TENSOR_SCALE_BYTES.get(operand.rule, 0)
    return total


def saved_value_bytes(features_in: int, features_out: int, tokens: int,
                      values_per_byte: int = 1) -> int:
    """The values a BlockScaledLinear keeps for backward, W^T (in, out) and x^T (in, tokens):
    1 byte each in this emulation (NumPy holds an ml_dtypes float4_e2m1fn or fp8 value in a
    byte); values_per_byte=2 counts what NVFP4 hardware holds, two E2M1 values a byte."""
    return features_in * (features_out + tokens) // values_per_byte


# What a saved BlockQuantized needs besides its two arrays: (group_shape, fmt, rule), or None.
Layout = tuple[tuple[int, int], blocks.ElementFormat, str] | None


def arrays_of(q: BlockQuantized | None) -> tuple[np.ndarray, ...]:
    """(values, scales) to save for backward (through save_for_backward's hooks), and NVFP4's
    tensor scale as a (1,) float32 array; () for None."""
    if q is None:
        return ()
    if q.rule in TENSOR_SCALE_BYTES:
        return q.data, q.scale_inv, np.array([q.tensor_scale_inv], FLOAT32)
    return q.data, q.scale_inv


def layout_of(q: BlockQuantized | None) -> Layout:
    """What rebuilt() needs besides the arrays."""
    return None if q is None else (q.group_shape, q.fmt, q.rule)


def rebuilt(layout: Layout, saved: list[np.ndarray]) -> BlockQuantized | None:
    """The BlockQuantized whose arrays_of() lead `saved` (taken from it); None for None."""
    if layout is None:
        return None
    group_shape, fmt, rule = layout
    data, scale_inv = saved.pop(0), saved.pop(0)
    tensor_scale_inv = saved.pop(0)[0] if rule in TENSOR_SCALE_BYTES else np.float32(1.0)
    return BlockQuantized(data, scale_inv, np.float32(tensor_scale_inv), group_shape, fmt, rule)


# Mixed into the seeds of NVFP4's draws, so that they never repeat another draw made from --seed
# with the same numbers (the weights, the batch order, dropout, stochastic.py's weight rounding).
GRADIENT_BITS_TAG, HADAMARD_TAG = 0x4E47, 0x4E48  # "NG", "NH"


class BlockScaledMeta:
    """A Linear's fp8 state under a BlockScaling recipe: the recipe, and for NVFP4 where its
    random numbers come from; every scale is chosen afresh, so no quantizers to save, agree on
    or watch (compare fp8_scaling.Fp8Meta).

    NVFP4's random numbers are functions of (seed, step, layer, backward call, GEMM): a Generator
    seeded from them draws the stochastic-rounding bits of dy, so data-parallel replicas draw the
    same bits and a resumed run draws what the uninterrupted run drew: nothing to checkpoint. The
    trainer says the step (begin_step); `call` counts this step's backwards of the Linear (its
    micro-batches). The Hadamard signs come from the seed alone: one sign vector for every layer
    and step (a choice; a new vector each step would put the step in its seed, as the bits do)."""

    per_tensor = False  # ops.BlockScaledLinear multiplies, not ops.Fp8Linear

    def __init__(self, recipe: BlockScaling, seed: int = 0, layer: int = 0):
        self.recipe, self.seed, self.layer = recipe, seed, layer
        self.step = self.calls = 0

    def begin_step(self, step: int) -> None:
        """The trainer's step, numbered from 1; this step's backward calls count from 0."""
        self.step, self.calls = step, 0

    def next_backward(self) -> int:
        """The number of this backward call in the step (0 for the first micro-batch's)."""
        self.calls += 1
        return self.calls - 1

    def random_bits(self, shape: tuple[int, ...], call: int, gemm: str) -> np.ndarray:
        """The uint32 bits below 2^16 that round dy in `gemm` (one of GEMMS) in backward `call`."""
        key = [self.seed, GRADIENT_BITS_TAG, self.step, self.layer, call, GEMMS.index(gemm)]
        return draw_random_bits(np.random.default_rng(key), shape)

    @cached_property
    def hadamard(self) -> np.ndarray:
        """The 16 x 16 random Hadamard matrix of the weight-gradient GEMM (hadamard.py), drawn
        once: it depends on the seed alone."""
        return random_hadamard_matrix(np.random.default_rng([self.seed, HADAMARD_TAG]))

    def quantizers(self) -> list:
        """None: nothing carries from one quantization to the next."""
        return []

    def __repr__(self) -> str:
        return f"BlockScaledMeta({self.recipe.name})"
