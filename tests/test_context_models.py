"""parallelize_context on the GPT: the copy shares the whole model's Parameters and leaves it
whole, each rank's logits are one process's at its positions, and the gradients of the ranks'
mean losses, averaged over the ranks, are one process's (the derivation in the module's
docstring), in float64 to rounding; each mode's Attention counts its calls, causal blocks and saved
bytes as their formulas say; a tensor-parallel copy keeps its group and its H/tp heads (what
Ulysses splits); bad input is one error before any message."""

import dataclasses
import re

import numpy as np
import pytest

from minimp import functional as F
from minimp.distributed import simulate
from minimp.models.gpt import GPT, CausalSelfAttention, Embeddings, GPTConfig
from minimp.parallel import Topology
from minimp.parallel.context import ContextLayout, ring_memory, ulysses_memory
from minimp.parallel.context.models import attention_stats, parallelize_context
from minimp.parallel.tensor.models import parallelize_module
from minimp.tensor import Tensor

CONFIG = GPTConfig(vocab_size=65, context=16, layers=2, heads=4, width=32)


def gpt(dtype=np.float64):
    """The same GPT on every rank (one seed), in dtype."""
    return GPT(CONFIG, np.random.default_rng(0)).to(dtype)


def mean_loss(model, ids, targets):
    """Cross-entropy averaged over every position of ids (B, T) -> (the loss, the logits)."""
    logits = model(Tensor(ids))  # (B, T, V)
    batch, tokens, vocabulary = logits.shape
    rows = logits.reshape(batch * tokens, vocabulary)
    return F.cross_entropy(rows, targets.reshape(batch * tokens)), logits.data


def test_the_copy_shares_every_parameter_and_leaves_the_whole_model_whole():
    layout = ContextLayout(2)

    def body(comm):
        model = gpt()
        copy = parallelize_context(model, comm, layout)
        same = [a is b for a, b in zip(model.parameters(), copy.parameters())]
        embeddings = [m for m in copy.modules() if isinstance(m, Embeddings)]
        attention = [m for m in copy.modules() if isinstance(m, CausalSelfAttention)]
        whole = [m.attend is None for m in model.modules() if isinstance(m, CausalSelfAttention)]
        whole += [m.positions is None for m in model.modules() if isinstance(m, Embeddings)]
        return (len(same), all(same), embeddings[0].positions.tolist(),
                [m.attend is not None for m in attention], all(whole))

    for rank, (count, same, positions, attends, whole) in enumerate(simulate(2, body)):
        assert count == len(gpt().parameters()) and same
        assert positions == layout.token_indices(rank, CONFIG.context).tolist()
        assert attends == [True] * CONFIG.layers and whole


