"""A GPT (GPT-2's architecture, as in nanoGPT) built as an nn.Sequential of whole blocks.

    GPT = Sequential(Embeddings, Block x layers, Head)

so the pipeline code, which cuts a Sequential's layer list, cuts it at block boundaries. The
sub-modules carry nanoGPT's names, and so parameter names read "0.wte.weight",
"3.attn.c_attn.weight", "5.ln_f.bias". The forward takes integer token ids (B, T) and returns
logits (B, T, vocab_size).
"""

import math
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from minimp import backend, nn
from minimp import functional as F
from minimp.backend import Array
from minimp.models.moe import MoE
from minimp.tensor import Tensor


@dataclass
class GPTConfig:
    """The GPT's sizes (nanoGPT's names in parentheses): vocab_size, the distinct tokens; context,
    tokens per sample (block_size); layers, transformer blocks (n_layer); heads, attention heads
    per block (n_head); width, channels of the residual stream (n_embd), a multiple of heads;
    dropout, the probability of zeroing an activation; bias, biases in every Linear and
    LayerNorm; experts, top_k, capacity_factor, expert_hidden: the mixture of experts that
    replaces each block's MLP when experts > 0 (minimp/models/moe.py)."""

    vocab_size: int = 65  # tiny shakespeare's distinct characters (nanoGPT's shakespeare_char)
    context: int = 64  # tokens per sample, nanoGPT's block_size (64 in its CPU example)
    layers: int = 4  # transformer blocks (n_layer; nanoGPT's CPU example)
    heads: int = 4  # attention heads per block (n_head); width must divide by it
    width: int = 128  # channels of the residual stream (n_embd); the MLP is 4x wider
    dropout: float = 0.0  # probability of zeroing an activation; 0 needs no dropout state
    bias: bool = True  # biases in every Linear and LayerNorm, as GPT-2 has them
    experts: int = 0  # E: each block's MLP a mixture of E experts (models/moe.py); 0: dense MLP
    top_k: int = 2  # K: experts per token (Mixtral's 2; Switch's 1)
    capacity_factor: float = 0.0  # pairs per expert per sample = ceil(F T K / E); 0: dropless
    expert_hidden: int = 0  # each expert's width; 0: the dense MLP's 4 x width

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(
                f"GPTConfig: width {self.width} must be a multiple of heads {self.heads}")


class Attention(Protocol):
    """What a CausalSelfAttention may hand its heads to instead of computing causal attention
    itself: q, k, v (B, H, T, D) -> y (B, H, T, D) (context parallelism's ring attention)."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Causal attention of q over k and v."""


