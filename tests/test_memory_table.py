"""docs/low-precision.md's memory table: bytes per parameter the trainer holds between steps
(model_state_by_kind) for each precision recipe, on a tiny GPT, == ZeRO stage 0's memory_formula
on one rank (minus the masters with --master-weights none). The fp8 and NVFP4 recipes hold what
bf16 holds: their quantized copies are made per GEMM and dropped, never kept between steps."""

import pytest

from minimp import distributed as dist
from minimp.parallel.zero.formulas import memory_formula
from minimp.train import TrainConfig, train
from minimp.train.sizes import zero_unit_sizes

# One block, 128 tokens a micro-batch (blockwise's and MXFP8's weight-gradient K), one evaluation
# batch: one step is the least a run measures.
GPT = dict(dataset="shakespeare", layers=1, hidden=32, heads=2, context=8, batch_size=16,
           steps=1, warmup=0, eval_every=0, eval_batches=1, log_every=1000)
SLOW = pytest.mark.slow

ROWS = [
    pytest.param(dict(precision="bf16"), id="bf16"),
    pytest.param(dict(precision="fp8", fp8_recipe="delayed"), id="fp8-delayed", marks=SLOW),
    pytest.param(dict(precision="fp8", fp8_recipe="rowwise"), id="rowwise", marks=SLOW),
    # blockwise needs every Linear's K a multiple of 128
    pytest.param(dict(precision="fp8", fp8_recipe="blockwise", hidden=128), id="blockwise",
                 marks=SLOW),
    pytest.param(dict(precision="fp8", fp8_recipe="mxfp8"), id="mxfp8"),
    # NVFP4 keeps its last block's Linears in bf16: two blocks, so that one is NVFP4
    pytest.param(dict(precision="nvfp4", layers=2), id="nvfp4", marks=SLOW),
    pytest.param(dict(precision="bf16", master_weights="none"), id="no-masters"),
]


def formula(config: TrainConfig) -> dict[str, int]:
    """What one rank of stage 0 holds: bf16 weights (every recipe's compute copies: the fp8, MX
    and NVFP4 recipes quantize per GEMM), float32 gradient sums, float32 masters (none without
    them), Adam's two float32 slots; one rank sends nothing, so no buffers."""
    held = memory_formula(0, unit_sizes=zero_unit_sizes(config)[0], rank=0, world_size=1,
                          compute_bytes=2, wire_bytes=4, slots=2)
    if config.master_weights == "none":
        held["masters"] = 0
    return held


@pytest.mark.parametrize("flags", ROWS)
def test_the_bytes_held_per_parameter_are_the_formula(flags):
    config = TrainConfig(**{**GPT, **flags})
    config.validate(1)
    result = dist.simulate(1, lambda comm: train(config, log=lambda line: None, comm=comm))[0]
    assert result["model_state_by_kind"][0] == formula(config)
    count = sum(weight.size for weight in result["master_weights"].values())
    per = {kind: value / count for kind, value in result["model_state_by_kind"][0].items()}
    masters = 0 if flags.get("master_weights") == "none" else 4
    assert per == dict(parameters=2, gradients=0, accumulators=4, masters=masters,
                       optimizer_state=8, buffers=0, gathered=0)
