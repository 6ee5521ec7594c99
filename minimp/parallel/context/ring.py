"""Ring attention: causal attention over a sequence sharded across a context-parallel group, the
key/value blocks passed around a ring while each rank merges them into its queries' online
softmax (Liu et al. 2023, Ring Attention; the zig-zag shards of layout.py balance its causal
work, as Megatron-Core's and ring-flash-attention's do).

Each of the N ranks holds q, k and v of its own positions, (B, H, T/N, D): two chunks of the
2N-chunk grid (layout.py). At step t = 0..N-1 rank r holds the keys and values of rank
s = (r - t) mod N. It first posts the send of that block to rank r+1 and the receive of the next
one from rank r-1 (Tag.CONTEXT_KEYS_VALUES), then merges the block into its two query chunks'
online softmax (minimp/ops/attention.py's `forward_block`: the same function, on the same chunk
shapes, as one process's tiled attention), then waits: the message travels while the block is
computed. Key chunks after a query chunk are skipped (no compute), but every step sends, so the
ring stays regular. `ring_order` is the resulting visiting order; handed to
`F.tiled_attention(..., order=...)`, one process gives each rank's output bit for bit.

Backward (FlashAttention-2 per block, `backward_block`): the key/value blocks travel the ring again,
and their gradients dK, dV travel WITH them (Tag.CONTEXT_GRADIENTS): at step t rank r adds its
queries' share to block s's gradients and passes them on; after N steps of adding they take one
more hop and arrive home, where they are rounded once. They travel as float32 accumulators
(float64 for float64 inputs; 4 bytes a value below): each rank adds its share in float32, so the
sum over N ranks rounds once, as one process's does (a 16-bit hop would round N times). dQ stays
home, in a float32 accumulator.

Bytes one rank sends per attention call, n = B H (T/N) D values per tensor, N > 1 (none for N = 1):
    forward:  (N - 1) * 2n * itemsize                 k and v, N-1 hops
    backward: (N - 1) * 2n * itemsize + N * 2n * 4    k and v again; dK and dV in float32, N hops
Memory per rank: saved for backward q, k, v, O (4n * itemsize) and lse (B H (T/N) * 4 bytes):
1/N of one process's tiled attention. In flight: min(N, 2) buffers of (k, v), the block being
computed and the one arriving, 2 * 2n * itemsize (one for N = 1); backward adds min(N, 2)
float32 buffers of (dK, dV), the gradients being added to and the ones arriving, 2 * 2n * 4.
An AttentionStats handed to `ring_attention` counts what each call did (the trainer's metrics
compare it with these formulas): the blocks it computed and the buffers it held.
"""

import math
from dataclasses import dataclass

import numpy as np

from minimp import Tensor
from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator, Request, Tag
from minimp.function import Context, Function
from minimp.ops.attention import (BlockGradients, OnlineSoftmax, accumulate_dtype, backward_block,
                                  check_attention_inputs, chunk, forward_block, output_delta)
from minimp.parallel.context.layout import AttentionBytes, ContextLayout
from minimp.precision.casting import round_to


def ring_blocks(layout: ContextLayout, rank: int, step: int) -> list[tuple[int, int, bool]]:
    """The blocks rank computes at ring step `step`, in order: (a, b, diagonal) for its a-th query
    chunk against the held block's b-th key chunk. A key chunk after the query chunk is left out
    (the causal mask empties it: no compute); diagonal says the chunk is the query's own."""
    held = layout.chunk_ids((rank - step) % layout.size)
    return [(a, b, i == j) for a, i in enumerate(layout.chunk_ids(rank))
            for b, j in enumerate(held) if j <= i]


def ring_order(layout: ContextLayout, rank: int) -> dict[int, tuple[int, ...]]:
    """For each grid chunk rank holds as queries, the key chunks its ring merges, in order (what
    `F.tiled_attention(..., order=...)` takes): step t brings rank (rank - t) mod N's chunks."""
    queries = layout.chunk_ids(rank)
    order: dict[int, list[int]] = {i: [] for i in queries}
    for step in range(layout.size):
        keys = layout.chunk_ids((rank - step) % layout.size)
        for a, b, _ in ring_blocks(layout, rank, step):
            order[queries[a]].append(keys[b])
    return {i: tuple(keys) for i, keys in order.items()}