@pytest.mark.parametrize("size, kind, mode", [
    (2, "zigzag", "ring"), (2, "contiguous", "ring"), (4, "zigzag", "ring"),
    (2, "contiguous", "ulysses"), (4, "contiguous", "ulysses"),
])  # fmt: skip
def test_logits_and_averaged_gradients_equal_one_process(size, kind, mode):
    rng = np.random.default_rng(1)
    ids = rng.integers(0, CONFIG.vocab_size, size=(2, CONFIG.context))
    targets = rng.integers(0, CONFIG.vocab_size, size=(2, CONFIG.context))
    whole = gpt()
    loss, logits = mean_loss(whole, ids, targets)
    loss.backward()
    expected = [p.grad for p in whole.parameters()]
    layout = ContextLayout(size, kind)

    def body(comm):
        model = gpt()
        shard = parallelize_context(model, comm, layout, mode)
        loss, logits = mean_loss(shard, layout.shard(ids, comm.rank),
                                 layout.shard(targets, comm.rank))
        loss.backward()  # the ring (all-to-all) brings the other ranks' share of dK, dV home
        return logits, [p.grad for p in model.parameters()]

    results = simulate(size, body, eager_limit=0)
    for rank, (got, _) in enumerate(results):
        np.testing.assert_allclose(got, layout.shard(logits, rank), rtol=1e-12, atol=1e-14)
    for index, want in enumerate(expected):  # what the all-reduce over dp x cp computes
        mean = sum(grads[index] for _, grads in results) / size
        np.testing.assert_allclose(mean, want, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("size, kind, mode", [
    (2, "zigzag", "ring"), (4, "contiguous", "ring"), (2, "contiguous", "ulysses"),
])  # fmt: skip
def test_each_block_s_attention_adds_its_blocks_and_saved_bytes_to_the_rank_s_stats(
    size, kind, mode
):
    """One forward and backward of the 2-block GPT: two calls on every rank, each computing
    layout.py's causal work (the ring: 2N zig-zag, 4r + 2 contiguous; Ulysses: 2N) and keeping
    1/N of one process's attention (ring_memory's, ulysses_memory's bytes), the ring's buffers
    those of ring_memory; the whole model's blocks attend themselves and have no stats."""
    rng, layout = np.random.default_rng(2), ContextLayout(size, kind)
    ids = rng.integers(0, CONFIG.vocab_size, size=(2, CONFIG.context))

    def body(comm):
        model = gpt(np.float32)
        shard = parallelize_context(model, comm, layout, mode)
        stats = attention_stats(shard.layers)
        logits = shard(Tensor(layout.shard(ids, comm.rank)))
        logits.sum().backward()
        return dataclasses.replace(stats), attention_stats(model.layers)

    shape = (2, CONFIG.heads, CONFIG.context // size, CONFIG.width // CONFIG.heads)
    memory = ring_memory(shape, np.dtype(np.float32), size)
    saved = memory.saved if mode == "ring" else ulysses_memory(shape, np.float32, size)
    for rank, (stats, whole) in enumerate(simulate(size, body)):
        work = layout.causal_work(rank) if mode == "ring" else 2 * size
        assert (stats.calls, stats.blocks, stats.saved_bytes) == (2, 2 * work, 2 * saved)
        buffers = (memory.forward_buffers, memory.backward_buffers) if mode == "ring" else (0, 0)
        assert (stats.buffer_bytes, stats.backward_buffer_bytes) == buffers
        assert whole is None


@pytest.mark.parametrize(
    "layout, mode, message",
    [
        (ContextLayout(2), "striped", "--cp-mode striped is not available (use ring or ulysses)"),
        (ContextLayout(4), "ring", "the layout is for 4 ranks, the group has 2"),
        (ContextLayout(2), "ring", "not a multiple of 4"),
        (ContextLayout(2, "contiguous"), "ring", "not a multiple of 4"),  # 18: 2N does not divide
        (ContextLayout(2), "ulysses", "takes the contiguous layout, got zigzag (use --cp-layout "
                                      "contiguous)"),
        (ContextLayout(2, "contiguous"), "ulysses", "attention heads a rank holds"),
    ],
    ids=["mode", "size", "context", "ring-contiguous", "ulysses-zigzag", "ulysses-heads"],
)
def test_bad_input_is_one_error_before_any_message(layout, mode, message):
    config = GPTConfig(vocab_size=65, context=18 if "multiple" in message else 16, layers=1,
                       heads=1 if "heads" in message else 2, width=8)

    def body(comm):
        with pytest.raises(ValueError, match=re.escape(message)):
            parallelize_context(GPT(config, np.random.default_rng(0)), comm, layout, mode)
        return comm.bytes_sent

    assert simulate(2, body) == [0, 0]


def tensor_parallel_copy(comm, config=CONFIG):
    """(this rank's Topology of --tp 2 x --cp 2, the GPT cut over its tp group)."""
    grid = Topology(comm, dp=1, tp=2, cp=2)
    model = GPT(config, np.random.default_rng(0)).to(np.float64)
    parallelize_module(model, grid.tp_group)
    return grid, model


@pytest.mark.parametrize("mode, kind", [("ring", "zigzag"), ("ulysses", "contiguous")])
def test_a_tensor_parallel_copy_keeps_its_group_and_gives_one_process_logits(mode, kind):
    """The copy's cut Linears talk in the same tp group (a communicator is shared, not copied),
    its Parameters are the cut model's, and Ulysses splits the H/tp = 2 heads a rank holds."""
    ids = np.random.default_rng(1).integers(0, CONFIG.vocab_size, size=(2, CONFIG.context))
    _, logits = mean_loss(gpt(), ids, ids)
    layout = ContextLayout(2, kind)

    def body(comm):
        grid, model = tensor_parallel_copy(comm)
        shard = parallelize_context(model, grid.cp_group, layout, mode)
        attention = [m for m in shard.modules() if isinstance(m, CausalSelfAttention)]
        groups = [m.c_attn.comm is grid.tp_group and m.c_proj.comm is grid.tp_group
                  for m in attention]
        same = [a is b for a, b in zip(model.parameters(), shard.parameters())]
        return grid.cp_rank, all(groups) and all(same), shard(Tensor(layout.shard(
            ids, grid.cp_rank))).data

    for cp_rank, shared, got in simulate(4, body, eager_limit=0):
        assert shared
        np.testing.assert_allclose(got, layout.shard(logits, cp_rank), rtol=1e-12, atol=1e-14)


def test_ulysses_refuses_a_tensor_parallel_copy_whose_heads_do_not_split_before_any_message():
    """2 heads over --tp 2: each rank's blocks hold 1, which --cp 2 cannot split (the whole
    model's 2 heads could)."""
    config = GPTConfig(vocab_size=65, context=16, layers=1, heads=2, width=8)

    def body(comm):
        grid, model = tensor_parallel_copy(comm, config)
        before = grid.cp_group.bytes_sent
        with pytest.raises(ValueError, match=re.escape("the 1 attention heads a rank holds")):
            parallelize_context(model, grid.cp_group, ContextLayout(2, "contiguous"), "ulysses")
        return grid.cp_group.bytes_sent - before

    assert simulate(4, body) == [0, 0, 0, 0]
