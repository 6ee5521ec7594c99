"""`python -m minimp.export ckpt.npz out.safetensors`: the weights, for the world outside minimp.

    python -m minimp.export gpt.npz --format safetensors gpt.safetensors            # float32
    python -m minimp.export gpt.npz --format safetensors gpt16.safetensors --dtype fp16

Writes the model's float32 masters (or their rounding to --dtype) in the safetensors format that
PyTorch, JAX and Hugging Face load, with PyTorch's layout (`nn.Linear` weights as (out, in), as
minimp keeps them) and, for the GPT, nanoGPT's tensor names: `transformer.wte.weight`,
`transformer.h.0.attn.c_attn.weight`, ..., `transformer.ln_f.weight`. The head is tied to the token
embedding, so its weight is stored once, under `transformer.wte.weight`; a loader sets
`lm_head.weight = transformer.wte.weight` (nanoGPT does the same: its state dict holds one tensor
under both names). Beside the file, `out.json` says what was written: the model, its shape, the
vocabulary, the dtype and the tie. The MLP keeps minimp's names ("0.weight"), which are also
those of a `torch.nn.Sequential` of the same layers. The export never writes over the checkpoint
it reads, and over a file already there only with --force. Before anything is written, the flags
the model is built from are checked against the masters (an edited checkpoint is one line, not a
file that disagrees with its config), and a --dtype that would turn a weight into inf is refused;
a write that fails (a full disk) leaves neither file.
"""

import argparse
import json
import os
import sys

import ml_dtypes
import numpy as np

from minimp.checkpoints import checkpoint
from minimp.checkpoints.errors import CommandParser, ConfigError, run_command
from minimp.checkpoints.files import (atomic_write, check_output_path, exit_cleanly_on_sigterm,
                                      same_file)
from minimp.data import load_digits, load_shakespeare
from minimp.precision.casting import ACTIVATION_DTYPES, round_to

PROGRAM = "minimp.export"


def nanogpt_name(name: str, layers: int) -> str:
    """minimp's GPT parameter name -> nanoGPT's ("3.attn.c_attn.weight" ->
    "transformer.h.2.attn.c_attn.weight"); layer 0 holds the embeddings, layer layers + 1 the
    final LayerNorm."""
    index, rest = name.split(".", 1)
    if int(index) in (0, layers + 1):  # the embeddings, the final LayerNorm
        return f"transformer.{rest}"
    return f"transformer.h.{int(index) - 1}.{rest}"


def exported_tensors(path: str, meta: dict, arrays: dict, dtype: str) -> tuple[dict, dict]:
    """({name: array}, config) of a checkpoint's masters, named for the world outside, after the
    flags the model is built from are checked against the masters (checkpoint.checked_gpt and
    check_mlp), or CheckpointError naming the field and what it should be."""
    flags = meta["flags"]
    masters = checkpoint.strip_prefix(arrays, "master/")
    if checkpoint.checked_dataset(path, flags) == "shakespeare":
        vocabulary = load_shakespeare().vocabulary
        gpt = checkpoint.checked_gpt(path, flags, masters, vocab_size=len(vocabulary)).config
        tensors = {nanogpt_name(name, gpt.layers): array for name, array in masters.items()}
        config = {"model": "gpt", "vocab_size": gpt.vocab_size, "block_size": gpt.context,
                  "n_layer": gpt.layers, "n_head": gpt.heads, "n_embd": gpt.width,
                  "bias": any(name.endswith("bias") for name in masters),
                  "lm_head": "tied to transformer.wte.weight (stored once)",
                  "vocabulary": vocabulary}
    else:
        digits = load_digits()
        checkpoint.check_mlp(path, flags, masters, digits.features, digits.classes)
        tensors = masters
        config = {"model": "mlp", "layers": flags["--layers"], "hidden": flags["--hidden"]}
    config["dtype"] = np.dtype(ACTIVATION_DTYPES[dtype]).name
    config["step"] = meta["step"]
    return {name: rounded(name, array, dtype) for name, array in tensors.items()}, config


