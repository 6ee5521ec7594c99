"""Which sequence positions each rank of a context-parallel group holds, and the causal work that
gives it: zig-zag (balanced) or contiguous shards.

Both layouts are described on one grid: the sequence of T positions cut into 2N chunks of T/(2N),
for N ranks. zig-zag: rank r holds chunks r and 2N-1-r, an early chunk and a late one (Megatron-
Core's and picotron's load-balanced split). contiguous: the naive split into N chunks of T/N, rank
r holding chunk r of those, which is chunks 2r and 2r+1 of the grid. A rank's positions are its
chunks in that order, concatenated.

Causal work, in blocks of the grid (query chunk x key chunk, a diagonal block counting 1/2, since
half its pairs are masked): query chunk i sees key chunks 0..i-1 whole and its own half, i + 1/2
blocks; the whole sequence is sum_i (i + 1/2) = (2N)^2 / 2 = 2N^2 blocks.

- zig-zag: rank r does (r + 1/2) + (2N-1-r + 1/2) = 2N blocks, the same on every rank: 2N^2 / N.
  (The issue text says 2N-1 each; that undercounts by one: e.g. N = 1 does its 2 chunks' 1/2 + 3/2
  = 2 blocks, not 1.)
- contiguous: rank r does (2r + 1/2) + (2r + 1 + 1/2) = 4r + 2 blocks: 2 on rank 0, 4N - 2 on rank
  N-1, so the busiest rank does (4N-2)/2 = 2N-1 times the idlest's work, and every step of a ring
  waits for the busiest.

AttentionBytes is what both context-parallel attentions report of their messages: the bytes one
rank sends in one attention call, forward and backward (ring.py's ring_bytes, ulysses.py's
ulysses_bytes).
"""

from dataclasses import dataclass

import numpy as np

from minimp.backend import Array, array_module

LAYOUTS = ("zigzag", "contiguous")


@dataclass(frozen=True)
class AttentionBytes:
    """Bytes one rank sends in one context-parallel attention call: forward (keys and values, or
    q, k, v and O) and backward (what travels for the gradients); each formula says its dtypes."""

    forward: int
    backward: int


@dataclass(frozen=True)
class ContextLayout:
    """The shards of a context-parallel group: size, the number of ranks N; kind, "zigzag"
    (rank r holds grid chunks r and 2N-1-r) or "contiguous" (chunks 2r and 2r+1: the r-th of N
    equal pieces)."""

    size: int
    kind: str = "zigzag"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ValueError(f"a context-parallel group needs at least 1 rank, got {self.size}")
        if self.kind not in LAYOUTS:
            raise ValueError(f"context layout must be one of {LAYOUTS}, got {self.kind!r}")

    @property
    def chunks(self) -> int:
        """The grid's chunk count, 2N."""
        return 2 * self.size

    def chunk_ids(self, rank: int) -> tuple[int, int]:
        """The grid chunks rank holds, in the order its positions are stored."""
        if not 0 <= rank < self.size:
            raise ValueError(f"rank {rank} is not in a context-parallel group of {self.size}")
        if self.kind == "zigzag":
            return rank, self.chunks - 1 - rank
        return 2 * rank, 2 * rank + 1

    def check_tokens(self, tokens: int) -> None:
        """The sequence must cut into the grid's 2N equal chunks; contiguous shards need only N
        equal pieces (Ulysses takes them so; the ring checks its 2 chunks a rank itself)."""
        pieces = self.size if self.kind == "contiguous" else self.chunks
        if tokens % pieces or tokens == 0:
            cut = f"{pieces} contiguous pieces" if pieces == self.size else f"2N = {pieces} chunks"
            raise ValueError(f"context parallelism over {self.size} ranks cuts the sequence into "
                             f"{cut}: its {tokens} positions are not a multiple of {pieces} "
                             f"(choose a context divisible by {pieces})")

    def token_indices(self, rank: int, tokens: int) -> np.ndarray:
        """The global positions rank holds, in its storage order: T/N of the sequence's T."""
        self.check_tokens(tokens)
        held = self.chunk_ids(rank)  # (a rank outside the group fails here)
        if self.kind == "contiguous":  # the r-th of N pieces (grid chunks 2r, 2r+1 when 2N | T)
            return np.arange(tokens).reshape(self.size, -1)[rank]
        return np.arange(tokens).reshape(self.chunks, -1)[list(held)].ravel()

    def shard(self, x: Array, rank: int, axis: int = 1) -> Array:
        """Rank's positions of x along axis (the T of (B, T, ...) by default), a new array."""
        indices = self.token_indices(rank, x.shape[axis])
        return array_module(x).take(x, array_module(x).asarray(indices), axis=axis)

    def unshard(self, shards: list[Array], axis: int = 1) -> Array:
        """The whole sequence from every rank's shard (rank order): shard's inverse."""
        if len(shards) != self.size:
            raise ValueError(f"unshard needs one shard per rank ({self.size}), got {len(shards)}")
        xp = array_module(shards[0])
        stacked = xp.concatenate(shards, axis=axis)
        tokens = stacked.shape[axis]
        order = np.concatenate([self.token_indices(rank, tokens) for rank in range(self.size)])
        return xp.take(stacked, xp.asarray(np.argsort(order)), axis=axis)

    def causal_work(self, rank: int) -> float:
        """Attention blocks of the 2N-chunk grid rank computes (a diagonal block counts 1/2):
        sum over its query chunks i of i + 1/2; 2N under zig-zag, 4r + 2 contiguous."""
        return sum(i + 0.5 for i in self.chunk_ids(rank))

    def work_imbalance(self) -> float:
        """The busiest rank's causal work over the idlest's: 1 zig-zag, 2N-1 contiguous."""
        work = [self.causal_work(rank) for rank in range(self.size)]
        return max(work) / min(work)
