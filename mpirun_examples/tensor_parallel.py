"""Every dp x tp x pp grid of 4 ranks on the GPT: bytes per group per step measured against the
formulas, step time, and the bytes one block keeps for backward against Korthikanti et al.

    python mpirun_examples/tensor_parallel.py                 # launches mpirun itself, minutes
    python mpirun_examples/tensor_parallel.py --grids 1x4x1+sp --steps 3 --json

1. For each grid it runs `mpirun -n 4 python -m minimp.train --dataset shakespeare` (nanoGPT's
   CPU model: 4 blocks of width 128, 4 heads, context 64; batch 16 in 2 micro-batches, fp16,
   dropout 0.1) and reads rank 0's metrics: bytes sent per step in each group (tensor_parallel,
   data_parallel, pipeline, tied), and the step time (median after the first step). Beside them,
   for rank 0, the formulas of minimp/measure/tensor_parallel_accounts.py and
   minimp/parallel/zero/formulas.py.
2. One block on each of t = 1, 2, 4 simulated ranks, with and without sequence parallelism: the
   bytes it keeps for backward, the formula, and Korthikanti et al.'s count.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

import numpy as np

from minimp import Tensor
from minimp import distributed as dist
from minimp.models import GPT, GPTConfig, block_activation_bytes
from minimp.parallel import parallelize_module
from minimp.measure.tensor_parallel_accounts import (
    block_activation_bytes_tp,
    gpt_tensor_parallel_bytes,
    korthikanti_bytes,
    pipeline_bytes,
)
from minimp.parallel.zero.formulas import bytes_sent_formula
from minimp.tensor import saved_bytes
from minimp.train import TrainConfig
from minimp.train.sizes import SHAKESPEARE_VOCABULARY, rank_layer_counts, stage_bounds

GRIDS = ["4x1x1", "2x2x1", "2x2x1+sp", "1x4x1", "1x4x1+sp", "2x1x2", "1x2x2", "1x2x2+sp", "1x1x4"]
COMMON = dict(dataset="shakespeare", batch_size=16, micro_batches=2, dropout=0.1)
S, H, A, LAYERS = 64, 128, 4, 4  # the shakespeare defaults: context, width, heads, blocks


def parse_grid(grid: str) -> dict:
    """'1x2x2+sp' -> {dp: 1, tp: 2, pp: 2, sequence_parallel: True}."""
    sizes, _, extra = grid.partition("+")
    dp, tp, pp = (int(size) for size in sizes.split("x"))
    return dict(dp=dp, tp=tp, pp=pp, sequence_parallel=extra == "sp")


def formulas(layout: dict) -> dict:
    """Rank 0's bytes per group per step by formula: stage 0, replica 0, shard 0."""
    config = TrainConfig(**COMMON, **layout)
    dp, tp, pp, sp = layout["dp"], layout["tp"], layout["pp"], layout["sequence_parallel"]
    start, stop = stage_bounds(config)[0]
    rows = COMMON["batch_size"] // dp // COMMON["micro_batches"]
    common = dict(micro_batches=COMMON["micro_batches"], first_stage=True, last_stage=pp == 1)
    tensor = gpt_tensor_parallel_bytes(
        blocks=sum(1 <= i <= LAYERS for i in range(start, stop)), rows=rows, context=S, width=H,
        tp=tp, compute_bytes=2, sequence_parallel=sp, **common,
    )  # fmt: skip
    parameters = sum(rank_layer_counts(config)[start:stop])  # one bucket: under --bucket-mb 25
    replicas = bytes_sent_formula(
        0, sizes=[parameters], rank=0, world_size=dp, micro_batches=2, compute_bytes=2,
        wire_bytes=4,
    )  # fmt: skip
    activation = rows * S * H * 2 // (tp if sp else 1)
    tied = SHAKESPEARE_VOCABULARY * H * 4 if pp > 1 else 0  # the embedding's sum, 2 ranks
    return {
        "tensor_parallel": tensor,
        "data_parallel": replicas.get("all_reduce", 0),
        "pipeline": pipeline_bytes(activation=activation, **common),
        "tied": tied,
    }