class Embeddings(nn.Module):
    """Layer 0: token + position embeddings, then dropout: ids (B, T) -> x (B, T, C).

    positions: None, or the sequence positions of the T tokens a forward gets (a context-parallel
    rank's shard of every sample: minimp/parallel/context/models.py); None means 0..T-1.
    """

    positions: npt.NDArray[np.int64] | None = None

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        super().__init__()
        self.context = config.context
        self.wte = nn.Embedding(config.vocab_size, config.width, rng=rng)
        self.wpe = nn.Embedding(config.context, config.width, rng=rng)
        self.drop = nn.Dropout(config.dropout, layer=0)

    def forward(self, ids: Tensor | Array) -> Tensor:
        batch, tokens = ids.shape
        if tokens > self.context:
            raise ValueError(f"GPT: {tokens} tokens per sample, the context is {self.context}")
        positions = np.arange(tokens) if self.positions is None else self.positions
        if len(positions) != tokens:
            raise ValueError(f"GPT: {tokens} tokens per sample, but the embeddings were given "
                             f"{len(positions)} positions")
        token = self.wte(ids)  # (B, T, C)
        position = self.wpe(positions)  # (T, C), broadcast over the batch
        return self.drop(token + position)  # (B, T, C)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier positions.

    attend: None, or the Attention its heads' q, k, v go to instead of the scores, softmax,
    dropout and product below (set by minimp/parallel/context/models.py; the Linears stay here).
    """

    attend: Attention | None = None

    def __init__(self, config: GPTConfig, index: int, rng: np.random.Generator):
        super().__init__()
        self.heads, self.width = config.heads, config.width
        # one (3C, C) projection, split into q, k, v: one matrix product instead of three
        self.c_attn = nn.Linear(config.width, 3 * config.width, config.bias, rng=rng)
        self.c_proj = nn.Linear(config.width, config.width, config.bias, rng=rng)
        self.attn_dropout = nn.Dropout(config.dropout, layer=3 * index + 1)
        self.resid_dropout = nn.Dropout(config.dropout, layer=3 * index + 2)

    def forward(self, x: Tensor) -> Tensor:
        qkv = self.c_attn(x)  # (B, T, 3C); a tensor-parallel rank gets its heads' 3C/tp
        batch, tokens, width = qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3
        head_width = self.width // self.heads
        heads = width // head_width  # the heads this module computes
        # q, k and v: each (B, T, C), views of qkv, then split into heads: (B, H, T, D)
        q, k, v = (part.reshape(batch, tokens, heads, head_width).transpose(0, 2, 1, 3)
                   for part in F.split(qkv, width, axis=2))
        if self.attend is not None:
            y = self.attend(q, k, v)  # (B, H, T, D)
        else:
            scores = q @ k.transpose(0, 1, 3, 2)  # (B, H, T, T): float32 sums, rounded once
            # 1/sqrt(D) applied in float32 inside the softmax (see minimp/ops/softmax.py for why)
            attention = F.scaled_masked_softmax(scores, 1.0 / math.sqrt(head_width))  # (B,H,T,T)
            y = self.attn_dropout(attention) @ v  # (B, H, T, D)
        y = y.transpose(0, 2, 1, 3).reshape(batch, tokens, width)  # (B, T, C), heads side by side
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    """Position-wise feed-forward: C -> 4C, GELU, 4C -> C, dropout."""

    def __init__(self, config: GPTConfig, index: int, rng: np.random.Generator):
        super().__init__()
        self.c_fc = nn.Linear(config.width, 4 * config.width, config.bias, rng=rng)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * config.width, config.width, config.bias, rng=rng)
        self.dropout = nn.Dropout(config.dropout, layer=3 * index + 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))  # (B, T, 4C) inside, (B, T, C)


class Block(nn.Module):
    """One transformer block, pre-LayerNorm: x + attn(ln_1(x)), then x + mlp(ln_2(x)).

    config: the GPT's sizes; index: the block's position (0 first), which numbers its dropout
    layers and so their masks; rng: the NumPy Generator its weights are drawn from.
    """

    def __init__(self, config: GPTConfig, index: int, rng: np.random.Generator):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.width, bias=config.bias)
        self.attn = CausalSelfAttention(config, index, rng)
        self.ln_2 = nn.LayerNorm(config.width, bias=config.bias)
        # with experts, the mixture replaces the dense MLP under its name ("1.mlp.router.weight")
        self.mlp = MoE(config.width, config.experts, config.top_k, config.capacity_factor,
                       config.expert_hidden or 4 * config.width, config.bias,
                       nn.Dropout(config.dropout, layer=3 * index + 3), rng, block=index
                       ) if config.experts else MLP(config, index, rng)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        return x + self.mlp(self.ln_2(x))  # (B, T, C)


class Head(nn.Module):
    """Last layer: the final LayerNorm, then logits = x @ wte^T with the token embedding's weight.

    The weight is tied (GPT-2, Press & Wolf 2017): the head reads the very Parameter of
    Embeddings.wte. It holds that Embedding as a plain attribute, set with object.__setattr__ so
    Module does not register it here a second time: named_parameters() lists the weight once, as
    "0.wte.weight", and backward adds the head's gradient to the embedding's in the one `.grad`.
    A pipeline that puts layer 0 and this layer on different ranks must keep two copies and sum
    their gradients (Megatron-LM does); within one process they are one array.
    """

    wte: nn.Embedding  # layer 0's token embedding, read but not owned

    def __init__(self, config: GPTConfig, wte: nn.Embedding):
        super().__init__()
        self.ln_f = nn.LayerNorm(config.width, bias=config.bias)
        object.__setattr__(self, "wte", wte)  # tied, not registered: see the docstring

    def forward(self, x: Tensor) -> Tensor:
        batch, tokens, width = x.shape
        rows = self.ln_f(x).reshape(batch * tokens, width)  # (B*T, C)
        logits = rows @ self.wte.weight.T  # (B*T, V): one product, a (V, C) weight gradient
        return logits.reshape(batch, tokens, logits.shape[-1])  # (B, T, V)

    def __repr__(self) -> str:
        return f"Head(ln_f={self.ln_f!r}, weight tied to wte)"


class GPT(nn.Sequential):
    """layers = [Embeddings, Block x config.layers, Head]; forward(ids (B, T)) -> logits (B, T, V).

    Initialised as GPT-2 / nanoGPT from `rng`: Linear and Embedding weights with standard
    deviation 0.02, except the two c_proj weights of each block (they write into the residual
    stream) with 0.02 / sqrt(2 layers); biases 0; LayerNorm weights 1 and biases 0.
    """

    def __init__(self, config: GPTConfig, rng: np.random.Generator):
        embeddings = Embeddings(config, rng)
        blocks = [Block(config, index, rng) for index in range(config.layers)]
        super().__init__(embeddings, *blocks, Head(config, embeddings.wte))
        self.config = config
        _init_weights(self, config.layers, rng)

    def tied_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """(name, Parameter) of the weights two layers share: the token embedding, which the head
        reads too. A pipeline holding layer 0 and the head on different ranks keeps a copy on
        each (minimp/parallel/pipeline/tied.py)."""
        head = self.layers[-1]
        assert isinstance(head, Head)  # for the type checker: a Sequential holds Modules
        return [("0.wte.weight", head.wte.weight)]

    def set_dropout_state(self, seed: int, step: int, sample_indices: npt.ArrayLike) -> None:
        """Before a forward with dropout > 0: this step's (seed, step) and the global batch
        index of each of the rows passed in (see nn.set_dropout_state)."""
        nn.set_dropout_state(self, seed, step, sample_indices)


def _init_weights(model: nn.Module, layers: int, rng: np.random.Generator) -> None:
    """GPT-2's initialisation, drawn from rng in named_parameters() order (so reproducible)."""
    for name, parameter in model.named_parameters():
        if name.endswith("bias"):
            parameter.data[...] = 0.0
        elif ".ln_" in name:
            parameter.data[...] = 1.0  # LayerNorm weights (ln_1, ln_2, ln_f)
        else:
            # 2 x layers c_proj outputs add up in the residual stream: scaled to keep the sum's size
            std = 0.02 / math.sqrt(2 * layers) if name.endswith("c_proj.weight") else 0.02
            drawn = rng.standard_normal(parameter.shape) * std  # float64 on the host
            parameter.data = backend.to_device(drawn.astype(parameter.dtype))


