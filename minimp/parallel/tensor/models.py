"""Tensor parallelism applied to minimp's two models: which Linears are cut, how, and
what stays whole.

GPT (Megatron-LM's transformer layer): in each block the q, k, v projection is column-parallel with
the heads split across the ranks (rank r computes heads r H/tp .. (r + 1) H/tp - 1 whole, their
softmax and dropout included), the attention's output projection row-parallel; the MLP's first
Linear column-parallel (4h/tp features each), its second row-parallel. Per block and micro-batch
that is one all-reduce after attention and one after the MLP forward, and one each in backward
(at the two f's).

The embeddings and the tied head stay whole on every rank (replicated), where Megatron-LM splits
the vocabulary: with 65 characters the table is 65 x h, less than a block's attention projection,
so a vocabulary-parallel embedding would save a few kilobytes per rank for an all-reduce of a
b x s x h activation after the lookup, and the head would need a vocabulary-parallel cross-entropy
(a max and a sum all-reduced over the ranks) for logits of b x s x 65 values, smaller than one
activation. Every rank computes the same logits and the same loss instead, from the same
(replicated) final LayerNorm. A GPT-2 vocabulary (50,257) would turn the argument around.

With sequence parallelism the LayerNorms, residual adds and dropouts of the blocks run on a 1/tp
slice of the sequence: the embeddings' output is split before its dropout (forward pre-hook), the
column layers all-gather, the row layers reduce-scatter, and the head gathers the sequence again
(its backward just keeps this rank's slice: every rank computes the same gradient there). The
LayerNorms' and row layers' biases then see only their slice's positions, so their gradients are
partial sums (summed over the ranks once a step: grads.py).

MLP (the digits task): hidden layers in pairs, column -> ReLU -> row -> ReLU (ReLU is elementwise,
so it runs on the split features); the output layer stays whole. A pipeline may cut only between
pairs: `paired_counts`.

Dropout masks stay those of one process: a rank's slice of heads or positions passes its slice
index to nn.Dropout, which offsets the mask's positions (minimp/ops/dropout.py).
"""

from dataclasses import dataclass, field

from minimp import nn
from minimp.distributed.protocol import Communicator
from minimp.models.gpt import GPT, MLP, Block
from minimp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, partitions
from minimp.parallel.tensor.mappings import (gather_from_sequence_parallel_region,
                                             scatter_to_sequence_parallel_region)


class TensorParallelError(ValueError):
    """The model cannot be cut as asked."""


@dataclass
class TensorParallelPlan:
    """What parallelize_module did: which parameters are cut, which whole ones get partial
    gradients. partitions: {name: (axis, sections)} of the parameters cut across the ranks;
    partial: the names of whole parameters whose gradient on each rank is partial (a sum)."""

    partitions: dict[str, tuple[int, int]]
    partial: set[str] = field(default_factory=set)


def parallelize_module(model: nn.Module, comm: Communicator,
                       sequence_parallel: bool = False) -> TensorParallelPlan:
    """Cut the model's Linears over comm's ranks, in place (a whole float32 model, built from the
    seed on every rank); parameter names stay the one-process ones."""
    if isinstance(model, GPT):
        partial = _parallelize_gpt(model, comm, sequence_parallel)
    elif isinstance(model, nn.Sequential):
        if sequence_parallel:
            raise TensorParallelError("sequence parallelism needs a sequence: the GPT")
        _parallelize_mlp(model, comm)
        partial = set()
    else:
        raise TensorParallelError("tensor parallelism cuts a GPT or an nn.Sequential MLP, not a "
                                  f"{type(model).__name__}")
    return TensorParallelPlan(partitions(model), partial)


def _parallelize_gpt(model: GPT, comm: Communicator, sequence_parallel: bool) -> set[str]:
    heads = model.config.heads
    if heads % comm.size:
        raise TensorParallelError(f"{heads} attention heads do not split over {comm.size} "
                                  "tensor-parallel ranks")
    partial = set()
    for index, block in enumerate(model.layers):
        if not isinstance(block, Block):
            continue
        attn, mlp = block.attn, block.mlp
        assert isinstance(mlp, MLP), "--tp with --experts is refused (minimp/train/checks.py)"
        attn.c_attn = ColumnParallelLinear(attn.c_attn, comm, 3, sequence_parallel)  # q, k, v
        attn.c_proj = RowParallelLinear(attn.c_proj, comm, sequence_parallel)
        attn.attn_dropout.slice_index = comm.rank  # (B, H/tp, T, T): this rank's heads
        mlp.c_fc = ColumnParallelLinear(mlp.c_fc, comm, 1, sequence_parallel)
        mlp.c_proj = RowParallelLinear(mlp.c_proj, comm, sequence_parallel)
        if sequence_parallel:  # (B, T/tp, h) after the row layers: this rank's positions
            attn.resid_dropout.slice_index = mlp.dropout.slice_index = comm.rank
            cut = partitions(block)
            whole = [name for name, _ in block.named_parameters() if name not in cut]
            partial |= {f"{index}.{name}" for name in whole}
    if sequence_parallel:
        # Split the embeddings' sum, then drop out this rank's slice.
        drop = getattr(model.layers[0], "drop")
        drop.slice_index = comm.rank
        drop.register_forward_pre_hook(
            lambda module, args: scatter_to_sequence_parallel_region(args[0], comm))
        # the head: every position, on every rank
        model.layers[-1].register_forward_pre_hook(
            lambda module, args: gather_from_sequence_parallel_region(args[0], comm, False))
    return partial


def _parallelize_mlp(model: nn.Sequential, comm: Communicator) -> None:
    linears = {i: layer for i, layer in enumerate(model.layers) if isinstance(layer, nn.Linear)}
    hidden = list(linears)[:-1]  # the output layer stays whole
    if len(hidden) % 2:
        raise TensorParallelError("tensor parallelism pairs the MLP's hidden layers "
                                  f"(column-parallel, then row-parallel); {len(hidden)} hidden "
                                  "layers do not pair")
    for first, second in zip(hidden[0::2], hidden[1::2]):
        setattr(model, str(first), ColumnParallelLinear(linears[first], comm))
        setattr(model, str(second), RowParallelLinear(linears[second], comm))


def paired_counts(counts: list[int]) -> list[int]:
    """An MLP's parameters per layer with each hidden pair's counted on its first layer, so that
    the pipeline's split (which opens a group at every layer with weights) never cuts a pair:
    the activation between the two is split across the tensor-parallel ranks."""
    weighted = [index for index, count in enumerate(counts) if count]
    merged = list(counts)
    hidden = weighted[:-1]
    for first, second in zip(hidden[0::2], hidden[1::2]):
        merged[first], merged[second] = counts[first] + counts[second], 0
    return merged
