"""Reading every array of an .npz archive, one thread at a time.

The simulated world runs its ranks as threads of one process, and each rank reads the digits and
its checkpoint. NumPy parses each array's header with `ast.literal_eval`, and CPython 3.11 keeps
the AST constructor's recursion depth in per-interpreter state, not per thread: two threads
parsing at once can fail with "SystemError: AST constructor recursion depth mismatch" (seen here
on 3.11.7 in a 4-rank simulated pipeline run; CPython issue gh-106905). One lock around the reads
removes the race; a real MPI rank is a process of its own and never waits on it.
"""

import threading
from typing import IO, Union

import numpy as np

_READING = threading.Lock()


def read_arrays(source: Union[str, IO[bytes]]) -> dict[str, np.ndarray]:
    """{name: array} of every array in the .npz at `source` (a path or a binary file), read whole
    under one lock; ValueError when it holds a single bare array (an .npy) instead."""
    with _READING:
        loaded = np.load(source, allow_pickle=False)
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise ValueError("it holds a single array, not an .npz archive")
        with loaded as archive:
            return {name: archive[name] for name in archive.files}
