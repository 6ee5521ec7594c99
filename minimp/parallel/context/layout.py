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
"""

from dataclasses import dataclass

import numpy as np

from minimp.backend import Array, array_module

LAYOUTS = ("zigzag", "contiguous")


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
        if self.kind == "contiguous" and tokens % self.size == 0 and tokens:
            return
        if self.kind == "contiguous":
            raise ValueError(f"contiguous context shards over {self.size} ranks: the sequence's "
                             f"{tokens} positions are not a multiple of {self.size} (choose a "
                             f"context divisible by {self.size})")
        if tokens % self.chunks or tokens == 0:
            raise ValueError(f"context parallelism over {self.size} ranks cuts the sequence into "
                             f"2N = {self.chunks} chunks: its {tokens} positions are not a "
                             f"multiple of {self.chunks} (choose a context divisible by "
                             f"{self.chunks})")

    def token_indices(self, rank: int, tokens: int) -> np.ndarray:
        """The global positions rank holds, in its storage order: T/N of the sequence's T."""
        self.check_tokens(tokens)
        self.chunk_ids(rank)  # (a rank outside the group fails here)
        if self.kind == "contiguous":  # the r-th of N pieces (grid chunks 2r, 2r+1 when 2N | T)
            share = tokens // self.size
            return np.arange(rank * share, (rank + 1) * share)
        size = tokens // self.chunks
        return np.concatenate([np.arange(i * size, (i + 1) * size) for i in self.chunk_ids(rank)])

    def shard(self, x: Array, rank: int, axis: int = 1) -> Array:
        """Rank's positions of x along axis (the T of (B, T, ...) by default), a new array."""
        indices = self.token_indices(rank, x.shape[axis])
        return array_module(x).take(x, array_module(x).asarray(indices), axis=axis)

    def unshard(self, shards: list[Array], axis: int = 1) -> Array:
        """The whole sequence from every rank's shard (rank order): shard's inverse."""
        if len(shards) != self.size:
            raise ValueError(f"unshard needs one shard per rank ({self.size}), got {len(shards)}")
        xp = array_module(shards[0])
        tokens = sum(shard.shape[axis] for shard in shards)
        order = np.concatenate([self.token_indices(rank, tokens) for rank in range(self.size)])
        stacked = xp.concatenate(shards, axis=axis)
        return xp.take(stacked, xp.asarray(np.argsort(order)), axis=axis)

    def causal_work(self, rank: int) -> float:
        """Attention blocks of the 2N-chunk grid rank computes (a diagonal block counts 1/2):
        sum over its query chunks i of i + 1/2; 2N under zig-zag, 4r + 2 contiguous."""
        return sum(i + 0.5 for i in self.chunk_ids(rank))

    def work_imbalance(self) -> float:
        """The busiest rank's causal work over the idlest's: 1 zig-zag, 2N-1 contiguous."""
        work = [self.causal_work(rank) for rank in range(self.size)]
        return max(work) / min(work)
