"""The only place that chooses the array module: NumPy on the CPU, CuPy on a GPU (called `xp`).

Every other file asks this one for `xp` instead of importing numpy or cupy for array work, so one
code path serves both devices. The device is chosen once per process: `use_device("gpu")`, the train
flag `--device gpu`, or the environment variable MINIMP_DEVICE=gpu.
"""

import os
import threading
from types import ModuleType
from typing import TYPE_CHECKING, Any, Union

import numpy

from minimp.memory_pool import MemoryPool, held_only_by

if TYPE_CHECKING:
    import cupy

# An array on either device: NumPy's on the CPU, CuPy's on a GPU (one code path serves both).
Array = Union[numpy.ndarray, "cupy.ndarray"]

DEVICE_ENVIRONMENT_VARIABLE = "MINIMP_DEVICE"
DEVICES = ("cpu", "gpu")

# The one process-wide choice (like torch's default device); everything else is passed as arguments.
_selected_device = None


# The caching allocator (minimp/memory_pool.py), one per thread, and whether ops use it: a
# process-wide setting like the device (tests train with it on and off and compare the bits).
_memory_pools = threading.local()
_memory_pool_enabled = True


class DeviceError(RuntimeError):
    """The requested device cannot be used (unknown name, CuPy missing, no GPU visible)."""


def _import_cupy():
    try:
        import cupy
    except ImportError as error:
        raise DeviceError(
            "device 'gpu' needs CuPy: pip install 'minimp[gpu]' (or the cupy build for your CUDA)"
        ) from error
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # CuPy raises its own CUDARuntimeError without a driver
        raise DeviceError(
            f"device 'gpu': CuPy is installed but CUDA is not usable ({error})"
        ) from error
    if count < 1:
        raise DeviceError("device 'gpu': CuPy is installed but no GPU is visible")
    return cupy


def check_device(name: str) -> None:
    """Raise DeviceError unless `name` is a device this process could use (for 'gpu': CuPy imports
    and sees a GPU). Selects nothing: a launcher checks before it starts any work."""
    if name not in DEVICES:
        raise DeviceError(f"unknown device {name!r}: use one of {', '.join(DEVICES)}")
    if name == "gpu":
        _import_cupy()


def use_device(name: str, local_rank: int = 0) -> None:
    """Select 'cpu' (NumPy) or 'gpu' (CuPy) for this process; raises DeviceError when impossible.
    On a GPU machine, rank `local_rank` of this machine takes GPU local_rank % count, so several
    ranks may share one GPU."""
    global _selected_device
    check_device(name)
    if name == "gpu":
        cupy = _import_cupy()
        cupy.cuda.Device(local_rank % cupy.cuda.runtime.getDeviceCount()).use()
    _selected_device = name


def device() -> str:
    """The selected device: 'cpu' unless use_device('gpu') or MINIMP_DEVICE=gpu said otherwise."""
    if _selected_device is None:
        use_device(os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "cpu").strip().lower() or "cpu")
    return _selected_device


def default_xp() -> ModuleType:
    """The array module for new arrays on the selected device."""
    return _import_cupy() if device() == "gpu" else numpy


def is_device_array(array: Any) -> bool:
    """True for a CuPy array (GPU memory), without importing CuPy."""
    return type(array).__module__.startswith("cupy")


def array_module(*arrays: Any) -> ModuleType:
    """The array module owning these arrays: operations follow their inputs, not a global switch."""
    for array in arrays:
        if is_device_array(array):
            import cupy

            return cupy
    return numpy


def use_memory_pool(enabled: bool) -> None:
    """Turn the caching allocator on (the default) or off; off, `empty` allocates afresh."""
    global _memory_pool_enabled
    _memory_pool_enabled = bool(enabled)


def memory_pool() -> MemoryPool:
    """This thread's caching allocator (each rank of the simulated world is a thread)."""
    pool = getattr(_memory_pools, "pool", None)
    if pool is None:
        pool = _memory_pools.pool = MemoryPool()
    return pool


def empty(shape: tuple[int, ...], dtype: Any, like: Any) -> Any:
    """An uninitialised array on `like`'s device, for an op to write its result into (out=).
    NumPy arrays come from the memory pool, reused across steps once nothing holds them; CuPy
    arrays from CuPy's own memory pool, which does the same for GPU memory."""
    xp = array_module(like)
    if xp is numpy and _memory_pool_enabled:
        return memory_pool().empty(shape, dtype)
    return xp.empty(shape, dtype)


def sole_holder(holder: list, index: int) -> bool:
    """True when nothing but `holder` (and this thread's memory pool) refers to holder[index]: no
    other variable, container or view, so whoever holds `holder` may keep or change that array."""
    pool = getattr(_memory_pools, "pool", None)
    pooled = pool is not None and pool.holds(holder[index])
    return held_only_by(holder, index, others=1 if pooled else 0)


def to_device(array: Any) -> Any:
    """Copy a host array to the selected device (a no-op on the CPU)."""
    return default_xp().asarray(array)


def to_numpy(array: Any) -> numpy.ndarray:
    """A NumPy copy (or the array itself) on the host, whatever device holds it."""
    if is_device_array(array):
        return array.get()
    return numpy.asarray(array)


def data_address(array: Any) -> int:
    """Where an array's first element lives in memory (a view's address lies inside its base's)."""
    if is_device_array(array):
        return int(array.data.ptr)
    return int(array.__array_interface__["data"][0])


def synchronize() -> None:
    """Wait for queued GPU work; needed before timing or handing a buffer to MPI.
    No-op on the CPU."""
    if _selected_device == "gpu":
        _import_cupy().cuda.get_current_stream().synchronize()


def available_cores() -> int:
    """CPU cores this process may run on (the affinity mask, not the host's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def available_memory() -> int:
    """Bytes of memory this machine can still give (MemAvailable on Linux; else all of it)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def limit_cpu_threads(threads: int) -> Any:
    """Cap BLAS/OpenMP threads of this process (threadpoolctl); returns the limiter (keep it alive).
    Several MPI ranks on one machine each starting a thread per core would fight over the cores."""
    from threadpoolctl import threadpool_limits

    return threadpool_limits(limits=max(1, int(threads)))
