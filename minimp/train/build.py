"""What a training run is made of: model, this rank's stage, optimizer, loss scaler, evaluation."""

from dataclasses import dataclass
from typing import Any

import numpy as np

from minimp import backend, functional, nn, optim
from minimp.parallel import PipelineStage, Topology, cut_shapes, split_stages, stage_parameters
from minimp.precision import DynamicLossScaler, LossScaler, NoLossScaler, StaticLossScaler
from minimp.tensor import Tensor, no_grad


def build_model(
    features: int, classes: int, hidden: int, layers: int, rng: np.random.Generator
) -> nn.Sequential:
    """MLP: features -> hidden (x layers, each Linear + ReLU) -> classes.
    float32, weights drawn from rng."""
    modules, width = [], features
    for _ in range(layers):
        modules += [nn.Linear(width, hidden, rng=rng), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, classes, rng=rng))
    return nn.Sequential(*modules)


@dataclass
class Stage:
    """This rank's share of the model: the whole model (for evaluation on rank 0), the names of
    the parameters this stage trains, their optimizer, and the runner of the stage's layers."""

    model: nn.Sequential
    names: list[str]
    optimizer: optim.Optimizer
    runner: PipelineStage


def build_stage(config: Any, dataset: Any, topology: Topology, dtype: Any) -> Stage:
    """The whole float32 model from the seed, then this rank's stage of it, its optimizer (masters
    from the float32 init), the float16/bfloat16 compute copies and the stage's runner."""
    rng = np.random.default_rng(config.seed)
    model = build_model(dataset.features, dataset.classes, config.hidden, config.layers, rng)
    start, stop = split_stages(model.layers, config.pp)[topology.stage]
    named = stage_parameters(model, (start, stop))
    optimizer = build_optimizer(config, [parameter for _, parameter in named])
    model.to(dtype)
    micro_rows = config.batch_size // topology.dp // config.micro_batches
    sample = backend.to_device(dataset.train_images[:micro_rows]).astype(dtype)
    shapes = cut_shapes(model.layers, sample)
    runner = PipelineStage(
        model.layers[start:stop],
        topology,
        input_shape=shapes[start],
        output_shape=shapes[stop],
        dtype=dtype,
        loss_fn=functional.cross_entropy,
    )
    return Stage(model, [name for name, _ in named], optimizer, runner)


def build_optimizer(config: Any, parameters: list) -> optim.Optimizer:
    if config.optimizer == "sgd":
        return optim.SGD(
            parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adamw":
        return optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    return optim.Adam(parameters, lr=config.lr, weight_decay=config.weight_decay)


def build_scaler(config: Any) -> LossScaler:
    kind, value = config.loss_scale_kind()
    if kind == "dynamic":
        return DynamicLossScaler(growth_interval=config.loss_scale_growth_interval)
    if kind == "static":
        return StaticLossScaler(value)
    return NoLossScaler()


def evaluate(model: nn.Module, images: Any, labels: np.ndarray, batch_size: int = 512) -> float:
    """Fraction of correctly classified samples (forward only, in the model's compute dtype)."""
    correct = 0
    with no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(Tensor(images[start : start + batch_size])).data
            predictions = backend.to_numpy(logits.argmax(axis=1))  # argmax needs no widening
            correct += int((predictions == labels[start : start + batch_size]).sum())
    return correct / len(labels)
