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
from collections import deque
from types import ModuleType
from typing import Any, Iterator, Sequence

import numpy
from numpy.typing import DTypeLike

# Past this, freed arrays are dropped instead of cached: a run whose shapes keep changing (batches
# of other sizes, evaluation) would otherwise keep a block of every shape it ever saw.
DEFAULT_MAX_BYTES = 1 << 30
# How many arrays of one (shape, dtype) a request looks at from each end of their queue before it
# allocates a new one. A fixed number keeps a request O(1): looking at all of them made every
# request of a model with thousands of same-shaped activations (all in use during the forward) look
# at thousands, and a step quadratic in the layers (`--layers 16000 --hidden 2 --steps 1` took over
# a minute; 5 s with this bound). Arrays handed out or found in use move to the back, so the front
# holds the least recently looked at, where free ones gather: 16 loses few hits (a free array
# further in is reached as the ones before it move back).
SCAN = 16


def _reference_count(arrays: Sequence, index: int) -> int:
    """The reference count of arrays[index], as seen from here."""
    return sys.getrefcount(arrays[index])


# The count _reference_count reads for an array that only its list holds (the list's reference,
# and getrefcount's argument), measured rather than assumed, so it holds on any CPython version.
_FREE_REFERENCE_COUNT = _reference_count([numpy.empty(1)], 0)


def held_only_by(holder: Sequence, index: int, others: int = 0) -> bool:
    """True when nothing refers to holder[index] but `holder` and `others` known references: no
    other variable, container or view anywhere."""
    return _reference_count(holder, index) <= _FREE_REFERENCE_COUNT + others


def _free_indices(arrays: Sequence) -> Iterator[int]:
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
        self._arrays: dict[tuple, deque] = {}
        self._ids: set[int] = set()  # id() of every pooled array: holds() in O(1)

    def empty(self, shape: tuple[int, ...], dtype: DTypeLike, xp: ModuleType = numpy) -> Any:
        """An uninitialised array of this shape and dtype that shares memory with no live array."""
        key = (xp.__name__, tuple(shape), numpy.dtype(dtype))
        arrays = self._arrays.setdefault(key, deque())
        # A free one among the SCAN at the front, the least recently looked at (arrays freed a
        # while ago), then among the SCAN most recently handed out (a temporary freed at once).
        # Each one found in use at the front goes to the back, so the next request looks at
        # others (long held arrays never block the front). Plain loops, not _free_indices: every
        # op's allocation comes here, and a generator would add ~0.4 us to a hit's ~0.5.
        front = min(len(arrays), SCAN)
        for _ in range(front):
            if held_only_by(arrays, 0):
                self.hits += 1
                arrays.rotate(-1)  # handed out: to the back, with the arrays in use
                return arrays[-1]
            arrays.rotate(-1)
        newest = len(arrays) - 1 - front  # before the ones just moved to the back
        for index in range(newest, max(newest - SCAN, -1), -1):
            if held_only_by(arrays, index):
                self.hits += 1
                array = arrays[index]
                del arrays[index]
                arrays.append(array)
                return array
        self.misses += 1
        array = xp.empty(shape, dtype)
        if self.pooled_bytes + array.nbytes > self.max_bytes:
            self.release_free()
        if self.pooled_bytes + array.nbytes <= self.max_bytes:
            arrays = self._arrays.setdefault(key, deque())  # release_free may have dropped it
            arrays.append(array)
            self._ids.add(id(array))
            self.pooled_bytes += array.nbytes
        return array

    def holds(self, array: Any) -> bool:
        """True when `array` is one this pool handed out (the pool keeps a reference to it)."""
        return id(array) in self._ids  # a pooled array is alive, so its id is its own

    def free_bytes(self) -> int:
        """Bytes of pooled arrays that nobody holds now (ready to be handed out again)."""
        pools = self._arrays.values()
        return sum(arrays[index].nbytes for arrays in pools for index in _free_indices(arrays))

    def release_free(self) -> None:
        """Drop every array nobody holds (PyTorch's empty_cache); arrays in use stay pooled."""
        for key, arrays in list(self._arrays.items()):
            # From the last to the first: popping one leaves the indices before it in place.
            for index in reversed(list(_free_indices(arrays))):
                self._ids.discard(id(arrays[index]))
                self.pooled_bytes -= arrays[index].nbytes
                del arrays[index]
            if not arrays:
                del self._arrays[key]