def run_grid(grid: str, steps: int, folder: str) -> dict:
    """One mpirun of 4 ranks: rank 0's median bytes per group and step time, and the formulas."""
    layout = parse_grid(grid)
    metrics = os.path.join(folder, f"{grid}.jsonl")
    mpirun = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or "mpirun"
    command = [mpirun, "-n", "4", sys.executable, "-m", "minimp.train", "--steps", str(steps)]
    command += ["--log-every", "100000", "--eval-every", "0", "--metrics", metrics]
    for name, value in {**COMMON, **layout}.items():
        flag = "--" + name.replace("_", "-")
        command += [flag] if value is True else [] if value is False else [flag, str(value)]
    subprocess.run(command, check=True, capture_output=True, timeout=1200)
    records = [r for r in map(json.loads, open(metrics)) if "loss" in r][1:]  # after the first
    measured = {
        group: statistics.median(r["bytes_by_group"].get(group, 0) for r in records)
        for group in ("tensor_parallel", "data_parallel", "pipeline", "tied")
    }
    step = statistics.median(r["compute_seconds"] + r["communication_seconds"] for r in records)
    return {"grid": grid, "measured": measured, "formula": formulas(layout), "step_ms": 1e3 * step}


def block_memory() -> list[dict]:
    """One block's bytes kept for backward on each rank (the same on every rank), fp16, dropout
    0.1, a micro-batch of 8 rows: measured, the formula, and Korthikanti et al.'s count."""
    rows, b = [], 8
    config = GPTConfig(vocab_size=65, context=S, layers=1, heads=A, width=H, dropout=0.1)
    for tp in (1, 2, 4):
        for sp in (False, True) if tp > 1 else (False,):
            measured = dist.simulate(tp, _kept, config, b, sp)
            formula = (
                block_activation_bytes(S, b, H, A, np.float16)
                if tp == 1
                else block_activation_bytes_tp(S, b, H, A, np.float16, tp, sp)
            )
            rows.append(
                {"tp": tp, "sp": sp, "measured": measured, "formula": formula,
                 "korthikanti": korthikanti_bytes(S, b, H, A, tp, sp)}
            )  # fmt: skip
    return rows


def _kept(comm, config: GPTConfig, b: int, sequence_parallel: bool) -> int:
    model = GPT(config, np.random.default_rng(0))
    if comm.size > 1:
        parallelize_module(model, comm, sequence_parallel)
    model.to(np.float16)
    model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
    tokens = S // comm.size if sequence_parallel else S
    x = np.random.default_rng(comm.rank).standard_normal((b, tokens, H)).astype(np.float16)
    out = model[1](Tensor(x, requires_grad=True))
    return saved_bytes(out, exclude=[p.data for p in model.parameters()])


def print_tables(rows: list[dict], memory: list[dict]) -> None:
    print("GPT 4 x 128, 4 heads, context 64, batch 16 in 2 micro-batches, fp16, on 4 ranks")
    print("rank 0's bytes sent per step, measured / formula; grid = dp x tp x pp")
    print("| grid | tensor-parallel | data-parallel | pipeline | tied embedding | step ms |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in rows:
        cells = [
            f"{r['measured'][g]:,.0f} / {r['formula'][g]:,}"
            for g in ("tensor_parallel", "data_parallel", "pipeline", "tied")
        ]
        print(f"| {r['grid']} | {' | '.join(cells)} | {r['step_ms']:.0f} |")
    print("\none block's bytes kept for backward per rank, fp16, dropout 0.1,", end=" ")
    print("s 64, b 8, h 128, a 4")
    print("| tp | sequence parallel | measured | formula | Korthikanti et al. | difference |")
    print("| --- | --- | --- | --- | --- | --- |")
    for m in memory:
        kept = m["measured"][0]
        same = "" if len(set(m["measured"])) == 1 else " (ranks differ!)"
        print(
            f"| {m['tp']} | {'yes' if m['sp'] else 'no'} | {kept:,}{same} | {m['formula']:,} | "
            f"{m['korthikanti']:,.0f} | {kept - m['korthikanti']:+,.0f} |"
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--grids", nargs="+", default=GRIDS, help="dp x tp x pp, +sp: sequence")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    for grid in args.grids:
        layout = parse_grid(grid)
        if layout["dp"] * layout["tp"] * layout["pp"] != 4:
            parser.exit(2, f"{parser.prog}: error: --grids {grid}: dp x tp x pp must make the 4 "
                           "ranks this script runs\n")
    with tempfile.TemporaryDirectory() as folder:
        rows = [run_grid(grid, args.steps, folder) for grid in args.grids]
    memory = block_memory()
    if args.json:
        print(json.dumps({"rows": rows, "memory": memory}))
        return
    print_tables(rows, memory)


if __name__ == "__main__":
    main()
