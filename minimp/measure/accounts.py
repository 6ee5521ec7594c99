"""What a rank holds and sends, measured and by formula, for data parallelism and ZeRO's stages.

Memory, by kind. Measured: the arrays each part names (`arrays_by_kind`), each block of memory
counted once, in the first kind that names it (a float32 model's compute copy is its master).
Formula, per rank r with N replicas, P parameters in its pipeline stage, S_r the elements of its
chunks (minimp/parallel/zero/layout.py), c the compute dtype's bytes, k the optimizer's float32
slots (Adam 2, SGD with momentum 1), w the gradient wire's bytes:

  kind            stage 0            stage 1            stage 2            stage 3
  parameters      c P                c P                c P                c S_r
  accumulators    4 P                4 P                4 S_r              4 S_r
  masters         4 P (0 if c = 4)   4 S_r              4 S_r              4 S_r (0 if c = 4)
  optimizer       4 k P              4 k S_r            4 k S_r            4 k S_r
  buffers         2 w P              (2 w + c) U        (2 w + c) U        2 w U

(U: the largest unit; no buffers when N = 1.) Per parameter, with S_r = P/N, fp16 and Adam, that
is 18, 6 + 12/N, 2 + 16/N and 18/N bytes, where ZeRO's paper (section 3.1, Adam in fp16) has 16,
4 + 12/N, 2 + 14/N and 16/N: minimp's gradients are float32 accumulators (4 bytes, where the paper
keeps fp16 gradients: 2), held between steps. The 16-bit gradient backward writes is freed as soon
as it is added into them, so it lives inside a step only, with stage 3's gathered layers and the
activations; the peak inside a step is measured apart (`PeakMemory`, `peak_formula`): c P more
in stages 0-1 (every 16-bit gradient, at the end of backward), c U in stage 2 (one layer's), 2 c U
in stage 3 (and that layer gathered).

Bytes sent per step by rank r, ring collectives over units of s_u elements whose chunk r has c_u(r)
elements (a ring reduce-scatter sends every chunk but its own, an all-gather every chunk but its
right neighbour's), M micro-batches, g_u the layers that read unit u:

  stage 0   all-reduce of each bucket: sum (s - c(r)) w + (s - c(r + 1)) w
  stage 1   one reduce-scatter (w) + one all-gather of the compute copies (c)
  stage 2   M reduce-scatters, one per micro-batch (w) + one all-gather (c)
  stage 3   M reduce-scatters (w) + M (g_u + 1) all-gathers (c): before each layer's forward
            and once before the backward

With even chunks that is ZeRO's 2 (N - 1)/N P elements (stages 0-2) and 3 (N - 1)/N P (stage 3).
Stage 2 reduce-scatters every micro-batch, (M + 1)(N - 1)/N P elements: reducing once, on the
last, would need a whole float32 accumulator until then, which is stage 1. Scalar all-reduces
(overflow flag, norm, loss) are counted apart, as calls.
"""

import time
from contextlib import contextmanager
from typing import Any, Iterator

from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import chunk_bounds
from minimp.tensor import memory_owner

KINDS = (
    "parameters",
    "gradients",
    "accumulators",
    "masters",
    "optimizer_state",
    "buffers",
    "gathered",
)


def held_bytes(arrays_by_kind: dict[str, list[Any]]) -> dict[str, int]:
    """{kind: bytes}: every block of memory counted once, in the first kind (KINDS order) that
    names it or a view of it."""
    counted: set[int] = set()
    held = dict.fromkeys(KINDS, 0)
    for kind in KINDS:
        for array in arrays_by_kind.get(kind, ()):
            owner = memory_owner(array) if array is not None else None
            if owner is None or id(owner) in counted:
                continue
            counted.add(id(owner))
            held[kind] += int(owner.nbytes)
    return held


def data_parallel_arrays(optimizer: Any, data_parallel: Any) -> dict[str, list[Any]]:
    """What stage 0 holds, by kind: the optimizer's arrays and the all-reduce's buffers."""
    slots = [v for slots in optimizer.slots for v in slots.values() if v is not None]
    return {
        "parameters": [parameter.data for parameter in optimizer.params],
        "gradients": [parameter.grad for parameter in optimizer.params],
        "accumulators": list(optimizer.accumulators),
        "masters": list(optimizer.master_weights),
        "optimizer_state": slots,
        "buffers": [buffer for pair in data_parallel.buffers for buffer in pair],
    }


class PeakMemory:
    """The largest total seen by `sample`, and its kinds (the peak inside a step)."""

    def __init__(self) -> None:
        self.total, self.by_kind = 0, dict.fromkeys(KINDS, 0)

    def sample(self, held: dict[str, int]) -> None:
        total = sum(held.values())
        if total > self.total:
            self.total, self.by_kind = total, dict(held)


