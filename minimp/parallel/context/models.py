"""Context parallelism applied to the GPT: each rank runs the model on its shard of every sample's
sequence, and its attention over the whole sequence through the ring.

`parallelize_context` gives a rank a copy of the GPT's modules that shares every Parameter with
the whole model (so the masters, gradients and checkpoints are those of one process, and rank 0
still evaluates the whole model on whole sequences), with two seams of minimp/models/gpt.py set:

  Embeddings.positions      the GLOBAL positions of the rank's tokens (layout.token_indices), so
                            its position embeddings are those one process adds at those places
  CausalSelfAttention.attend  ring attention over the context-parallel group (ring.py)

Everything else (LayerNorm, MLP, residual adds, the head, the loss) is position-wise and runs on
the rank's T/N tokens unchanged. The caller feeds each rank its shard of the inputs and of the
targets (layout.shard along the sequence axis) and reduces the gradients over the dp x cp ranks
(parallel/apply.py: `replicate`).

The loss: rank (d, c) of dp replicas x N context shards computes L_dc, the cross-entropy mean over
its b (T/N) tokens (b = B/dp rows). One process's loss is L = 1/(B T) sum over all tokens
= 1/(dp N) sum_dc L_dc, since every L_dc averages the same number of tokens. Ring attention's
backward sends each rank the gradient its keys and values receive from the other ranks' queries,
so the gradient each rank holds for its copy of a weight is d(sum_c L_dc)/dW through that copy,
and summing over the N copies gives d(sum_c L_dc)/dW. Averaging the gradients over the dp x N
ranks (the data-parallel all-reduce over dp_cp_group, dividing by dp N) therefore gives
1/(dp N) d(sum_dc L_dc)/dW = dL/dW: the mean over the rank's own tokens needs no other factor.

Modes, in ATTENTIONS: "ring" (ring.py), either layout, the context a multiple of 2N (each rank's
positions are two chunks of the 2N-chunk grid); "ulysses" (ulysses.py: an all-to-all from sequence
shards to head shards and back), the contiguous layout only, the heads and the context multiples
of N. The loss and gradient argument above holds for Ulysses as written: AllToAll's backward sends
each rank's keys and values their gradients from the heads' ranks.

Measured: each mode's Attention holds one AttentionStats (ring.py) per rank, shared by every
block, which the trainer's meter reads (`attention_stats`). A call adds the bytes its Functions
keep for backward, every distinct array saved by the graph nodes between its q, k, v and its output
(the ring's q, k, v, O and log-sum-exp; Ulysses' head-sharded q, k^T, v and probabilities), and its
causal blocks of the 2N-chunk grid: the ring counts those it merges; Ulysses computes a 1/N share
of the heads' whole T x T scores, so its blocks are the share of the H heads' T^2 scores its
probability arrays hold times the whole sequence's (2N)^2 / 2 blocks: 2N on every rank. Only calls
that build a graph are counted: one run under no_grad (--recompute's first forward of a block,
which its backward runs again with a graph) keeps nothing for backward, so every figure is per
call whose graph backward uses.
"""

import copy
from dataclasses import dataclass, field
from typing import Callable, Iterable

from minimp import nn
from minimp.distributed.protocol import Communicator
from minimp.function import Context
from minimp.models.gpt import GPT, Attention, CausalSelfAttention, Embeddings
from minimp.ops.softmax import ScaledMaskedSoftmax
from minimp.parallel.context.layout import ContextLayout
from minimp.parallel.context.ring import AttentionStats, ring_attention
from minimp.parallel.context.ulysses import check_ulysses, ulysses_attention
from minimp.tensor import Tensor, grad_enabled


def call_contexts(output: Tensor, inputs: tuple[Tensor, ...]) -> list[tuple[type, Context]]:
    """(Function, ctx) of every graph node behind output up to (not including) inputs: what one
    attention call recorded."""
    stop, seen, found, stack = {id(t) for t in inputs}, set(), [], [output]
    while stack:
        tensor = stack.pop()
        if id(tensor) in stop or id(tensor) in seen or tensor.node is None:
            continue
        seen.add(id(tensor))
        found.append((tensor.node.function, tensor.node.context))
        stack.extend(tensor.node.inputs)
    return found


def record_call(stats: AttentionStats, output: Tensor,
                inputs: tuple[Tensor, ...]) -> list[tuple[type, Context]]:
    """One call more, and the bytes its nodes saved for backward (each array once); returns the
    nodes (call_contexts)."""
    nodes = call_contexts(output, inputs)
    arrays = {id(a): a for _, ctx in nodes for a in ctx.saved_arrays or ()
              if hasattr(a, "nbytes")}  # (arrays a saved-tensor hook packed are not arrays)
    stats.calls += 1
    stats.saved_bytes += sum(array.nbytes for array in arrays.values())
    return nodes


