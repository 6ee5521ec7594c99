"""Checkpoints of a tensor-parallel run in the one-process format: shards joined into whole arrays
on save, a rank's shard cut from the whole array on resume.

A checkpoint names arrays by parameter ("master/3.attn.c_attn.weight", "optimizer/<name>/exp_avg")
and holds them whole, whatever the layout that wrote it, so a --tp 2 checkpoint resumes on one
process and back. The shards of a cut parameter are gathered onto tensor-parallel rank 0 and joined
(layers.py: join_shards); a whole parameter, and fp8's scaling state (the same on every
rank once its amaxes are MAX-reduced), is rank 0's own copy.
"""

from typing import Callable

import numpy as np

from minimp.distributed.gather import gather_named_arrays
from minimp.distributed.protocol import Communicator
from minimp.parallel.tensor.layers import join_shards, take_shard


def parameter_of(key: str) -> str | None:
    """The parameter a checkpoint array belongs to ("master/<name>", "optimizer/<name>/<slot>"),
    or None for the others (fp8 state)."""
    kind, _, rest = key.partition("/")
    return rest.split("/")[0] if kind in ("master", "optimizer") else None


def gather_shards(comm: Communicator, state: dict[str, np.ndarray],
                  cut: dict[str, tuple[int, int]]) -> dict[str, np.ndarray] | None:
    """On tensor-parallel rank 0: `state` with every cut parameter's arrays whole (joined from
    every rank's shard, sent as raw bytes); None on the other ranks. `cut`: the plan's
    partitions ({name: (axis, sections)})."""
    if comm.size == 1:
        return state
    sharded = [key for key in state if parameter_of(key) in cut]
    gathered = gather_named_arrays(comm, {f"{comm.rank}:{key}": state[key] for key in sharded})
    if gathered is None:
        return None
    whole = dict(state)
    for key in sharded:
        axis, sections = cut[parameter_of(key)]  # type: ignore[index]
        shards = [gathered[f"{rank}:{key}"] for rank in range(comm.size)]
        whole[key] = join_shards(shards, axis, sections)
    return whole


def shard_selector(cut: dict[str, tuple[int, int]], rank: int,
                   ranks: int) -> Callable[[str, np.ndarray], np.ndarray]:
    """select(key, whole array) -> this rank's part of it: the shard of a cut parameter (ValueError
    naming the shapes when the array is not the whole parameter), anything else as it is."""

    def select(key: str, array: np.ndarray) -> np.ndarray:
        name = parameter_of(key)
        if name not in cut:
            return array
        axis, sections = cut[name]
        if array.ndim <= axis or array.shape[axis] % (sections * ranks):
            raise ValueError(f"{key} has shape {array.shape}, which does not split over --tp "
                             f"{ranks} (a checkpoint of another model?)")
        return take_shard(array, axis, sections, rank, ranks)

    return select
