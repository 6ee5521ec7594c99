"""What a training run is made of: this rank's stage of the task's model, its optimizer, the
GradientSync of its replicas (data parallelism or ZeRO), the loss scaler and (fp8) its Linears'
scaling state."""

import copy
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from minimp import nn, optim
from minimp.distributed.protocol import Communicator
from minimp.parallel import (
    DataParallel,
    PipelineStage,
    Topology,
    ZeroDataParallel,
    cut_shapes,
    stage_parameters,
    zero_data_parallel,
)
from minimp.parallel.data.data_parallel import broadcast_masters
from minimp.parallel.pipeline.schedules import CHOICES as SCHEDULE_CHOICES
from minimp.parallel.pipeline.split import StageChunk, run_layers, split_counts
from minimp.parallel.tensor.grads import TensorParallelGradients
from minimp.parallel.tensor.models import TensorParallelPlan, paired_counts, parallelize
from minimp.parallel.tensor.checkpoint import shard_selector
from minimp.parallel.pipeline.tied import TiedGradients
from minimp.parallel.zero.stage3 import free
from minimp.precision import (
    ACTIVATION_DTYPES,
    DynamicLossScaler,
    LossScaler,
    NoLossScaler,
    StaticLossScaler,
)
from minimp.tensor import Tensor
from minimp.train.fp8 import Fp8Run, recipe


@dataclass
class Stage:
    """This rank's share of the model: the whole model (for evaluation on rank 0), the names of
    the parameters this stage trains, their optimizer, the runner of the stage's layers, and the
    names of the parameters it shares with another stage (the GPT's tied embedding), and with
    --precision fp8 the scaling state of its Linears."""

    model: nn.Sequential
    names: list[str]
    optimizer: optim.Optimizer
    runner: PipelineStage
    tied_names: list[str]
    fp8: Fp8Run | None  # the stage's fp8 scaling state (--precision fp8), else None
    plan: TensorParallelPlan | None = None  # with --tp: which parameters are cut, which partial
    tensor_parallel: TensorParallelGradients | None = None  # with --tp: its part of the step
    select: Callable | None = None  # with --tp: cuts this rank's shard from a checkpoint's arrays


def build_stage(config: Any, task: Any, topology: Topology, dtype: Any) -> Stage:
    """The whole float32 model from the seed, then this rank's stage of it (with --tp, its shard
    of the stage: a copy of the model with its Linears cut), its optimizer (masters from the
    float32 init), the float16/bfloat16 compute copies and the stage's runner."""
    model = task.build_model(np.random.default_rng(config.seed))
    ranges = _rank_ranges(model, config, topology)  # several with --schedule interleaved
    trained, plan = model, None  # with --tp the trained copy is cut; `model` stays whole
    if topology.tp > 1:
        trained = copy.deepcopy(model)
        plan = parallelize(trained, topology.tp_group, config.sequence_parallel)
    named = [pair for bounds in ranges for pair in stage_parameters(trained, bounds)]
    tied = _tied_parameters(trained, topology)
    held = {name for name, _ in named}
    named += [(name, parameter) for name, parameter in tied if name not in held]
    optimizer = build_optimizer(config, named)
    for each in (model,) if plan is None else (model, trained):
        each.to(dtype)
        if config.precision == "fp8":  # every Linear (rank 0 evaluates the whole model)
            nn.enable_fp8(each, recipe(config))
    rows = config.batch_size // topology.dp // config.micro_batches
    model.eval()  # the shapes need one forward, and dropout then needs no random state
    shapes = cut_shapes(model.layers, task.sample_input(rows))
    model.train()
    if config.sequence_parallel:  # between the embeddings and the head: 1/tp of the positions
        layers = len(model)
        shapes = [_slice_sequence(shape, i, layers, topology.tp) for i, shape in enumerate(shapes)]
    chunks = [StageChunk(trained.layers[a:b], shapes[a], shapes[b]) for a, b in ranges]
    runner = PipelineStage(
        chunks[0].layers,
        topology,
        input_shape=chunks[0].input_shape,
        output_shape=chunks[0].output_shape,
        dtype=dtype,
        loss_fn=task.loss,
        run_group=group_runner(task, config.recompute),
        more_chunks=chunks[1:],
        buffered_sends=SCHEDULE_CHOICES[config.schedule].buffered_sends,
    )
    # The other stages' layers are rank 0's to evaluate with, and only after it has gathered
    # their masters (saving.evaluate): no rank keeps their compute copies meanwhile.
    kept = {id(parameter) for _, parameter in named}
    for parameter in [*model.parameters(), *(trained.parameters() if plan else [])]:
        if id(parameter) not in kept:
            free(parameter)
    names = [name for name, _ in named]
    fp8_run = Fp8Run(trained, ranges, topology, model) if config.precision == "fp8" else None
    tied_names = [name for name, _ in tied]
    stage = Stage(model, names, optimizer, runner, tied_names, fp8_run, plan)
    if plan is not None:
        stage.tensor_parallel = TensorParallelGradients.for_names(topology.tp_group, names, plan)
        stage.select = shard_selector(plan.partitions, topology.tp_rank, topology.tp)
    return stage


