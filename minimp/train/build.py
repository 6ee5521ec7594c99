"""What a run is made of: this rank's share of the task's model, its optimizer, its loss scaler."""

import numpy as np

from minimp import nn, optim
from minimp.models.moe import MoE
from minimp.parallel.apply import Named, Parallelized, parallelize
from minimp.parallel.topology import Topology
from minimp.precision import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
from minimp.precision.stochastic import StochasticWeights, to_nearest
from minimp.train.config import TrainConfig
from minimp.train.fp8 import enable_nvfp4, recipe
from minimp.train.tasks import Task


def build_optimizer(config: TrainConfig, named: Named) -> optim.Optimizer:
    """The configured optimizer over these parameters, in their order. The GPT decays only its
    matrices (2-D weights and embeddings), as nanoGPT: decaying biases and LayerNorm gains toward
    0 has no regularising purpose."""
    params: list[nn.Parameter] | list[dict]
    if config.model == "gpt":
        params = [{"params": [p], "weight_decay": config.weight_decay if p.ndim >= 2 else 0.0}
                  for _, p in named]
    else:
        params = [p for _, p in named]
    # --master-weights none: no float32 masters; each update rounds back into the bf16 weight.
    rounding = StochasticWeights(config.seed) if config.stochastic_rounding else to_nearest
    keep = config.master_weights == "fp32"
    if config.optimizer == "sgd":
        return optim.SGD(params, lr=config.lr, momentum=config.momentum,
                         weight_decay=config.weight_decay, master_weights=keep, rounding=rounding)
    betas = (0.9, config.beta2)
    kind = optim.AdamW if config.optimizer == "adamw" else optim.Adam
    return kind(params, lr=config.lr, betas=betas, weight_decay=config.weight_decay,
                master_weights=keep, rounding=rounding)


def build_scaler(config: TrainConfig) -> LossScaler:
    """The loss scaler --loss-scale names ('auto': dynamic for fp16, none otherwise)."""
    kind, value = config.loss_scale_kind()
    if kind == "dynamic":
        return DynamicLossScaler(growth_interval=config.loss_scale_growth_interval)
    if kind == "static":
        assert value is not None  # loss_scale_kind gives a static scale its value
        return StaticLossScaler(value)
    return NoLossScaler()


def build_stage(config: TrainConfig, task: Task, topology: Topology,
                dtype: np.dtype) -> Parallelized:
    """This rank's share of the task's model (parallel/apply.py's steps 1-3), from the seed: the
    optimizer built on the float32 weights, then the model cast to the compute dtype (and, with
    --precision fp8, every Linear but a mixture's router given fp8 scaling state: rank 0
    evaluates the whole model)."""
    model = task.build_model(np.random.default_rng(config.seed))
    rows = config.batch_size // topology.dp // config.micro_batches

    def prepare(each: nn.Sequential) -> None:
        each.to(dtype)
        if config.precision == "nvfp4":  # the Linears outside the last blocks (train/fp8.py)
            enable_nvfp4(each, config)
        if config.precision == "fp8":
            nn.enable_fp8(each, recipe(config))
            for moe in (module for module in each.modules() if isinstance(module, MoE)):
                # The router multiplies in float32 (moe.py says why), never through its Linear's
                # fp8 path: no fp8 state for it, which would sit at scale 1 forever.
                moe.router.fp8_meta = None

    share = parallelize(
        model, topology, config.parallelism(), task, sample_input=task.sample_input(rows),
        dtype=dtype, build_optimizer=lambda named: build_optimizer(config, named), prepare=prepare)
    return share