def rounded(name: str, array: np.ndarray, dtype: str) -> np.ndarray:
    """The float32 master rounded to --dtype, or ConfigError when a weight overflows it to inf
    (a weight that rounds to 0 is ordinary rounding and is kept)."""
    stored = np.ascontiguousarray(round_to(array, ACTIVATION_DTYPES[dtype]))
    if not np.isfinite(stored).all():  # the masters are finite (checked): the cast overflowed
        def largest(flag: str) -> float:
            return float(ml_dtypes.finfo(ACTIVATION_DTYPES[flag]).max)

        wider = sorted((flag for flag in ACTIVATION_DTYPES if largest(flag) > largest(dtype)),
                       key=lambda flag: np.dtype(ACTIVATION_DTYPES[flag]).itemsize)  # small first
        raise ConfigError(f"--dtype {dtype}: {name} holds |weight| {float(np.abs(array).max()):g}"
                          f", above {dtype}'s largest {largest(dtype):g}; export with --dtype "
                          f"{' or '.join(wider)}")
    return stored


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(PROGRAM, "Export a minimp checkpoint's weights for other libraries.")
    parser.add_argument("checkpoint", help="a checkpoint (.npz) written by minimp.train --save")
    parser.add_argument("output", help="the file to write (its config goes beside, as .json)")
    parser.add_argument("--format", default="safetensors", choices=("safetensors",))
    parser.add_argument(
        "--dtype", default="fp32", choices=tuple(ACTIVATION_DTYPES), help="the stored dtype")
    parser.add_argument("--force", action="store_true",
                        help="replace an output or config file that exists (never the checkpoint)")
    return parser


def main(argv: list[str] | None = None) -> int:
    exit_cleanly_on_sigterm()
    args = build_parser().parse_args(argv)
    return run_command(PROGRAM, lambda: export(args))


def check_nothing_is_lost(checkpoint_path: str, output: str, config_path: str,
                          force: bool) -> None:
    """Raise ConfigError before anything is written where the export would destroy a file: the
    checkpoint it reads (never), its own output under its config's name (never), or a file that
    is already there (only with --force, which replaces it)."""
    for flag, path in (("output", output), ("config", config_path)):
        if same_file(path, checkpoint_path):
            raise ConfigError(f"{flag} {path} is the checkpoint being exported; write the export "
                              "to another name")
    if same_file(output, config_path):
        raise ConfigError(f"output {output}: its config is written beside it as {config_path}, "
                          "the same file; give the output another extension (.safetensors)")
    for flag, path in (("output", output), ("config", config_path)):
        if os.path.exists(path) and not force:
            raise ConfigError(f"{flag} {path} exists; pass --force to replace it, or choose "
                              "another name")


def write_both(contents: dict[str, bytes]) -> None:
    """Write each file atomically; when one cannot be written (a full disk), remove those written
    before it and raise ConfigError: the output and its config exist together or not at all."""
    written: list[str] = []
    try:
        for path, content in contents.items():
            atomic_write(path, lambda file: file.write(content))
            written.append(path)
    except OSError as error:  # atomic_write has removed its temporary file
        for path in written:
            os.unlink(path)
        raise ConfigError(f"{path} could not be written ({error.strerror or error}); nothing was "
                          "exported: free some space or choose another path") from None


def export(args: argparse.Namespace) -> int:
    """Check the output paths and the checkpoint, then write the tensors and their config."""
    config_path = os.path.splitext(args.output)[0] + ".json"
    try:
        from safetensors.numpy import save
    except ImportError:
        raise ConfigError("--format safetensors needs: pip install 'minimp[export]'") from None
    check_output_path("output", args.output)  # first: it makes folders, after every refusal
    check_output_path("config", config_path)
    check_nothing_is_lost(args.checkpoint, args.output, config_path, args.force)
    meta, arrays = checkpoint.read(args.checkpoint)
    tensors, config = exported_tensors(args.checkpoint, meta, arrays, args.dtype)
    write_both({args.output: save(tensors, metadata={"format": "pt"}),
                config_path: json.dumps(config, indent=1).encode()})
    print(f"wrote {len(tensors)} tensors to {args.output} and the config to {config_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
