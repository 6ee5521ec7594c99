"""Checkpoints: one .npz of fp32 masters under stable names, optimizer and scaler state, flags.

Layout (readable with plain `numpy.load`, no pickle):
  meta                        JSON text: format, version, step, the flags a resume must repeat,
                              optimizer and scaler state
  master/<parameter name>     float32 master weights, e.g. master/0.weight
  optimizer/<name>/<slot>     float32 optimizer slots, e.g. optimizer/0.weight/exp_avg
  fp8/<quantizer>/<field>     fp8 delayed scaling's state, float32: amax_history and scale, e.g.
                              fp8/1.attn.c_attn.input/scale (only --precision fp8 runs)
The batch order is a pure function of (seed, step, batch size) (minimp.data), so those flags and
the step are all the random state a resume needs. Everything read is checked before anything is
loaded: a file that cannot continue the run correctly is one clear error naming what is wrong.

Versions: 1 was "minimp-checkpoint-1" (no batch size, no scaler configuration); 2 adds "version",
"flags" and the dynamic scaler's configuration. Version 1 files are still read; newer ones are
refused. The fp8 arrays came within version 2: a reader that does not know them ignores them.
"""

import json
import math
import os
import re
import zipfile
from typing import Any, Callable, Protocol

import numpy as np

from minimp import backend
from minimp.checkpoints.errors import CheckpointError, DivergenceError
from minimp.checkpoints.files import atomic_write
from minimp.models import mlp
from minimp.models.gpt import GPT, GPTConfig
from minimp.nn import Module
from minimp.npz import read_arrays
from minimp.optim import Optimizer
from minimp.precision import LossScaler, widen

FORMAT = "minimp-checkpoint"
VERSION = 2
SCALER_KINDS = ("dynamic", "static", "none")


def state_arrays(names: list[str], optimizer: Optimizer) -> dict[str, np.ndarray]:
    """One stage's {array name: host array}: these parameters' masters and optimizer slots."""
    arrays = {}
    slots_by_index = optimizer.state_dict()["slots"]
    for name, master, slots in zip(names, optimizer.master_weights, slots_by_index):
        # widen: a bf16 weight without a master (--master-weights none) is saved as float32,
        # exactly, so every checkpoint keeps one format
        arrays[f"master/{name}"] = backend.to_numpy(widen(master))
        for slot, value in slots.items():
            arrays[f"optimizer/{name}/{slot}"] = backend.to_numpy(value)
    return arrays


