"""Copies that must stay bit-identical across ranks, checked: one checksum a rank, against rank 0's.

Data-parallel replicas hold the same masters (and fp8 state); tensor-parallel ranks hold the same
whole (not cut) parameters. Nothing keeps them equal but the arithmetic being the same on every
rank, so --check-replicas compares them now and then: a CRC-32 of the arrays' bytes per rank,
summed into a table by one scalar all-reduce (no array travels).
"""

import zlib
from typing import Sequence

import numpy as np

from minimp.backend import Array, to_numpy
from minimp.distributed.protocol import Communicator


class ReplicaMismatchError(RuntimeError):
    """Replicas that should be bit-identical are not."""


def ranks_differing_from_rank_0(comm: Communicator, arrays: Sequence[Array]) -> list[int]:
    """The ranks whose arrays' bytes differ from rank 0's: one CRC-32 of them per rank, summed into
    a table by one scalar all-reduce (no array travels)."""
    checksum = 0
    for array in arrays:
        checksum = zlib.crc32(to_numpy(array).tobytes(), checksum)
    table = np.zeros(comm.size)
    table[comm.rank] = checksum  # a 32-bit integer: exact in float64
    table = comm.allreduce_scalars(table, op="sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


def check_same(comm: Communicator, arrays: Sequence[Array], message: str) -> None:
    """Raise ReplicaMismatchError(message with {ranks} filled in) naming the ranks of comm whose
    arrays differ from rank 0's; nothing when every rank holds the same bytes."""
    differing = ranks_differing_from_rank_0(comm, arrays)
    if differing:
        raise ReplicaMismatchError(message.format(ranks=differing))
