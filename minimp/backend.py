"""The device: where new arrays live (NumPy on the CPU, CuPy on a GPU, called `xp`) and how ops
allocate them.

Every other file asks this one for `xp` instead of importing numpy or cupy for array work, so one
code path serves both devices. Operations follow their inputs (`array_module(x)`); only an array
made from nothing (`to_device`, `current_device().xp.zeros`) asks for the current device. A
`Device` is a value: 'cpu' or 'gpu', and whether ops take NumPy arrays from the caching allocator
(`memory_pool`, minimp/memory_pool.py). This thread's current device is, innermost first:

    with backend.Device("gpu"):                      # in the block, as `with torch.device("cuda"):`
    with backend.Device("cpu", memory_pool=False):   # NumPy, every array allocated afresh
    backend.use_device("gpu", local_rank)            # to the end of the innermost `with` block, or
                                                     # for good outside any (a run's --device gpu)

and where none was chosen, the one the environment variable MINIMP_DEVICE names (else 'cpu'). The
choice is per thread, as CUDA's current device is: nothing module-wide changes. The simulated
world's ranks are threads, and `simulate` runs each under the device current where it was called.
"""

import contextlib
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeGuard, Union

import numpy

from minimp.memory_pool import MemoryPool, held_only_by

if TYPE_CHECKING:
    import cupy

# An array on either device: NumPy's on the CPU, CuPy's on a GPU (one code path serves both).
Array = Union[numpy.ndarray, "cupy.ndarray"]

DEVICE_ENVIRONMENT_VARIABLE = "MINIMP_DEVICE"


class DeviceError(RuntimeError):
    """The requested device cannot be used (unknown name, CuPy missing, no GPU visible)."""


def _import_cupy() -> ModuleType:
    try:
        import cupy
    except ImportError as error:
        raise DeviceError("device 'gpu' needs CuPy: pip install 'minimp[gpu]' (or the cupy build "
                          "for your CUDA)") from error
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CuPy raises its own CUDARuntimeError without a driver
        raise DeviceError("device 'gpu': CuPy is installed but CUDA is not usable "
                          f"({error})") from error
    if count < 1:
        raise DeviceError("device 'gpu': CuPy is installed but no GPU is visible")
    return cupy


@dataclass(frozen=True)
class Device:
    """Where new arrays live: 'cpu' (NumPy) or 'gpu' (CuPy, on this thread's current CUDA device,
    which use_device picks, as `torch.device("cuda")` means the current one), and whether ops take
    NumPy arrays from this thread's caching allocator. `with device:` makes it the current device
    of the block, in this thread (and in the simulated ranks started inside)."""

    type: str = "cpu"
    memory_pool: bool = True  # tests train with it on and off and compare the bits

    def __post_init__(self) -> None:
        if self.type not in ("cpu", "gpu"):
            raise DeviceError(f"unknown device {self.type!r}: use one of cpu, gpu")

    @property
    def xp(self) -> ModuleType:
        """The array module of new arrays on this device (DeviceError where CuPy cannot run)."""
        return _import_cupy() if self.type == "gpu" else numpy

    def __enter__(self) -> "Device":
        _thread.devices.append(self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        _thread.devices.pop()  # this device, or the one use_device put in its place


class _ThreadState(threading.local):
    """What one thread chose: its devices, the innermost last (MINIMP_DEVICE's first, once asked);
    its caching allocator (one per thread: each rank of the simulated world is a thread, and a
    pool used by one thread needs no lock)."""

    def __init__(self) -> None:
        self.devices: list[Device] = []
        self.pool = MemoryPool()


_thread = _ThreadState()


def current_device() -> Device:
    """This thread's device: the innermost `with device:` or use_device, else MINIMP_DEVICE's."""
    if not _thread.devices:  # read when first asked, not at import: a bad name fails only then
        name = os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "cpu").strip().lower() or "cpu"
        _thread.devices.append(Device(name))
    return _thread.devices[-1]


def check_device(name: str) -> None:
    """Raise DeviceError unless `name` is a device this process could use (for 'gpu': CuPy imports
    and sees a GPU). Selects nothing: a launcher checks before it starts any work."""
    Device(name).xp  # the array module: for 'gpu', CuPy imported and a GPU seen


def use_device(name: str, local_rank: int = 0) -> None:
    """Make 'cpu' (NumPy) or 'gpu' (CuPy) this thread's device until its innermost `with` block
    ends (for good outside any), keeping the memory-pool setting; raises DeviceError when
    impossible. On a GPU machine, rank `local_rank` of this machine takes GPU local_rank % count
    (CUDA's current device of this thread, as torch.cuda.set_device), so several ranks may share
    one GPU."""
    device = Device(name, current_device().memory_pool)
    if name == "gpu":
        cupy = device.xp
        cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    _thread.devices[-1] = device


def is_device_array(array: object) -> TypeGuard["cupy.ndarray"]:
    """True for a CuPy array (GPU memory), without importing CuPy."""
    return type(array).__module__.startswith("cupy")


def array_module(*arrays: object) -> ModuleType:
    """The array module owning these arrays: operations follow their inputs, not a global switch."""
    for array in arrays:
        if is_device_array(array):
            import cupy

            return cupy
    return numpy


def memory_pool() -> MemoryPool:
    """This thread's caching allocator (each rank of the simulated world is a thread)."""
    return _thread.pool


def empty(shape: tuple[int, ...], dtype: numpy.typing.DTypeLike, like: Array) -> Array:
    """An uninitialised array on `like`'s device, for an op to write its result into (out=).
    NumPy arrays come from the memory pool (unless the current device turns it off), reused across
    steps once nothing holds them; CuPy arrays from CuPy's own memory pool, which does the same for
    GPU memory."""
    xp = array_module(like)
    if xp is numpy and current_device().memory_pool:
        return _thread.pool.empty(shape, dtype)
    return xp.empty(shape, dtype)


def sole_holder(holder: list, index: int) -> bool:
    """True when nothing but `holder` (and this thread's memory pool) refers to holder[index]: no
    other variable, container or view, so whoever holds `holder` may keep or change that array."""
    return held_only_by(holder, index, others=1 if _thread.pool.holds(holder[index]) else 0)


def to_device(array: numpy.typing.ArrayLike) -> Array:
    """Copy a host array to the current device (a no-op on the CPU)."""
    return current_device().xp.asarray(array)


def to_numpy(array: Array) -> numpy.ndarray:
    """A NumPy copy (or the array itself) on the host, whatever device holds it."""
    return array.get() if is_device_array(array) else numpy.asarray(array)


def data_address(array: Array) -> int:
    """Where an array's first element lives in memory (a view's address lies inside its base's)."""
    if is_device_array(array):
        return int(array.data.ptr)
    return int(array.__array_interface__["data"][0])


def synchronize() -> None:
    """Wait for queued GPU work; needed before timing or handing a buffer to MPI.
    No-op on the CPU."""
    if current_device().type == "gpu":
        _import_cupy().cuda.get_current_stream().synchronize()


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable on Linux; else all of it)."""
    with contextlib.suppress(OSError), open("/proc/meminfo") as meminfo:  # none off Linux
        for line in meminfo:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def limit_cpu_threads(threads: int) -> Any:
    """Cap BLAS/OpenMP threads of this process (threadpoolctl); returns the limiter (keep it alive).
    Several MPI ranks on one machine each starting a thread per core would fight over the cores."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=max(1, int(threads)))