def strip_prefix(arrays: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """The arrays whose names start with `prefix` ("master/", "fp8/"), named by the rest."""
    return {name[len(prefix):]: array for name, array in arrays.items() if name.startswith(prefix)}


def save(path: str, *, step: int, flags: dict[str, Any], optimizer: Optimizer, scaler: LossScaler,
         arrays: dict[str, Any], schedule: dict[str, Any] | None = None) -> None:
    """Write the checkpoint atomically. `arrays` holds every stage's state_arrays; `flags` the
    settings a resume must repeat ({"--seed": 0, ...}); optimizer and scaler give the step count,
    learning rate and scaler state, which all stages share; `schedule` the learning-rate
    schedule's resolved settings, which a resume continues unless told otherwise."""
    for name, array in arrays.items():  # a diverged run must not replace a good checkpoint
        if name.startswith("master/") and not np.isfinite(array).all():
            raise DivergenceError(
                f"{name} holds inf or NaN after step {step}: the model diverged (lower --lr, clip "
                f"with --max-grad-norm); not saved, {path} is left as it was")
    optimizer_state = optimizer.state_dict()
    meta = {"format": FORMAT, "version": VERSION, "step": step, "flags": flags,
            "optimizer": {"kind": type(optimizer).__name__,
                          "step_count": optimizer_state["step_count"], "lr": optimizer_state["lr"]},
            "scaler": scaler.state_dict(), "schedule": schedule or {}}
    arrays = {"meta": np.array(json.dumps(meta)), **arrays}
    try:
        atomic_write(path, lambda file: np.savez(file, **arrays))
    except OSError as error:  # a full disk: the temporary file is gone, the old one intact
        raise CheckpointError(f"checkpoint {path} could not be written after step {step} "
                              f"({error.strerror or error}); the file there is as it was") from None


# What minimp.train --dataset accepts (train.config's DATASET_DEFAULTS, which checkpoints may not
# import; a test keeps the two equal): the model a checkpoint holds follows from it.
DATASETS = ("digits", "shakespeare")


def checked_dataset(path: str, flags: dict[str, Any]) -> str:
    """The checkpoint's --dataset, or CheckpointError when its flags lack a known one (sample and
    export have no flags of their own to compare a checkpoint's with, so they check them here)."""
    if "--dataset" not in flags:
        raise CheckpointError(f"checkpoint {path}: its flags lack --dataset (one of "
                              f"{', '.join(DATASETS)}); the file was edited or not written by "
                              "--save")
    if flags["--dataset"] not in DATASETS:
        raise CheckpointError(f"checkpoint {path}: --dataset {flags['--dataset']!r} is not one of "
                              f"{', '.join(DATASETS)}; the file was edited or not written by "
                              "--save")
    return flags["--dataset"]


def checked_gpt(path: str, flags: dict[str, Any], masters: dict[str, np.ndarray],
                vocab_size: int) -> GPT:
    """The GPT a checkpoint's flags build (float32, its weights not yet loaded), after every flag
    and master is checked, or CheckpointError naming the field and what it should be. The arrays
    are the truth: each flag that sizes an array is compared with it before a model of that size
    is built (an edited --context 1e9 would allocate 119 GiB); then every master (named without
    "master/") against the built model's parameters."""
    if flags.get("--experts"):
        raise CheckpointError(f"checkpoint {path}: a mixture of experts (--experts "
                              f"{flags['--experts']}), which this command does not read yet")
    layers, width, heads, context = _model_sizes(path, flags, "--layers", "--hidden", "--heads",
                                                 "--context")
    if width % heads:
        raise CheckpointError(f"checkpoint {path}: --heads {heads} does not divide --hidden {width}"
                              " (each head takes hidden / heads channels)")
    _check_array(path, "master/0.wte.weight", masters.get("0.wte.weight"), (vocab_size, width),
                 f"--hidden {width}")
    _check_array(path, "master/0.wpe.weight", masters.get("0.wpe.weight"), (context, width),
                 f"--context {context}")
    # The final LayerNorm follows the blocks (Embeddings, blocks, Head): its index counts them.
    final = [int(found[1]) for found in map(re.compile(r"(\d+)\.ln_f\.weight").fullmatch, masters)
             if found]
    if final != [layers + 1]:
        held = f"hold {final[0] - 1} blocks" if len(final) == 1 else "lack a final LayerNorm"
        raise CheckpointError(f"checkpoint {path}: --layers {layers}: its masters {held}; the "
                              "file was edited or not written by --save")
    config = GPTConfig(vocab_size=vocab_size, context=context, layers=layers, heads=heads,
                       width=width)
    model = GPT(config, np.random.default_rng(0))  # no larger than the masters, checked above
    _check_masters(path, masters, model)
    return model


def check_mlp(path: str, flags: dict[str, Any], masters: dict[str, np.ndarray], features: int,
              classes: int) -> None:
    """Raise CheckpointError unless the masters are those of the MLP its --layers and --hidden
    build (models.mlp.build_model), each flag checked against the arrays before it is built."""
    layers, hidden = _model_sizes(path, flags, "--layers", "--hidden")
    if len(masters) != 2 * layers + 2:  # a weight and a bias per Linear
        raise CheckpointError(f"checkpoint {path}: --layers {layers} needs {2 * layers + 2} "
                              f"masters (a weight and a bias per Linear), it holds {len(masters)}")
    _check_array(path, "master/0.weight", masters.get("0.weight"), (hidden, features),
                 f"--hidden {hidden}")
    model = mlp.build_model(features, classes, hidden, layers, np.random.default_rng(0))
    _check_masters(path, masters, model)


def _model_sizes(path: str, flags: dict[str, Any], *names: str) -> list[int]:
    """The values of the flags a model is built from, each checked to be an integer >= 1."""
    for name in names:
        if name not in flags:
            raise CheckpointError(f"checkpoint {path}: its flags lack {name} (an integer >= 1, "
                                  "which the model is built from); the file was edited")
        if not _is_int(flags[name], 1):
            raise CheckpointError(f"checkpoint {path}: {name} {flags[name]!r} is not an integer "
                                  ">= 1; the file was edited or not written by --save")
    return [flags[name] for name in names]


def _check_masters(path: str, masters: dict[str, np.ndarray], model: Module) -> None:
    """The model's parameters' masters, each as _check_array checks it, and no other."""
    expected = {name: parameter.shape for name, parameter in model.named_parameters()}
    source = "the model of its flags"
    for name, shape in expected.items():
        _check_array(path, f"master/{name}", masters.get(name), shape, source)
    for name in masters:
        if name not in expected:
            raise CheckpointError(f"checkpoint {path}: master/{name} is not in {source}")


def _check_array(path: str, key: str, array: np.ndarray | None, shape: tuple[int, ...],
                 source: str) -> None:
    """The checkpoint's array `key` present, of the shape `source` (the flags, the model) needs,
    float32 as every master and optimizer slot, finite."""
    if array is None:
        raise CheckpointError(f"checkpoint {path} lacks {key}, which {source} has")
    if array.shape != shape:
        raise CheckpointError(f"checkpoint {path}: {key} has shape {array.shape}, {source} needs "
                              f"{shape}")
    if array.dtype != np.float32:
        raise CheckpointError(f"checkpoint {path}: {key} is {array.dtype}, not float32")
    if not np.isfinite(array).all():
        raise CheckpointError(f"checkpoint {path}: {key} holds inf or NaN")


def read(path: str) -> tuple[dict, dict[str, np.ndarray]]:
    """(meta, {array name: array}) from a checkpoint file whose meta is complete and well typed,
    or CheckpointError saying what is wrong."""
    if os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} is a folder, not a checkpoint file (give the "
                              "path of the .npz that --save wrote)")
    if os.path.exists(path) and not os.path.isfile(path):
        raise CheckpointError(f"checkpoint {path} is not a regular file (a device, a pipe, a "
                              "socket); give the path of the .npz that --save wrote")
    if not os.path.isfile(path):
        why = "is a link that leads nowhere" if os.path.islink(path) else "does not exist"
        raise CheckpointError(f"checkpoint {path} {why} (check the path)")
    try:
        arrays = read_arrays(path)  # refuses an .npy renamed (one bare array) with ValueError
        meta = json.loads(str(arrays.pop("meta")))
    except (zipfile.BadZipFile, ValueError, KeyError, OSError, EOFError) as error:
        # NumPy's advice to load pickles "if you trust the file" is no advice for a checkpoint
        why = "it holds pickled objects, not arrays" if "pickle" in str(error) else str(error)
        raise CheckpointError(f"checkpoint {path} is not a readable minimp checkpoint ({why}); "
                              "it may be truncated or not an .npz written by --save") from None
    return _checked_meta(path, meta), arrays


