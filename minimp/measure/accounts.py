"""What a rank holds and sends, measured: bytes by kind of array, the peak inside a step, bytes sent
by collective.

Memory, by kind. Measured: the arrays each part names (`arrays_by_kind`), each block of memory
counted once, in the first kind that names it (a float32 model's compute copy is its master).
The formulas these measurements must equal, stage by stage of ZeRO, are
minimp/parallel/zero/formulas.py's.
"""

import time
from contextlib import contextmanager
from typing import Any, Iterator

from minimp.distributed.protocol import Communicator
from minimp.tensor import memory_owner

KINDS = ("parameters", "gradients", "accumulators", "masters", "optimizer_state", "buffers",
         "gathered")


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
