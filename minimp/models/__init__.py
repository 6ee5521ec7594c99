"""Models built from minimp.nn, with nothing parallel inside: the GPT and the digits' MLP."""

from minimp.models.gpt import GPT, Block, GPTConfig, block_activation_bytes
