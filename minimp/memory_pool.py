"""A caching allocator: arrays whose memory is handed out again once nothing uses it any more.

Why: a training step allocates the same arrays (activations, their gradients) every step, and
glibc's malloc gives large freed blocks back to the kernel (munmap, or trimming the top of its
heap), so the next step takes them again one page fault per 4 KiB page. CuPy's memory pool and
PyTorch's caching allocator keep freed blocks for the next request instead; this is the same
idea for NumPy arrays (docs/benchmarks.md, "One training step", has the measurements).

When is an array free? The pool keeps one reference to every array it has handed out. Whoever
uses the array holds another, and every view of it holds one through `.base`; CPython counts
references exactly and at once. So when the reference count is the pool's own, no array anywhere
can read or write that memory, and it may be handed out again. An array is handed out only as
itself: it owns its memory, has exactly the shape and dtype asked for, and `nbytes` is its size
(the byte accounts of tensor.saved_bytes and ZeRO count live arrays, never pooled memory).

One pool serves one thread (backend keeps one per thread): the simulated MPI world runs its ranks
as threads, and a pool scanned by one thread only needs no lock.
"""

import sys
from types import ModuleType
from typing import Any, Iterator

import numpy
from numpy.typing import DTypeLike

# Past this, freed arrays are dropped instead of cached: a run whose shapes keep changing (batches
# of other sizes, evaluation) would otherwise keep a block of every shape it ever saw.
DEFAULT_MAX_BYTES = 1 << 30


def _reference_count(arrays: list, index: int) -> int:
    """The reference count of arrays[index], as seen from here."""
    return sys.getrefcount(arrays[index])


# The count _reference_count reads for an array that only its list holds (the list's reference,
# and getrefcount's argument), measured rather than assumed, so it holds on any CPython version.
_FREE_REFERENCE_COUNT = _reference_count([numpy.empty(1)], 0)


def held_only_by(holder: list, index: int, others: int = 0) -> bool:
    """True when nothing refers to holder[index] but `holder` and `others` known references: no
    other variable, container or view anywhere."""
    return _reference_count(holder, index) <= _FREE_REFERENCE_COUNT + others


def _free_indices(arrays: list) -> Iterator[int]:
    """Indices of the arrays that nobody but the list holds, first to last, each checked when it
    is reached (a caller that stops at the first checks no more)."""
    return (index for index in range(len(arrays)) if held_only_by(arrays, index))


class MemoryPool:
    """Arrays by (module, shape, dtype), each handed out again only once nothing else holds it.

    MemoryPool(max_bytes): past max_bytes of pooled arrays, free ones are dropped (and a request
    that still does not fit gets a plain, unpooled array). Works with any array module `xp` whose
    arrays are reference counted and keep their base alive (NumPy, CuPy).
    """

    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES):
        self.max_bytes = max_bytes
        self.pooled_bytes = 0  # bytes of every array the pool holds, in use or free
        self.hits = self.misses = 0  # requests served from the pool / by a new allocation
        self._arrays: dict[tuple, list] = {}

    def empty(self, shape: tuple[int, ...], dtype: DTypeLike, xp: ModuleType = numpy) -> Any:
        """An uninitialised array of this shape and dtype that shares memory with no live array."""
        key = (xp.__name__, tuple(shape), numpy.dtype(dtype))
        arrays = self._arrays.setdefault(key, [])
        # The first free one, if any. A plain loop, not _free_indices: every op's allocation comes
        # here, and the generator would add ~0.4 us to a hit's ~0.5.
        for index in range(len(arrays)):
            if held_only_by(arrays, index):
                self.hits += 1
                # Least recently handed out first: in-use arrays gather at the end of the list.
                arrays.append(arrays.pop(index))
                return arrays[-1]
        self.misses += 1
        array = xp.empty(shape, dtype)
        if self.pooled_bytes + array.nbytes > self.max_bytes:
            self.release_free()
        if self.pooled_bytes + array.nbytes <= self.max_bytes:
            arrays.append(array)
            self.pooled_bytes += array.nbytes
        return array

    def holds(self, array: Any) -> bool:
        """True when `array` is one this pool handed out (the pool keeps a reference to it)."""
        key = (type(array).__module__.split(".")[0], array.shape, array.dtype)
        return any(pooled is array for pooled in self._arrays.get(key, ()))

    def free_bytes(self) -> int:
        """Bytes of pooled arrays that nobody holds now (ready to be handed out again)."""
        pools = self._arrays.values()
        return sum(arrays[index].nbytes for arrays in pools for index in _free_indices(arrays))

    def release_free(self) -> None:
        """Drop every array nobody holds (PyTorch's empty_cache); arrays in use stay pooled."""
        for key, arrays in list(self._arrays.items()):
            # From the last to the first: popping one leaves the indices before it in place.
            for index in reversed(list(_free_indices(arrays))):
                self.pooled_bytes -= arrays.pop(index).nbytes
            if not arrays:
                del self._arrays[key]
