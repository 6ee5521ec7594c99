"""The PyTorch side of the GPT step benchmarks: the same GPT step in PyTorch eager.

Run by a parent in PyTorch's own environment (PyTorch is never a dependency of minimp):

    python benchmarks/gpt_step_bench.py --torch-python /path/to/venv-with-torch/bin/python
    python benchmarks/gpu_gpt_bench.py          # on a GPU: --device cuda, --autocast, --attention

It serves step_server.py's protocol on stdin: a count N answered with the seconds of N steps,
`stats` with the step's GEMMs alone and its peak memory. The defaults are gpt_step_bench.py's
CPU step (fp32, no dropout); on a GPU, --autocast fp16 or bf16 is `torch.autocast` (AMP, fp16
with a GradScaler), float32 products stay float32 (TF32 off in cuBLAS and cuDNN, as in
minimp), and --attention sdpa replaces the manual attention (nanoGPT's slow path) by
scaled_dot_product_attention (flash attention where PyTorch can use it).
"""

import argparse
import math
import statistics
import time

import torch
from gpt_gemms import gpt_gemms
from step_server import refuse, serve
from torch import nn

AUTOCAST_DTYPES = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}


class Block(nn.Module):
    """nanoGPT's block: pre-LayerNorm causal self-attention and a GELU MLP, both residual, with
    its three dropouts (attention weights, and each branch's output)."""

    def __init__(self, width, heads, dropout, attention):
        super().__init__()
        self.heads, self.dropout, self.attention = heads, dropout, attention
        self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.c_attn, self.attn_proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.c_fc, self.mlp_proj = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)
        drop = (lambda: nn.Dropout(dropout)) if dropout else nn.Identity  # no call when 0
        self.attn_dropout, self.resid_dropout, self.mlp_dropout = drop(), drop(), drop()

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(width, dim=2)
        shape = (batch, tokens, self.heads, width // self.heads)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.attention == "sdpa":
            p = self.dropout if self.training else 0.0
            y = nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        else:
            scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // self.heads)  # (B, H, T, T)
            mask = torch.ones(tokens, tokens, dtype=torch.bool, device=x.device).tril()
            attention = scores.masked_fill(~mask, float("-inf")).softmax(dim=-1)
            y = self.attn_dropout(attention) @ v  # (B, H, T, D)
        y = y.transpose(1, 2).reshape(batch, tokens, width)
        x = x + self.resid_dropout(self.attn_proj(y))
        hidden = nn.functional.gelu(self.c_fc(self.ln_2(x)), approximate="tanh")
        return x + self.mlp_dropout(self.mlp_proj(hidden))


class GPT(nn.Module):
    def __init__(self, vocab, context, layers, heads, width, dropout=0.0, attention="manual"):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, width), nn.Embedding(context, width)
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()
        self.blocks = nn.ModuleList(
            Block(width, heads, dropout, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)

    def forward(self, ids):
        x = self.drop(self.wte(ids) + self.wpe(torch.arange(ids.shape[1], device=ids.device)))
        for block in self.blocks:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # the tied head


def synchronizer(device):
    """What waits for the device's queued work (nothing on the CPU)."""
    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def gemms_alone_ms(args, dtype, repeats=10):
    """Median ms of the step's GEMMs (gpt_gemms.py) through torch.matmul, back to back, in
    `dtype`: between CUDA events on a GPU, by the host's clock on the CPU."""
    sizes = (args.layers, args.heads, args.width, args.context, args.vocab, args.batch)
    operands = []
    for _, count, m, n, k, a_transposed, b_transposed in gpt_gemms(*sizes):
        a = torch.randn((count, k, m) if a_transposed else (count, m, k), device=args.device)
        b = torch.randn((count, n, k) if b_transposed else (count, k, n), device=args.device)
        a, b = (t.to(dtype).squeeze(0) for t in (a, b))
        operands.append((a.transpose(-2, -1) if a_transposed else a,
                         b.transpose(-2, -1) if b_transposed else b))
    synchronize, times = synchronizer(args.device), []
    for _ in range(2 + repeats):  # two warm-ups
        synchronize()
        start = time.perf_counter()
        if args.device == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
        for a, b in operands:
            torch.matmul(a, b)
        if args.device == "cuda":
            end.record()
            end.synchronize()
            times.append(begin.elapsed_time(end))
        else:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times[2:])


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for name, default in (("vocab", 65), ("context", 64), ("layers", 4), ("heads", 4)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument("--width", type=int, default=128)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (torch)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--autocast", choices=tuple(AUTOCAST_DTYPES), default="none",
                        help="torch.autocast's dtype (AMP); none: float32 throughout")
    parser.add_argument("--attention", choices=("manual", "sdpa"), default="manual")
    parser.add_argument("--dropout", type=float, default=0.0)
    return parser.parse_args(argv)


def build_step(args):
    """One training step of a fresh model (seeded) as the flags say, on their device: forward
    under autocast, cross-entropy, scaled backward, clip at norm 1, AdamW."""
    torch.manual_seed(0)
    dtype = AUTOCAST_DTYPES[args.autocast]
    model = GPT(args.vocab, args.context, args.layers, args.heads, args.width, args.dropout,
                args.attention).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    scaler = torch.amp.GradScaler(args.device, enabled=dtype is torch.float16)
    ids = torch.randint(0, args.vocab, (args.batch, args.context + 1), device=args.device)
    inputs, targets = ids[:, :-1], ids[:, 1:]

    def step():
        with torch.autocast(args.device, dtype=dtype, enabled=dtype is not None):
            logits = model(inputs)
            loss = nn.functional.cross_entropy(logits.reshape(-1, args.vocab), targets.reshape(-1))
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)

    return step


def main():
    args = parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        return refuse(f"PyTorch {torch.__version__} sees no CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 products in float32, as minimp's
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(args.threads)
    step = build_step(args)
    dtype = AUTOCAST_DTYPES[args.autocast]

    def stats():
        figures = {"torch": torch.__version__}
        if args.device == "cuda":  # first: the GEMMs' operands would stay in the cache
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            step()
            torch.cuda.synchronize()
            figures["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            figures["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        figures["gemms_alone_ms"] = gemms_alone_ms(args, dtype or torch.float32)
        return figures

    step()  # warm-up
    serve(step, synchronizer(args.device), stats)


if __name__ == "__main__":
    main()
