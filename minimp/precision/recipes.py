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
float32, then the blocks' results added in fp32. A power-of-two scale (MX) makes each block's
scaling exact. NVFP4 is not one of these recipes yet: its rule ("nvfp4" in blocks.py) carries a
second, per-tensor scale, which `scaled_gemm` refuses rather than drops; an NVFP4 recipe adds it
to the product (and stochastic rounding, and the Hadamard transform of grad_weight's operands).
"""

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from minimp.precision import blocks, codes
from minimp.precision.accumulate import Accumulate, blockwise_matmul
from minimp.precision.blocks import BlockQuantized, GroupShape

FLOAT32 = np.dtype(np.float32)
GEMMS = ("forward", "grad_input", "grad_weight")


@dataclass(frozen=True)
class Operand:
    """How one operand of one GEMM is quantized, read as (rows, K): its element format's name
    (blocks.ELEMENT_FORMATS), its group shape (a name of blocks.GROUP_SHAPES or (rows, cols)) and
    the rule that chooses each group's scale (blocks.RULES; "delayed" and "none" for the
    per-tensor recipes, whose scales fp8_scaling.Fp8Quantizer keeps)."""

    fmt: str
    group: GroupShape | str
    rule: str


@dataclass(frozen=True)
class Gemm:
    """One GEMM's two operands, A (M, K) and B^T (N, K), and how its products are summed."""

    a: Operand
    b: Operand
    accumulate: Accumulate = "fp32"


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


def quantize(array: np.ndarray, operand: Operand) -> BlockQuantized:
    """array (rows, K) in operand's format with a scale per group (blocks.quantize)."""
    return blocks.quantize(array, operand.fmt, operand.group, operand.rule)


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
    or in the 14-bit accumulator)."""
    if a.rule == "nvfp4" or bt.rule == "nvfp4":
        raise ValueError("scaled_gemm: NVFP4's per-tensor scale is not applied here yet")
    block = k_block(a, bt)
    a_scales = np.repeat(codes.to_float32(a.scale_inv), a.group_shape[0], axis=0)  # (M, K/block)
    b_scales = np.repeat(codes.to_float32(bt.scale_inv), bt.group_shape[0], axis=0)  # (N, K/block)
    return blockwise_matmul(codes.to_float32(a.data), a_scales, codes.to_float32(bt.data).T,
                            b_scales.T, block, accumulate)


# The bytes of one group's scale under each rule: float32 (current), E8M0 (mx), E4M3 (nvfp4).
SCALE_BYTES = {"current": 4, "mx_floor": 1, "mx_round_up": 1, "nvfp4": 1}


def saved_scale_bytes(recipe: BlockScaling, features_in: int, features_out: int,
                      tokens: int) -> int:
    """The scales a BlockScaledLinear keeps for backward beside its fp8 values (1 byte each, as
    Fp8Linear's x and W): W^T's (in, out) for grad_input and x^T's (in, tokens) for grad_weight,
    one per group. What a block-scaled recipe adds to the activations of a per-tensor one."""
    total = 0
    for operand, shape in ((recipe.gemms.grad_input.b, (features_in, features_out)),
                           (recipe.gemms.grad_weight.b, (features_in, tokens))):
        rows, cols = blocks.resolve_group_shape(shape, operand.group)
        total += shape[0] // rows * (shape[1] // cols) * SCALE_BYTES[operand.rule]
    return total


# What a saved BlockQuantized needs besides its two arrays: (group_shape, fmt, rule), or None.
Layout = tuple[tuple[int, int], blocks.ElementFormat, str] | None


def arrays_of(q: BlockQuantized | None) -> tuple[np.ndarray, ...]:
    """(values, scales) to save for backward (through save_for_backward's hooks); () for None."""
    return () if q is None else (q.data, q.scale_inv)


def layout_of(q: BlockQuantized | None) -> Layout:
    """What rebuilt() needs besides the arrays."""
    return None if q is None else (q.group_shape, q.fmt, q.rule)


def rebuilt(layout: Layout, saved: list[np.ndarray]) -> BlockQuantized | None:
    """The BlockQuantized whose arrays_of() lead `saved` (taken from it); None for None."""
    if layout is None:
        return None
    group_shape, fmt, rule = layout
    data, scale_inv = saved.pop(0), saved.pop(0)
    return BlockQuantized(data, scale_inv, np.float32(1.0), group_shape, fmt, rule)


class BlockScaledMeta:
    """A Linear's fp8 state under a BlockScaling recipe: the recipe alone, since every scale is
    chosen afresh; no quantizers to save, agree on or watch (compare fp8_scaling.Fp8Meta)."""

    per_tensor = False  # ops.BlockScaledLinear multiplies, not ops.Fp8Linear

    def __init__(self, recipe: BlockScaling):
        self.recipe = recipe

    def quantizers(self) -> list:
        """None: nothing carries from one quantization to the next."""
        return []

    def __repr__(self) -> str:
        return f"BlockScaledMeta({self.recipe.name})"