def block_activation_bytes(s: int, b: int, h: int, a: int, dtype: npt.DTypeLike,
                           dropout: bool = True) -> int:
    """Bytes one Block keeps for backward (parameters excluded), for context s, batch b, width h,
    a heads and activations stored in dtype (d bytes each); `dropout` when p > 0.

        (16 d + 2) sbh + (2 d + 1) as^2 b + 16 sb      with dropout
        16 d sbh + d as^2 b + 16 sb                    without

    With d = 2 (fp16, bf16) and dropout this is exactly the sbh (34 + 5as/h) of Korthikanti et al.
    2022 ("Reducing Activation Recomputation in Large Transformer Models", section 4.1), plus 16 sb.
    Per op: ln_1 and ln_2 inputs 2 d sbh; c_attn input d sbh; q and k d sbh each (views of the
    c_attn output); softmax output d as^2 b; its dropout mask as^2 b (bool) and output d as^2 b
    (kept by the product with v); v d sbh; c_proj input d sbh; c_fc input d sbh; GELU input 4 d sbh;
    mlp.c_proj input 4 d sbh; two residual-dropout masks 2 sbh. Residual adds, splits, reshapes and
    transposes keep nothing. Without dropout no masks are kept, and the product with v keeps the
    softmax output itself.

    What stays float32 in a 16-bit block is the 16 sb: each LayerNorm keeps a mean and a 1/std per
    row (2 LayerNorms x 2 x 4 bytes x sb), as it computed them. They are h times smaller than an
    activation, and rounding them to 16 bits would add a second error to every normalized value
    that backward recomputes from them (Korthikanti et al. leave them out). The dropout masks are
    1 byte in every dtype; in float64 (gradient checks) the statistics are float64 too.
    """
    d = np.dtype(dtype).itemsize
    statistics = 2 * 2 * max(d, 4) * s * b  # 2 LayerNorms x (mean, 1/std), float32 at least
    if dropout:
        return (16 * d + 2) * s * b * h + (2 * d + 1) * a * s * s * b + statistics
    return 16 * d * s * b * h + d * a * s * s * b + statistics