def _checked_meta(path: str, meta: Any) -> dict:
    """The meta of a known version with every field present and of the right type and range."""

    def fail(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {path}: {what}")

    if not isinstance(meta, dict):
        raise fail("its metadata is not a JSON object")
    if meta.get("format") == "minimp-checkpoint-1":
        meta = _upgraded_from_version_1(meta)
    if meta.get("format") != FORMAT:
        raise fail(f"format {meta.get('format')!r} is not {FORMAT!r}")
    version = meta.get("version")
    if not _is_int(version, 1):
        raise fail(f"format version {version!r} is unknown (this minimp reads versions 1 to "
                   f"{VERSION})")
    if version > VERSION:
        raise fail(f"written by a newer minimp (format version {version}; this one reads up to "
                   f"{VERSION}): upgrade minimp to resume it")
    for key in ("step", "flags", "optimizer", "scaler"):
        if key not in meta:
            raise fail(f"its metadata lacks {key!r}")
    if not _is_int(meta["step"], 0):
        raise fail(f"step {meta['step']!r} is not an integer >= 0")
    for key in ("flags", "optimizer", "scaler"):
        if not isinstance(meta[key], dict):
            raise fail(f"{key} is {meta[key]!r}, not a JSON object")
    optimizer = meta["optimizer"]
    if not isinstance(optimizer.get("kind"), str) or not _is_int(optimizer.get("step_count"), 0):
        raise fail(f"optimizer state {optimizer!r} needs a kind and a step_count >= 0")
    lr = optimizer.get("lr")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise fail(f"optimizer lr {lr!r} is not a positive finite number")
    scaler = meta["scaler"]
    if scaler.get("kind") not in SCALER_KINDS:
        raise fail(f"loss scaler kind {scaler.get('kind')!r} is not one of {SCALER_KINDS}")
    scale = scaler.get("loss_scale")
    number = isinstance(scale, (int, float)) and not isinstance(scale, bool)  # JSON true is 1
    if not (number and math.isfinite(scale) and scale > 0):
        raise fail(f"loss scale {scale!r} is not a positive finite number")
    schedule = meta.get("schedule", {})
    if not isinstance(schedule, dict):
        raise fail(f"schedule is {schedule!r}, not a JSON object")
    if "lr_decay_steps" in schedule and not _is_int(schedule["lr_decay_steps"], 1):
        raise fail(f"lr_decay_steps {schedule['lr_decay_steps']!r} is not an integer >= 1")
    return meta


def _upgraded_from_version_1(meta: dict) -> dict:
    """A version-1 meta in version 2's shape (its batch size was not recorded, so not checked)."""
    model = meta.get("model") if isinstance(meta.get("model"), dict) else {}
    optimizer = meta.get("optimizer") if isinstance(meta.get("optimizer"), dict) else {}
    flags = {f"--{key}": value for key, value in model.items()}
    flags["--seed"] = meta.get("seed")
    flags["--optimizer"] = str(optimizer.get("kind", "")).lower()
    upgraded = {key: value for key, value in meta.items() if key not in ("model", "seed")}
    return {**upgraded, "format": FORMAT, "version": 1, "flags": flags}


def _is_int(value: Any, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


class Fp8State(Protocol):
    """What restore needs of a run's fp8 scaling state (minimp/train/fp8.py's Fp8Run)."""

    def checked_state(self, path: str, arrays: dict[str, np.ndarray]) -> dict | None:
        """This stage's state from the checkpoint's arrays, checked; None when there is none."""

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Load what checked_state returned."""


def differing_flag(saved: dict[str, Any], flags: dict[str, Any]) -> tuple[str, str] | None:
    """The first of this run's `flags` that a checkpoint's `saved` flags hold with another value,
    as (flag, "--hidden 16, this run has --hidden 32"); values of another type are quoted ("16"
    is not 16). None when all agree; a flag the file lacks is not compared."""
    for flag, value in flags.items():
        if flag in saved and (saved[flag] != value or type(saved[flag]) is not type(value)):
            same_type = type(saved[flag]) is type(value)
            theirs, ours = (saved[flag], value) if same_type else (repr(saved[flag]), repr(value))
            return flag, f"{flag} {theirs}, this run has {flag} {ours}"
    return None


def restore(path: str, *, flags: dict[str, Any], steps: int, names: list[str], optimizer: Optimizer,
            scaler: LossScaler, fp8: Fp8State | None = None,
            select: Callable[[str, np.ndarray], np.ndarray] | None = None) -> tuple[int, dict]:
    """Check everything, then load masters, optimizer and scaler state (and with `fp8`, a
    train.fp8.Fp8Run, the fp8 scaling state of its stage); returns the step the checkpoint was
    saved after and its schedule settings. `flags`: this run's values of the settings a resume
    must repeat; `steps`: the run's --steps, which must lie beyond the checkpoint's step;
    `select(name, array)`: the part of each (whole) array this rank holds (--tp's shard), or
    ValueError saying why it cannot be cut."""
    meta, arrays = read(path)
    if select is not None:
        try:
            arrays = {name: select(name, array) for name, array in arrays.items()}
        except ValueError as error:
            raise CheckpointError(f"checkpoint {path}: {error}") from None
    # Every flag a resume must repeat is in the file, but those a file of its kind never held:
    # version 1 kept no batch size, a run without fp8 state no fp8 settings.
    optional = {"--batch-size"} if meta["version"] == 1 else set()
    if not any(name.startswith("fp8/") for name in arrays):
        optional |= {flag for flag in flags if flag.startswith("--fp8-")}
    for flag in flags:
        if flag not in meta["flags"] and flag not in optional:
            raise CheckpointError(f"checkpoint {path}: its flags lack {flag}, which a resume must "
                                  "repeat; the file was edited or not written by --save")
    differing = differing_flag(meta["flags"], flags)
    if differing is not None:
        flag, said = differing
        raise CheckpointError(
            f"checkpoint {path} was trained with {said}: resume with the same {flag} (the model, "
            "the batch order, the optimizer state or the fp8 scaling state depend on it)")
    if meta["step"] >= steps:
        raise CheckpointError(
            f"checkpoint {path} was saved after step {meta['step']}; --steps {steps} leaves "
            f"nothing to run (use --steps {meta['step'] + 1} or more)")
    if meta["optimizer"]["kind"] != type(optimizer).__name__:  # its slots mean other things
        raise CheckpointError(f"checkpoint {path} holds {meta['optimizer']['kind']}'s state, this "
                              f"run's optimizer is {type(optimizer).__name__}")
    _check_arrays(path, arrays, names, optimizer, meta["optimizer"]["step_count"])
    fp8_state = fp8.checked_state(path, arrays) if fp8 is not None else None
    kind, saved = scaler.state_dict()["kind"], meta["scaler"]
    if saved["kind"] != kind:  # say it in flags: the scaler's kind is what they chose
        flag = f"{saved['loss_scale']:g}" if saved["kind"] == "static" else saved["kind"]
        raise CheckpointError(
            f"checkpoint {path} was trained with {_scale_words(saved['kind'])}, and this run's "
            f"--precision and --loss-scale give it {_scale_words(kind)}: resume with the "
            f"checkpoint's --precision, or pass --loss-scale {flag}")
    try:  # the scaler checks its own state; fields a version-1 file lacks keep this run's
        scaler.load_state_dict({**scaler.state_dict(), **meta["scaler"]})
    except ValueError as error:
        raise CheckpointError(f"checkpoint {path}: loss scaler state: {error}") from None
    for index, name in enumerate(names):
        optimizer.set_master_weight(index, backend.to_device(arrays[f"master/{name}"]))
    slots = [{slot: backend.to_device(arrays[f"optimizer/{name}/{slot}"])
              for slot in optimizer.slot_names if f"optimizer/{name}/{slot}" in arrays}
             for name in names]
    step_count = meta["optimizer"]["step_count"]
    optimizer.load_state_dict({"step_count": step_count, "lr": optimizer.lr, "slots": slots})
    if fp8_state is not None:
        fp8.load_state(fp8_state)
    return meta["step"], meta.get("schedule", {})


def _scale_words(kind: str) -> str:
    """A loss scaler's kind in words: "no loss scale", "a dynamic loss scale"."""
    return "no loss scale" if kind == "none" else f"a {kind} loss scale"


def _check_arrays(path: str, arrays: dict, names: list[str], optimizer: Optimizer,
                  step_count: int) -> None:
    """Every master and optimizer slot this stage needs: present, float32, shaped like the
    model's parameter, finite."""
    for name, master in zip(names, optimizer.master_weights):
        expected = [f"master/{name}"]
        if step_count > 0:  # slots exist once the optimizer has stepped
            expected += [f"optimizer/{name}/{slot}" for slot in _slots_in_use(optimizer)]
        for key in expected:
            array = arrays.get(key)
            _check_array(path, key, array, master.shape, "the model")
            if key.endswith("/exp_avg_sq") and (array < 0).any():  # a mean of squares
                raise CheckpointError(f"checkpoint {path}: {key} holds negative values, which a "
                                      "mean of squared gradients cannot")


def _slots_in_use(optimizer: Optimizer) -> tuple[str, ...]:
    """The slots an optimizer keeps once it has stepped (SGD without momentum keeps none)."""
    if optimizer.slot_names == ("momentum_buffer",) and not getattr(optimizer, "momentum", 0):
        return ()
    return optimizer.slot_names
