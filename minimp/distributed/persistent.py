"""A persistent all-reduce: agree on the array and plan once, then run it call after call.

MPI-4 calls this a persistent collective (MPI_Allreduce_init once, MPI_Start each time). Every
call of `allreduce` first has the ranks agree on the array's length and dtype (one small
all-reduce: on this project's machine about as long as MPI's whole all-reduce of 4 KiB) and picks
an algorithm. A caller that all-reduces arrays of one layout again and again (a gradient bucket,
every step) can do both once: `PersistentAllreduce(comm, shape, dtype)` agrees and chooses at
construction, on every rank together; each call then checks on this rank alone that its array is
the one planned (the construction checked that the ranks planned alike) and moves the bytes, with
the same messages and additions, so the same bits, as the checked call.
"""

import math

import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array
from minimp.distributed.buffers import agree_on_layout, contiguous_flat, output_buffer
from minimp.distributed.collectives import BODIES, AlgorithmPolicy, resolve_algorithm
from minimp.distributed.protocol import Communicator, check_op


class PersistentAllreduce:
    """All-reduce of arrays of one shape and dtype, planned once: `plan(x, out=None)` returns the
    reduction like allreduce(comm, x, op, algorithm, out=out). Constructing it is a collective
    (every rank of comm, with the same shape and dtype, or CollectiveMismatchError on all)."""

    def __init__(
        self,
        comm: Communicator,
        shape: tuple[int, ...],
        dtype: DTypeLike,
        op: str = "sum",
        algorithm: "str | AlgorithmPolicy" = "auto",
    ):
        check_op(op)
        if not all(isinstance(n, (int, np.integer)) and n >= 0 for n in shape):
            raise ValueError(
                f"PersistentAllreduce: shape must be non-negative integers, got {shape}"
            )
        self.comm, self.op = comm, op
        self.shape, self.dtype = tuple(int(n) for n in shape), np.dtype(dtype)
        size = math.prod(self.shape)
        self.algorithm = resolve_algorithm(algorithm, size * self.dtype.itemsize, comm.size)
        agree_on_layout(comm, size, self.dtype, "PersistentAllreduce")
        self._body = BODIES[self.algorithm]

    def __call__(self, x: Array, out: Array | None = None) -> Array:
        if x.shape != self.shape or x.dtype != self.dtype:
            raise ValueError(
                f"PersistentAllreduce: planned for {self.dtype} arrays of shape {self.shape}, "
                f"called with {x.dtype} {x.shape}; make a plan for that layout"
            )
        flat_x, flat_out = contiguous_flat(x), output_buffer(x, out)
        if self.comm.size == 1:
            flat_out[...] = flat_x
        else:
            self._body(self.comm, flat_x, flat_out, self.op)
        return flat_out if len(self.shape) == 1 else flat_out.reshape(self.shape)

    def __repr__(self) -> str:
        return (
            f"PersistentAllreduce({self.algorithm}, {self.dtype} {self.shape}, op={self.op!r}, "
            f"{self.comm.size} ranks)"
        )