class BytesSent:
    """Bytes this rank sent, by collective, read from the communicators' own counts, and the
    seconds spent in each (ZeRO's run inside backward and the optimizer's step, where the
    trainer's communication stopwatch does not look)."""

    def __init__(self) -> None:
        self.by_collective: dict[str, int] = {}
        self.seconds: dict[str, float] = {}

    @contextmanager
    def counting(self, comm: Communicator, collective: str) -> Iterator[None]:
        before, started = comm.bytes_sent, time.perf_counter()
        try:
            yield
        finally:
            sent = comm.bytes_sent - before
            self.by_collective[collective] = self.by_collective.get(collective, 0) + sent
            elapsed = time.perf_counter() - started
            self.seconds[collective] = self.seconds.get(collective, 0.0) + elapsed


def chunk_sizes(sizes: list[int], rank: int, world_size: int) -> list[int]:
    """How many elements of each unit (or bucket) rank holds: its chunk_bounds chunk."""
    return [stop - start for start, stop in (chunk_bounds(s, world_size)[rank] for s in sizes)]


def memory_formula(
    stage: int,
    *,
    unit_sizes: list[int],
    rank: int,
    world_size: int,
    compute_bytes: int,
    wire_bytes: int,
    slots: int,
) -> dict[str, int]:
    """The table above, in bytes, for one rank (stage 0's buckets hold P elements in all)."""
    total = sum(unit_sizes)
    shard = sum(chunk_sizes(unit_sizes, rank, world_size))
    held = shard if stage > 0 else total
    largest = max(unit_sizes, default=0)
    many = world_size > 1
    c, w = compute_bytes, wire_bytes
    buffers = {0: 2 * w * total, 1: (2 * w + c) * largest, 2: (2 * w + c) * largest}
    return {
        "parameters": c * (shard if stage == 3 else total),
        "gradients": 0,
        "accumulators": 4 * (shard if stage >= 2 else total),
        "masters": 0 if c == 4 and stage in (0, 3) else 4 * held,
        "optimizer_state": 4 * slots * held,
        "buffers": buffers.get(stage, 2 * w * largest) if many else 0,
        "gathered": 0,
    }


def peak_formula(stage: int, *, unit_sizes: list[int], compute_bytes: int) -> int:
    """Bytes held above `memory_formula`'s at the peak inside a step, for models whose units are
    each read by one layer (the MLP): stages 0-1 hold every 16-bit gradient at the end of
    backward, c P; stage 2 one unit's, reduce-scattered as soon as backward completes it, c U;
    stage 3 that and the same unit gathered for its backward, 2 c U."""
    largest, c = max(unit_sizes, default=0), compute_bytes
    if stage < 2:
        return c * sum(unit_sizes)
    return c * largest * (1 if stage == 2 else 2)


def bytes_sent_formula(
    stage: int,
    *,
    sizes: list[int],
    rank: int,
    world_size: int,
    micro_batches: int,
    compute_bytes: int,
    wire_bytes: int,
    readers: list[int] | None = None,
) -> dict[str, int]:
    """Bytes rank sends in one step that is not skipped, by collective. sizes: stage 0's
    buckets, or ZeRO's units; readers: how many layers read each unit (stage 3)."""
    if world_size == 1:
        return {}
    own = chunk_sizes(sizes, rank, world_size)
    right = chunk_sizes(sizes, (rank + 1) % world_size, world_size)
    scatter = sum(s - o for s, o in zip(sizes, own))  # elements: every chunk but its own
    gather = [s - n for s, n in zip(sizes, right)]  # every chunk but its right neighbour's
    m, c, w = micro_batches, compute_bytes, wire_bytes
    if stage == 0:
        return {"all_reduce": (scatter + sum(gather)) * w}
    if stage == 3:
        readers = readers or [1] * len(sizes)
        gathers = sum((g + 1) * n for g, n in zip(readers, gather))
        return {"reduce_scatter": m * scatter * w, "all_gather": m * gathers * c}
    times = 1 if stage == 1 else m
    return {"reduce_scatter": times * scatter * w, "all_gather": sum(gather) * c}


def per_parameter(stage: int, world_size: int, compute_bytes: int = 2, slots: int = 2) -> float:
    """minimp's bytes per parameter held by each rank (model states, even shards, no buffers)."""
    c, k, n = compute_bytes, 4 * slots, world_size
    masters = 0 if c == 4 else 4
    return {
        0: c + 4 + masters + k,
        1: c + 4 + (4 + k) / n,
        2: c + (4 + 4 + k) / n,
        3: (c + 4 + masters + k) / n,
    }[stage]


def paper_per_parameter(stage: int, world_size: int, optimizer_bytes: int = 12) -> float:
    """ZeRO's bytes per parameter (section 5.1: fp16 parameters and gradients, K = 12 bytes of
    Adam state and fp32 masters): 2 + 2 + K, 2 + 2 + K/N, 2 + (2 + K)/N, (2 + 2 + K)/N."""
    k, n = optimizer_bytes, world_size
    return {0: 4 + k, 1: 4 + k / n, 2: 2 + (2 + k) / n, 3: (4 + k) / n}[stage]