@dataclass
class AttentionStats:
    """What one rank's context-parallel attention did since `reset`, added to call by call:
    calls (forwards run); blocks, the 2N-chunk grid's causal blocks they computed (a diagonal 1/2,
    layout.py's unit); saved_bytes, the bytes their Functions kept for backward; buffer_bytes and
    backward_buffer_bytes, the most bytes of in-flight buffers one forward, one backward held at
    once (the ring's; none for Ulysses, whose all-to-all buffers are alltoall.py's own)."""

    calls: int = 0
    blocks: float = 0.0
    saved_bytes: int = 0
    buffer_bytes: int = 0
    backward_buffer_bytes: int = 0

    def reset(self) -> None:
        """Every count back to 0 (the trainer's meter does this as each step starts)."""
        self.calls, self.blocks, self.saved_bytes = 0, 0.0, 0
        self.buffer_bytes = self.backward_buffer_bytes = 0


@dataclass(frozen=True)
class RingMemory:
    """One rank's ring attention memory in bytes: saved, what forward keeps for backward (q, k, v,
    O, lse); forward_buffers and backward_buffers, the ring's in-flight buffers in each pass."""

    saved: int
    forward_buffers: int
    backward_buffers: int


def ring_bytes(shape: tuple[int, ...], dtype: np.dtype, size: int) -> AttentionBytes:
    """The module docstring's byte formula, for a rank's q of shape (B, H, T/N, D) in dtype and a
    ring of size N."""
    block = 2 * math.prod(shape)  # k and v: 2n values
    if size == 1:
        return AttentionBytes(0, 0)
    forward = (size - 1) * block * np.dtype(dtype).itemsize
    return AttentionBytes(forward, forward + size * block * accumulate_dtype(dtype).itemsize)


def ring_memory(shape: tuple[int, ...], dtype: np.dtype, size: int) -> RingMemory:
    """The module docstring's memory formula, for a rank's q of shape (B, H, T/N, D) in dtype and
    a ring of size N."""
    itemsize, wide = np.dtype(dtype).itemsize, accumulate_dtype(dtype).itemsize
    values, queries = math.prod(shape), math.prod(shape[:-1])
    buffers = min(size, 2) * 2 * values  # (k, v) blocks: the one computed, the one arriving
    return RingMemory(saved=4 * values * itemsize + queries * wide,
                      forward_buffers=buffers * itemsize,
                      backward_buffers=buffers * (itemsize + wide))


def check_ring_inputs(q: Array, k: Array, v: Array, comm: Communicator,
                      layout: ContextLayout) -> None:
    """One clear error before any message: shapes, dtypes, the group and the chunk split."""
    check_attention_inputs("ring_attention", q, k, v)
    if comm.size != layout.size:
        raise ValueError(f"ring_attention: the layout is for {layout.size} ranks, the "
                         f"communicator has {comm.size} (build ContextLayout({comm.size}))")
    if q.shape[2] % 2 or q.shape[2] == 0:
        raise ValueError(f"ring_attention: each rank holds T/N = {q.shape[2]} positions, which "
                         f"must be 2 equal chunks: choose a context divisible by 2N = "
                         f"{layout.chunks}")


def _exchange(comm: Communicator, send: Array, receive: Array, tag: Tag) -> list[Request]:
    """Post the receive from rank r-1 and the send to rank r+1, before the compute they hide
    behind."""
    previous, following = (comm.rank - 1) % comm.size, (comm.rank + 1) % comm.size
    return [comm.irecv(receive, previous, tag), comm.isend(send, following, tag)]


