"""GPU arrays through host memory once per collective: pinned buffers, one copy each way.

When MPI cannot read GPU memory (it is not CUDA-aware), every byte a collective sends goes through
the host. Staged message by message (what MPICommunicator does with a device array it is handed),
a ring all-reduce over p ranks pays 2(p - 1) device-to-host copies, as many copies back, a stream
synchronisation and a fresh host allocation per message. Staged here, the whole array goes to a
pinned host buffer once, the collective runs on host arrays (its reductions on the CPU), and the
result comes back once: two copies per collective, whatever p is.

Pinned (page-locked) host memory is what the GPU's copy engines read and write directly; pageable
memory goes through a driver bounce buffer first. CuPy's pinned memory pool keeps the buffers for
the next call, so a training step's all-reduces allocate nothing after the first.
"""

from typing import TYPE_CHECKING, Callable, Protocol

import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array, is_device_array
from minimp.distributed.buffers import contiguous_flat, output_buffer
from minimp.distributed.protocol import Communicator

if TYPE_CHECKING:
    import cupy


class DeviceCopies(Protocol):
    """The five things staging asks of a device (CuPy here; a counting fake in the tests)."""

    def pinned_empty(self, size: int, dtype: DTypeLike) -> np.ndarray:
        """A flat host array in page-locked memory."""

    def flat(self, x: Array) -> Array:
        """x as a flat contiguous device array (a view when it already is one)."""

    def output(self, x: Array, out: Array | None) -> Array:
        """The flat device array the result goes into: out's memory, or a new array."""

    def to_host(self, device_flat: Array, host: np.ndarray) -> None:
        """Copy device_flat into host, waiting until the bytes have arrived."""

    def to_device(self, host: np.ndarray, device_flat: Array) -> None:
        """Copy host into device_flat, waiting until the bytes have arrived."""


class CupyCopies:
    """DeviceCopies for CuPy arrays: cupyx.empty_pinned, ndarray.get(out=...), ndarray.set."""

    def pinned_empty(self, size: int, dtype: DTypeLike) -> np.ndarray:
        import cupyx

        return cupyx.empty_pinned((size,), dtype)

    def flat(self, x: Array) -> Array:
        return contiguous_flat(x)

    def output(self, x: Array, out: Array | None) -> Array:
        return output_buffer(x, out)

    def to_host(self, device_flat: "cupy.ndarray", host: np.ndarray) -> None:
        device_flat.get(out=host)  # on the current stream, after the kernels that wrote it

    def to_device(self, host: np.ndarray, device_flat: "cupy.ndarray") -> None:
        device_flat.set(host)  # from pinned memory: returns when the copy is done


def stages_through_host(comm: Communicator, x: Array) -> bool:
    """True when x is a device array, there is another rank to send it to, and comm hands MPI
    host copies of device arrays (the communicator's `stages_device_arrays`; the simulated world
    has none and passes arrays as they are)."""
    if not is_device_array(x) or comm.size == 1:
        return False
    return bool(getattr(comm, "stages_device_arrays", False))


def host_staged(collective: Callable[..., Array], comm: Communicator, x: Array, op: str = "sum",
                out: Array | None = None, copies: DeviceCopies | None = None) -> Array:
    """collective(comm, host copy of x, op, out=pinned host buffer), with one device-to-host copy
    of x and one host-to-device copy of the result, into `out` or a new device array shaped
    like x. The collective is any of minimp's all-reduces (it agrees on the array itself)."""
    copies = CupyCopies() if copies is None else copies
    flat = copies.flat(x)
    host_in = copies.pinned_empty(flat.size, flat.dtype)
    host_out = copies.pinned_empty(flat.size, flat.dtype)
    copies.to_host(flat, host_in)
    collective(comm, host_in, op, out=host_out)
    result = copies.output(x, out)
    copies.to_device(host_out, result)
    return result.reshape(x.shape)
