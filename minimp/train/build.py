"""What a training run is made of: this rank's stage of the task's model, its optimizer, the
GradientSync of its replicas (data parallelism or ZeRO), the loss scaler and (fp8) its Linears'
scaling state."""

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
    split_stages,
    stage_parameters,
    zero_data_parallel,
)
from minimp.parallel.data_parallel import broadcast_masters
from minimp.parallel.stages import run_layers
from minimp.parallel.tied import TiedGradients
from minimp.parallel.zero_stage3 import free
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


def build_stage(config: Any, task: Any, topology: Topology, dtype: Any) -> Stage:
    """The whole float32 model from the seed, then this rank's stage of it, its optimizer (masters
    from the float32 init), the float16/bfloat16 compute copies and the stage's runner."""
    model = task.build_model(np.random.default_rng(config.seed))
    bounds = split_stages(model.layers, config.pp)[topology.stage]
    named = stage_parameters(model, bounds)
    tied = _tied_parameters(model, topology)
    held = {name for name, _ in named}
    named += [(name, parameter) for name, parameter in tied if name not in held]
    optimizer = build_optimizer(config, named)
    model.to(dtype)
    if config.precision == "fp8":  # every Linear of the whole model (rank 0 evaluates it all)
        nn.enable_fp8(model, recipe(config))
    rows = config.batch_size // topology.dp // config.micro_batches
    model.eval()  # the shapes need one forward, and dropout then needs no random state
    shapes = cut_shapes(model.layers, task.sample_input(rows))
    model.train()
    start, stop = bounds
    runner = PipelineStage(
        model.layers[start:stop],
        topology,
        input_shape=shapes[start],
        output_shape=shapes[stop],
        dtype=dtype,
        loss_fn=task.loss,
        run_group=group_runner(task, config.recompute),
    )
    # The other stages' layers are rank 0's to evaluate with, and only after it has gathered
    # their masters (saving.evaluate): no rank keeps their compute copies meanwhile.
    kept = {id(parameter) for _, parameter in named}
    for parameter in model.parameters():
        if id(parameter) not in kept:
            free(parameter)
    names = [name for name, _ in named]
    fp8_run = Fp8Run(model, bounds, topology) if config.precision == "fp8" else None
    return Stage(model, names, optimizer, runner, [name for name, _ in tied], fp8_run)


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
    parameters around the stage's groups of layers."""
    options: dict[str, Any] = dict(
        comm_dtype=ACTIVATION_DTYPES[config.grad_comm_dtype],
        average=config.grad_average,
        decision_comm=decision_comm,
        tied=tied,
    )
    if not config.zero:
        sync = DataParallel(
            topology.dp_group,
            stage.optimizer,
            bucket_mb=config.bucket_mb,
            stages_comm=topology.pp_group,
            overlap=config.overlap,
            micro_batches=config.micro_batches,
            **options,
        )
        sync.broadcast_parameters()
        return sync
    broadcast_masters(topology.dp_group, stage.optimizer)
    runner = stage.runner
    zero = zero_data_parallel(
        config.zero, stage.optimizer, runner.layers, topology.dp_group, **options
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