class RingAttention(Function):
    """y = softmax(q k^T / sqrt(D), causal) v over the whole sequence, for this rank's queries;
    dL/dq here, dL/dk and dL/dv gathered around the ring (the module docstring tells how).

    comm: the context-parallel group of N ranks; layout: a ContextLayout(N) naming which positions
    each rank's q, k, v (B, H, T/N, D) hold; stats: where the blocks computed and the buffers' bytes
    are added (its calls and saved_bytes are the caller's to count).
    """

    @staticmethod
    def forward(ctx: Context, q: Array, k: Array, v: Array, comm: Communicator,
                layout: ContextLayout, stats: AttentionStats) -> Array:
        check_ring_inputs(q, k, v, comm, layout)
        xp, size, rank = array_module(q), comm.size, comm.rank
        ctx.comm, ctx.layout, ctx.scale = comm, layout, 1.0 / math.sqrt(q.shape[-1])
        ctx.stats = stats
        ctx.chunk_size = c = q.shape[2] // 2  # this rank's two chunks of the 2N-chunk grid
        queries = [chunk(q, a, c) for a in range(2)]
        states = [OnlineSoftmax.start(query) for query in queries]
        # (2, B, H, T/N, D): k and v in one message a step, C-contiguous as the wire needs (the
        # GPT hands in views of its qkv product: stacking them may keep their strides)
        held = xp.ascontiguousarray(xp.stack((k, v)))
        arriving = xp.empty_like(held) if size > 1 else None
        buffers = held.nbytes + (0 if arriving is None else arriving.nbytes)
        stats.buffer_bytes = max(stats.buffer_bytes, buffers)
        for step in range(size):
            moving = [] if arriving is None or step == size - 1 else _exchange(
                comm, held, arriving, Tag.CONTEXT_KEYS_VALUES)
            for a, b, diagonal in ring_blocks(layout, rank, step):
                forward_block(states[a], queries[a], chunk(held[0], b, c), chunk(held[1], b, c),
                              ctx.scale, diagonal)
                stats.blocks += 0.5 if diagonal else 1.0
            for request in moving:
                request.wait()
            if moving:
                held, arriving = arriving, held
        finished = [state.finish(q.dtype) for state in states]
        output = xp.concatenate([out for out, _ in finished], axis=2)
        lse = xp.concatenate([part for _, part in finished], axis=2)
        ctx.save_for_backward(q, k, v, output, lse)
        return output

    @staticmethod
    def backward(ctx: Context, grad_output: Array) -> tuple[Array, Array, Array]:
        assert ctx.saved_arrays is not None  # the walk refuses a freed graph before calling this
        q, k, v, output, lse = ctx.saved_arrays
        comm, size, rank, c = ctx.comm, ctx.comm.size, ctx.comm.rank, int(ctx.chunk_size)
        xp, delta = array_module(q), output_delta(grad_output, output)
        rows = [slice(a * c, (a + 1) * c) for a in range(2)]  # this rank's two query chunks
        queries = [chunk(q, a, c) for a in range(2)]
        grads = [chunk(grad_output, a, c) for a in range(2)]
        grad_q = xp.zeros(q.shape, lse.dtype)  # dQ stays home, in float32
        held = xp.ascontiguousarray(xp.stack((k, v)))  # C order for the wire, as in forward
        adding = xp.zeros(held.shape, lse.dtype)  # (dK, dV) of the held block, in float32
        arriving, arriving_grads = (xp.empty_like(held), xp.empty_like(adding)) if size > 1 else (
            None, None)
        buffers = sum(buffer.nbytes for buffer in (held, adding, arriving, arriving_grads)
                      if buffer is not None)
        ctx.stats.backward_buffer_bytes = max(ctx.stats.backward_buffer_bytes, buffers)
        previous, following = (rank - 1) % size, (rank + 1) % size
        sending: list[Request] = []
        for step in range(size):
            moving = [] if arriving is None or step == size - 1 else _exchange(
                comm, held, arriving, Tag.CONTEXT_KEYS_VALUES)
            # the held block's gradients so far: rank r-1 sent them after its previous step
            arrived = None if arriving is None or step == 0 else comm.irecv(
                arriving_grads, previous, Tag.CONTEXT_GRADIENTS)
            for request in sending:  # our previous step's gradients have left: reuse the buffer
                request.wait()
            adding[...] = 0
            for a, b, diagonal in ring_blocks(ctx.layout, rank, step):
                columns = slice(b * c, (b + 1) * c)
                into = BlockGradients(grad_q[..., rows[a], :], adding[0][..., columns, :],
                                      adding[1][..., columns, :])
                backward_block(into, queries[a], chunk(held[0], b, c), chunk(held[1], b, c),
                               grads[a], lse[..., rows[a]], delta[..., rows[a]], ctx.scale,
                               diagonal)
            if arrived is not None:
                arrived.wait()
                adding += arriving_grads
            if size > 1:  # on to rank r+1; after N hops they are home
                sending = [comm.isend(adding, following, Tag.CONTEXT_GRADIENTS)]
            for request in moving:
                request.wait()
            if moving:
                held, arriving = arriving, held
        home = adding
        if size > 1:  # our own block's gradients, from rank r-1's last step
            comm.irecv(arriving_grads, previous, Tag.CONTEXT_GRADIENTS).wait()
            for request in sending:
                request.wait()
            home = arriving_grads
        return round_to(grad_q, q.dtype), round_to(home[0], k.dtype), round_to(home[1], v.dtype)


def ring_attention(q: Tensor, k: Tensor, v: Tensor, comm: Communicator, layout: ContextLayout,
                   stats: AttentionStats | None = None) -> Tensor:
    """Causal attention of this rank's queries over the whole sharded sequence (RingAttention):
    q, k, v (B, H, T/N, D) hold the positions layout gives comm.rank; stats, when given, counts
    the blocks computed and the ring's buffers."""
    return RingAttention.apply(q, k, v, comm=comm, layout=layout, stats=stats or AttentionStats())
