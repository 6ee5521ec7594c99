"""Collect named arrays from every rank of a group onto one (checkpoints, evaluation, timelines).

The group is a pipeline's stages, ZeRO's replicas, a tensor-parallel group or the whole job. Each
rank sends a small JSON header (names, dtypes, shapes) as bytes, then the arrays themselves as raw
bytes: the receiver learns the shapes first, so nothing is pickled.
"""

import json

import numpy as np

from minimp.backend import Array, to_numpy
from minimp.distributed.protocol import Communicator, Tag
from minimp.precision.casting import ACTIVATION_DTYPES


def _dtype_from_name(name: str) -> np.dtype:
    for dtype in ACTIVATION_DTYPES.values():
        if dtype.name == name:
            return dtype
    return np.dtype(name)


def gather_named_arrays(comm: Communicator, arrays: dict[str, Array],
                        root: int = 0) -> dict[str, np.ndarray] | None:
    """On root: the union of every rank's {name: host array}; on other ranks: None."""
    if comm.rank != root:
        host = {name: np.ascontiguousarray(to_numpy(array)) for name, array in arrays.items()}
        layouts = [[name, a.dtype.name, list(a.shape)] for name, a in host.items()]
        header = json.dumps(layouts).encode()
        comm.send(np.array([len(header)], np.int64), root, tag=Tag.GATHER_ARRAYS)
        comm.send(np.frombuffer(header, np.uint8).copy(), root, tag=Tag.GATHER_ARRAYS)
        for array in host.values():
            comm.send(array, root, tag=Tag.GATHER_ARRAYS)
        return None
    merged = {name: to_numpy(array) for name, array in arrays.items()}
    for source in range(comm.size):
        if source == root:
            continue
        length = np.empty(1, np.int64)
        comm.recv(length, source, tag=Tag.GATHER_ARRAYS)
        received = np.empty(int(length[0]), np.uint8)
        comm.recv(received, source, tag=Tag.GATHER_ARRAYS)
        for name, dtype, shape in json.loads(received.tobytes().decode()):
            array = np.empty(shape, _dtype_from_name(dtype))
            comm.recv(array, source, tag=Tag.GATHER_ARRAYS)
            merged[name] = array
    return merged