def _rank_ranges(model: Any, config: Any, topology: Topology) -> list[tuple[int, int]]:
    """This rank's layers, a range per chunk: the model cut into --pp x --virtual-stages chunks,
    of which this stage holds chunks stage, stage + pp, ... (with --tp, an MLP's column -> row
    pairs are never cut apart)."""
    counts = [sum(p.size for p in layer.parameters()) for layer in model.layers]
    if topology.tp > 1 and config.model == "mlp":
        counts = paired_counts(counts)
    chunks = split_counts(counts, config.pp * config.virtual_stages)
    return chunks[topology.stage :: config.pp]


def _slice_sequence(shape: tuple, index: int, layers: int, tp: int) -> tuple:
    """The shape entering layer `index` with sequence parallelism: (B, S/tp, h) from the first
    block to the head (the embeddings read whole token ids; the head returns whole logits)."""
    if 0 < index < layers:
        return (shape[0], shape[1] // tp, *shape[2:])
    return shape


def group_runner(task: Any, recompute: bool) -> Callable[[list, Tensor], Tensor]:
    """How the stage runs each group of layers: in order, or, with --recompute and a group the
    task calls a block, keeping only the group's input for backward (nn.recompute)."""

    def run(layers: list, x: Tensor) -> Tensor:
        if recompute and task.is_block(layers):
            return nn.recompute(layers, x)
        return run_layers(layers, x)

    return run


def build_sync(
    config: Any,
    topology: Topology,
    stage: Stage,
    tied: TiedGradients | None,
    decision_comm: Communicator,
) -> DataParallel | ZeroDataParallel:
    """The GradientSync of this stage's replicas, every replica starting from replica 0's
    masters: DataParallel (--zero 0), or ZeRO's, which shards the stage's optimizer (its
    `.optimizer` is the one the step must use from now on) and, in stage 3, gathers the
    parameters around the stage's groups of layers. With --tp both also sum the stage's partial
    gradients and count its whole parameters once (parallel/tensor/grads.py)."""
    options: dict[str, Any] = dict(
        comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
        average=config.grad_average,
        decision_comm=decision_comm,
        tied=tied,
        tensor_parallel=stage.tensor_parallel,
    )
    if not config.zero:
        sync = DataParallel(
            topology.dp_group,
            stage.optimizer,
            bucket_mb=config.bucket_mb,
            stages_comm=topology.mp_group,  # the stages and the tensor-parallel shards
            overlap=config.overlap,
            micro_batches=config.micro_batches,
            **options,
        )
        sync.broadcast_parameters()
        return sync
    broadcast_masters(topology.dp_group, stage.optimizer)
    runner = stage.runner
    zero = zero_data_parallel(
        config.zero,
        stage.optimizer,
        runner.layers,
        topology.dp_group,
        overlap=config.overlap,
        micro_batches=config.micro_batches,
        **options,
    )
    plain = runner.run_group
    runner.run_group = lambda layers, x: zero.run_group(layers, x, plain)
    return zero


def _tied_parameters(model: Any, topology: Topology) -> list[tuple[str, Any]]:
    """The parameters the first and the last stage both hold (the GPT's head reads the token
    embedding's weight), when they are different stages; else none."""
    tied: list[tuple[str, Any]] = getattr(model, "tied_parameters", lambda: [])()
    return tied if topology.pp > 1 and topology.stage in (0, topology.pp - 1) else []


def build_optimizer(config: Any, named: list[tuple[str, Any]]) -> optim.Optimizer:
    """The configured optimizer over these parameters, in their order. The GPT decays only its
    matrices (2-D weights and embeddings), as nanoGPT: decaying biases and LayerNorm gains toward
    0 has no regularising purpose."""
    if config.model == "gpt":
        params: list = [
            {"params": [p], "weight_decay": config.weight_decay if p.ndim >= 2 else 0.0}
            for _, p in named
        ]
    else:
        params = [p for _, p in named]
    if config.optimizer == "sgd":
        return optim.SGD(
            params, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    betas = (0.9, config.beta2)
    if config.optimizer == "adamw":
        return optim.AdamW(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)
    return optim.Adam(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay)


def build_scaler(config: Any) -> LossScaler:
    kind, value = config.loss_scale_kind()
    if kind == "dynamic":
        return DynamicLossScaler(growth_interval=config.loss_scale_growth_interval)
    if kind == "static":
        return StaticLossScaler(value)
    return NoLossScaler()
