"""Reference solutions to lesson 6's exercises (data parallelism). Try them yourself first."""

import zlib

import numpy as np

from minimp import distributed as dist


def average_gradients(comm, grad):
    """Divide in float32 first, round once to float16, sum on the float16 wire with the ring:
    no value on the wire is larger than the largest gradient divided by p."""
    wire = (grad * np.float32(1.0 / comm.size)).astype(np.float16)
    return dist.ring_allreduce(comm, wire).astype(np.float32)


def global_mean_gradient(comm, local_mean, count):
    """The mean over all samples: each shard's mean weighted by its share of the samples."""
    total = comm.allreduce_scalars([count], "sum")[0]
    return dist.ring_allreduce(comm, local_mean * (count / total))


def drifted_replicas(comm, weights):
    """One checksum of the bytes per rank, gathered into a table everyone sees (a 32-bit
    checksum is exact in the float64 scalars allreduce_scalars adds up)."""
    table = np.zeros(comm.size)
    table[comm.rank] = zlib.crc32(np.ascontiguousarray(weights).tobytes())
    table = comm.allreduce_scalars(table, "sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]
