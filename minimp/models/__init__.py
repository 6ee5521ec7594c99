"""Models built from minimp.nn, with nothing parallel inside: the GPT."""

from minimp.models.gpt import GPT, Block, GPTConfig, block_activation_bytes
