"""Edited copies of a good GPT checkpoint, one field changed each, and the line that a command
reading it (minimp.sample, minimp.export) must say instead of a traceback or a wrong file."""

import json

import numpy as np


def edited(good, path, flags=None, drop=(), arrays=None):
    """Write a copy of the checkpoint `good` at path with its flags updated by `flags`, the
    flags in `drop` removed and its arrays updated by `arrays`; return path as a string."""
    with np.load(good) as archive:
        content = {name: archive[name] for name in archive.files}
    meta = json.loads(str(content["meta"]))
    meta["flags"].update(flags or {})
    for flag in drop:
        meta["flags"].pop(flag)
    content.update(arrays or {})
    content["meta"] = np.array(json.dumps(meta))
    np.savez(path, **content)
    return str(path)


# (name, edit of a GPT checkpoint of --layers 2 --hidden 32 --heads 2 --context 16, what is said)
GPT_EDITS = [
    ("no-heads", dict(drop=["--heads"]), "its flags lack --heads"),
    ("heads-3", dict(flags={"--heads": 3}), "--heads 3 does not divide --hidden 32"),
    ("heads-text", dict(flags={"--heads": "2"}), "--heads '2' is not an integer >= 1"),
    ("context-0", dict(flags={"--context": 0}), "--context 0 is not an integer >= 1"),
    ("context-huge", dict(flags={"--context": 10**9}),
     "master/0.wpe.weight has shape (16, 32), --context 1000000000 needs (1000000000, 32)"),
    ("layers-3", dict(flags={"--layers": 3}), "--layers 3: its masters hold 2 blocks"),
    ("no-dataset", dict(drop=["--dataset"]), "its flags lack --dataset"),
    ("dataset-cifar", dict(flags={"--dataset": "cifar"}), "--dataset 'cifar' is not one of"),
    ("narrow-wte", dict(arrays={"master/0.wte.weight": np.zeros((65, 8), np.float32)}),
     "master/0.wte.weight has shape (65, 8), --hidden 32 needs (65, 32)"),
    ("wide-fc", dict(arrays={"master/1.mlp.c_fc.weight": np.zeros((64, 32), np.float32)}),
     "master/1.mlp.c_fc.weight has shape (64, 32), the model of its flags needs (128, 32)"),
    ("extra-master", dict(arrays={"master/9.wte.weight": np.zeros(3, np.float32)}),
     "master/9.wte.weight is not in the model of its flags"),
    ("nan-master", dict(arrays={"master/2.ln_2.bias": np.full(32, np.nan, np.float32)}),
     "master/2.ln_2.bias holds inf or NaN"),
]
