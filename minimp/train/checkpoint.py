"""Checkpoints: one .npz of fp32 masters under stable names, optimizer and scaler state, step, seed.

Layout (readable with plain `numpy.load`, no pickle):
  meta                        JSON text: format, step, seed, model shape, optimizer and scaler state
  master/<parameter name>     float32 master weights, e.g. master/0.weight
  optimizer/<name>/<slot>     float32 optimizer slots, e.g. optimizer/0.weight/exp_avg
The batch order is a pure function of (seed, step) (minimp.data.global_batch_indices), so seed
and step are all the random state a resume needs.
"""

import json
import os
import tempfile
import zipfile
from typing import Any

import numpy as np

from minimp import backend
from minimp.optim import Optimizer
from minimp.precision import LossScaler

FORMAT = "minimp-checkpoint-1"


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or written for another model or run."""


def state_arrays(names: list[str], optimizer: Optimizer) -> dict[str, np.ndarray]:
    """One stage's {array name: host array}: these parameters' masters and optimizer slots."""
    arrays = {}
    for name, master, slots in zip(
        names, optimizer.master_weights, optimizer.state_dict()["slots"]
    ):
        arrays[f"master/{name}"] = backend.to_numpy(master)
        for slot, value in slots.items():
            arrays[f"optimizer/{name}/{slot}"] = backend.to_numpy(value)
    return arrays


def save(
    path: str,
    *,
    step: int,
    seed: int,
    model_shape: dict,
    optimizer: Optimizer,
    scaler: LossScaler,
    arrays: dict[str, Any],
) -> None:
    """Write the checkpoint atomically (a temporary file in the same folder, then a rename).
    `arrays` holds every stage's state_arrays; optimizer and scaler give the step count and scale,
    which all stages share."""
    optimizer_state = optimizer.state_dict()
    meta = {
        "format": FORMAT,
        "step": step,
        "seed": seed,
        "model": model_shape,
        "optimizer": {
            "kind": type(optimizer).__name__,
            "step_count": optimizer_state["step_count"],
            "lr": optimizer_state["lr"],
        },
        "scaler": scaler.state_dict(),
    }
    arrays = {"meta": np.array(json.dumps(meta)), **arrays}
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(handle, "wb") as file:
            np.savez(file, **arrays)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        os.unlink(temporary)
        raise


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta dict, {array name: array}) from a checkpoint file,
    or CheckpointError saying what is wrong."""
    if not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} does not exist (check the --resume path)")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as error:
        raise CheckpointError(
            f"checkpoint {path} is not a readable minimp checkpoint ({error}); "
            "it may be truncated or not an .npz written by --save"
        ) from None
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"checkpoint {path} has format {meta.get('format')!r}, expected {FORMAT!r}"
        )
    return meta, arrays


def restore(
    path: str,
    *,
    seed: int,
    model_shape: dict,
    names: list[str],
    optimizer: Optimizer,
    scaler: LossScaler,
) -> int:
    """Load masters, optimizer and scaler state; returns the step the checkpoint was saved after."""
    meta, arrays = read(path)
    if meta["model"] != model_shape:
        saved = " ".join(f"--{k} {v}" for k, v in meta["model"].items())
        raise CheckpointError(
            f"checkpoint {path} was written for a different model ({saved}); "
            "run with the same flags to resume it"
        )
    if meta["seed"] != seed:
        raise CheckpointError(
            f"checkpoint {path} was trained with --seed {meta['seed']}; resume with "
            "the same --seed so the batch order continues"
        )
    kind = type(optimizer).__name__
    if meta["optimizer"]["kind"] != kind:
        raise CheckpointError(
            f"checkpoint {path} holds {meta['optimizer']['kind']} state but this run "
            f"uses {kind} (pass the same --optimizer)"
        )
    missing = [name for name in names if f"master/{name}" not in arrays]
    if missing:
        raise CheckpointError(f"checkpoint {path} lacks master weights {missing}")
    for name, master in zip(names, optimizer.master_weights):
        if arrays[f"master/{name}"].shape != master.shape:
            raise CheckpointError(
                f"checkpoint {path}: {name} has shape {arrays[f'master/{name}'].shape}, "
                f"the model expects {master.shape}"
            )
    for index, name in enumerate(names):
        optimizer.set_master_weight(index, backend.to_device(arrays[f"master/{name}"]))
    slots = [
        {
            slot: backend.to_device(arrays[f"optimizer/{name}/{slot}"])
            for slot in optimizer.slot_names
            if f"optimizer/{name}/{slot}" in arrays
        }
        for name in names
    ]
    optimizer.load_state_dict(
        {"step_count": meta["optimizer"]["step_count"], "lr": optimizer.lr, "slots": slots}
    )
    if meta["scaler"]["kind"] == scaler.state_dict()["kind"]:
        scaler.load_state_dict(meta["scaler"])
    return int(meta["step"])
