"""`python -m minimp.sample --resume ckpt.npz`: generate text with a GPT trained by minimp.train.

    python -m minimp.sample --resume gpt.npz --tokens 500 --prompt "ROMEO:" --temperature 0.8

Each new character is drawn from softmax(logits / temperature) of the last position (only the
`top_k` likeliest when given), with the last `--context` characters as the model's input; the draws
come from `--seed`, so the same flags print the same text, character by character as it is drawn
(a long generation shows its progress). The checkpoint is checked as a resume checks it, before
any work, and every error is one line naming the fix, exit 2.
"""

import argparse
import math
import sys
from collections import deque
from typing import Iterator

import numpy as np

from minimp import backend
from minimp.checkpoints import checkpoint
from minimp.checkpoints.errors import CheckpointError, CommandParser, ConfigError, run_command
from minimp.checkpoints.files import exit_cleanly_on_sigterm
from minimp.data import TextDataset, load_shakespeare
from minimp.models.gpt import GPT
from minimp.tensor import Tensor, no_grad

PROGRAM = "minimp.sample"
# The most characters one run draws. Each one reruns the model over the whole context (there is no
# key-value cache): a few milliseconds for the default GPT on a CPU, so a million (tiny-shakespeare
# itself is 1.1 million) is about an hour of printing; a larger request is a typo or a mistake,
# refused before the checkpoint is read.
MAX_TOKENS = 1_000_000


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(PROGRAM, "Generate text with a GPT checkpoint written by minimp.train.")
    parser.add_argument("--resume", required=True, help="a GPT checkpoint (.npz) from --save")
    parser.add_argument("--tokens", type=int, default=500,
                        help=f"characters to generate (at most {MAX_TOKENS:,})")
    parser.add_argument("--prompt", default="\n",
                        help="text the generation continues (default: a newline)")
    parser.add_argument("--temperature", type=float, default=0.8, help="> 0; lower is surer")
    parser.add_argument("--top-k", type=int, default=0, help="draw among the k likeliest (0: all)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the draws")
    return parser


def load_model(path: str) -> tuple[GPT, TextDataset]:
    """The GPT of a checkpoint (float32 masters) and the dataset it was trained on; the flags it
    is built from are checked against the masters first (checkpoint.checked_gpt)."""
    meta, arrays = checkpoint.read(path)
    flags = meta["flags"]
    dataset = checkpoint.checked_dataset(path, flags)
    if dataset != "shakespeare":
        raise CheckpointError(f"checkpoint {path} holds a model of --dataset {dataset}; "
                              "minimp.sample needs a GPT trained with --dataset shakespeare")
    data = load_shakespeare()
    masters = checkpoint.strip_prefix(arrays, "master/")
    model = checkpoint.checked_gpt(path, flags, masters, data.vocab_size)
    model.load_state_dict(masters)
    model.eval()
    return model, data


def draw(model: GPT, prompt_ids: np.ndarray, tokens: int, temperature: float, top_k: int,
         seed: int) -> Iterator[int]:
    """Yield `tokens` ids drawn after prompt_ids, one at a time, as each is drawn (no cache: each
    step reads the last context, and only the last context is kept, however many are drawn)."""
    context = model.config.context
    rng, ids = np.random.default_rng(seed), deque(prompt_ids, maxlen=context)
    with no_grad():
        for _ in range(tokens):
            window = backend.to_device(np.asarray(ids, np.int64)[None, :])  # (1, T)
            logits = backend.to_numpy(model(Tensor(window)).data)[0, -1].astype(np.float64)
            logits = logits / temperature
            if top_k:
                logits[logits < np.sort(logits)[-top_k]] = -np.inf
            probabilities = np.exp(logits - logits.max())
            ids.append(int(rng.choice(len(logits), p=probabilities / probabilities.sum())))
            yield ids[-1]


def generate(model: GPT, prompt_ids: np.ndarray, tokens: int, temperature: float, top_k: int,
             seed: int) -> np.ndarray:
    """prompt_ids followed by `tokens` drawn ids (`draw`'s, all at once)."""
    drawn = list(draw(model, prompt_ids, tokens, temperature, top_k, seed))
    return np.asarray([*prompt_ids, *drawn], dtype=np.int64)


def check(args: argparse.Namespace) -> None:
    if args.tokens < 0:
        raise ConfigError(f"--tokens must be 0 or more, got {args.tokens}")
    if args.tokens > MAX_TOKENS:
        raise ConfigError(f"--tokens {args.tokens} is more than one run draws (at most "
                          f"{MAX_TOKENS:,}: each character reruns the model over the whole "
                          "context, so a million already prints for about an hour)")
    if not (args.temperature > 0 and math.isfinite(args.temperature)):
        raise ConfigError(f"--temperature must be a positive number, got {args.temperature}")
    for flag, value in (("--top-k", args.top_k), ("--seed", args.seed)):
        if value < 0:
            raise ConfigError(f"{flag} must be 0 or more, got {value}")
    if not args.prompt:
        raise ConfigError("--prompt must hold at least one character")


def main(argv: list[str] | None = None) -> int:
    exit_cleanly_on_sigterm()
    args = build_parser().parse_args(argv)
    return run_command(PROGRAM, lambda: sample(args))


def sample(args: argparse.Namespace) -> int:
    """Check the flags and the checkpoint, then print the prompt and what the model adds to it."""
    check(args)
    model, data = load_model(args.resume)
    if args.top_k > data.vocab_size:
        raise ConfigError(f"--top-k {args.top_k} exceeds the {data.vocab_size} characters")
    try:
        prompt = data.encode(args.prompt)
    except ValueError as error:
        raise ConfigError(f"--prompt: {error}") from None
    # Each character is printed (and flushed) as it is drawn: a long generation shows progress
    # instead of a silent wait; the text is the same as printing it whole at the end.
    print(args.prompt, end="", flush=True)
    for token in draw(model, prompt, args.tokens, args.temperature, args.top_k, args.seed):
        print(data.decode([token]), end="", flush=True)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
