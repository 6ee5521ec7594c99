"""The PyTorch side of benchmarks/gpt_step_bench.py: the same GPT step in PyTorch eager, fp32.

Run by gpt_step_bench.py in PyTorch's own environment (PyTorch is never a dependency of minimp):

    python benchmarks/gpt_step_bench.py --torch-python /path/to/venv-with-torch/bin/python

It reads one number per line on stdin (steps to time) and answers each with one JSON line holding
the seconds of every step, so the two libraries can be timed in alternating blocks.
"""

import argparse
import json
import math
import sys
import time

import torch
from torch import nn


class Block(nn.Module):
    """nanoGPT's block: pre-LayerNorm causal self-attention and a GELU MLP, both residual."""

    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.attn_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        shape = (batch, tokens, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)
        mask = torch.ones(tokens, tokens, dtype=torch.bool).tril()
        attention = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.attn_proj(y)
        return x + self.mlp_proj(nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, width):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # the tied head


def main():
    parser = argparse.ArgumentParser()
    for name, default in (("vocab", 65), ("context", 64), ("layers", 4), ("heads", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = GPT(args.vocab, args.context, args.layers, args.heads, args.width)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    ids = torch.randint(0, args.vocab, (args.batch, args.context + 1))
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def step():
        logits = model(inputs)
        loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    for line in sys.stdin:
        seconds = []
        for _ in range(int(line)):
            start = time.perf_counter()
            step()
            seconds.append(time.perf_counter() - start)
        print(json.dumps(seconds), flush=True)


if __name__ == "__main__":
    main()