@dataclass(frozen=True)
class RingAttentionCall:
    """The Attention a block's heads go to under --cp-mode ring: causal attention of this rank's
    q, k, v (B, H, T/N, D) over the whole sequence, around comm's ring; stats counts its calls."""

    comm: Communicator
    layout: ContextLayout
    stats: AttentionStats = field(default_factory=AttentionStats)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if not grad_enabled():  # uncounted (the module docstring): a throwaway stats takes it
            return ring_attention(q, k, v, self.comm, self.layout)
        output = ring_attention(q, k, v, self.comm, self.layout, self.stats)  # adds the blocks
        record_call(self.stats, output, (q, k, v))
        return output


@dataclass(frozen=True)
class UlyssesAttentionCall:
    """The Attention a block's heads go to under --cp-mode ulysses: causal attention of this
    rank's q, k, v (B, H, T/N, D) over the whole sequence, each rank attending H/N heads' whole
    sequence between two all-to-alls (today's attention on them: chunk_size None); stats counts
    its calls (the module docstring: how its blocks are measured)."""

    comm: Communicator
    layout: ContextLayout
    stats: AttentionStats = field(default_factory=AttentionStats)

    def __call__(self, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        output = ulysses_attention(q, k, v, self.comm, self.layout)
        if not grad_enabled():  # uncounted (the module docstring)
            return output
        nodes = record_call(self.stats, output, (q, k, v))
        batch, heads, tokens, _ = q.shape
        scores = batch * heads * (tokens * self.comm.size) ** 2  # all H heads' T x T
        computed = sum(ctx.saved_arrays[0].size for function, ctx in nodes
                       if function is ScaledMaskedSoftmax and ctx.saved_arrays)
        # (the integers first: 2N comes out exact)
        self.stats.blocks += computed * (2 * self.comm.size) ** 2 / (2 * scores)
        return output


def attention_stats(layers: Iterable[nn.Module]) -> AttentionStats | None:
    """The AttentionStats of the context-parallel Attention these layers' blocks hand their heads
    to (parallelize_context gives every block of a rank the same one), or None where none does."""
    for layer in layers:
        for module in layer.modules():
            attend = getattr(module, "attend", None)
            if isinstance(attend, (RingAttentionCall, UlyssesAttentionCall)):
                return attend.stats
    return None


# Each --cp-mode's Attention, built from the context-parallel group and the layout.
ATTENTIONS: dict[str, Callable[[Communicator, ContextLayout], Attention]] = {
    "ring": RingAttentionCall,
    "ulysses": UlyssesAttentionCall,
}


def _heads_held(model: GPT) -> int:
    """The attention heads each block of model computes: H, or H/tp in a tensor-parallel copy
    (its q, k, v projection holds 3 C/tp of the 3 C features, D = C/H per head)."""
    config = model.config
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            return module.c_attn.out_features // 3 // (config.width // config.heads)
    return config.heads


def parallelize_context(model: GPT, comm: Communicator, layout: ContextLayout,
                        mode: str = "ring") -> GPT:
    """A copy of model's modules sharing its Parameters, which runs rank comm.rank's positions
    of every sample (the module docstring): its embeddings at those global positions, every
    block's attention through `mode`'s Attention over comm. model may be a tensor-parallel copy
    (minimp/parallel/tensor/models.py): Ulysses then splits the H/tp heads its blocks hold."""
    if mode not in ATTENTIONS:
        raise ValueError(f"context parallelism: --cp-mode {mode} is not available (use "
                         f"{' or '.join(ATTENTIONS)})")
    if comm.size != layout.size:
        raise ValueError(f"context parallelism: the layout is for {layout.size} ranks, the group "
                         f"has {comm.size} (build ContextLayout({comm.size}))")
    context = model.config.context
    if mode == "ulysses":
        if layout.kind != "contiguous":
            raise ValueError(f"context parallelism: --cp-mode ulysses takes the contiguous layout, "
                             f"got {layout.kind} (use --cp-layout contiguous)")
        check_ulysses(_heads_held(model), context, comm.size)
    else:  # the ring computes in the 2N-chunk grid with either layout
        ContextLayout(layout.size).check_tokens(context)
    layout.check_tokens(context)
    # The memo maps what the copy shares to itself: every Parameter (new modules, the same
    # weights and gradients) and, with --tp, the group the cut Linears talk in (a communicator
    # holds locks and sockets, which cannot be copied; the copy talks in the same group).
    shared: dict[int, object] = {id(parameter): parameter for parameter in model.parameters()}
    shared |= {id(value): value for module in model.modules() for value in vars(module).values()
               if isinstance(value, Communicator)}
    copied = copy.deepcopy(model, memo=shared)
    attention = ATTENTIONS[mode](comm, layout)
    for module in copied.modules():
        if isinstance(module, Embeddings):
            module.positions = layout.token_indices(comm.rank, model.config.context)
        elif isinstance(module, CausalSelfAttention):
            module.attend = attention
    return copied
