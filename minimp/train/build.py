"""What a training run is made of: the model, its split into stages, optimizer, scaler,
evaluation."""

import numpy as np

from minimp import backend, nn, optim
from minimp.dist.pipeline import split_stages
from minimp.function import no_grad
from minimp.precision import DynamicLossScaler, NoLossScaler, StaticLossScaler
from minimp.tensor import Tensor


def build_model(features, classes, hidden, layers, rng):
    """MLP: features -> hidden (x layers, each Linear + ReLU) -> classes, float32, weights from
    rng."""
    modules, width = [], features
    for _ in range(layers):
        modules += [nn.Linear(width, hidden, rng=rng), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, classes, rng=rng))
    return nn.Sequential(*modules)


def stage_of(model, stages, stage):
    """(layers, [(global name, Parameter)], input width, output width) of one pipeline stage.
    Parameter names stay those of the whole model ("4.weight"), so every layout writes the same
    checkpoint names."""
    start, stop = split_stages(model.layers, stages)[stage]
    layers = model.layers[start:stop]
    named = [
        (name, p) for name, p in model.named_parameters() if start <= int(name.split(".")[0]) < stop
    ]
    linears = [layer for layer in layers if isinstance(layer, nn.Linear)]
    return layers, named, linears[0].in_features, linears[-1].out_features


def build_optimizer(config, parameters):
    if config.optimizer == "sgd":
        return optim.SGD(
            parameters, lr=config.lr, momentum=config.momentum, weight_decay=config.weight_decay
        )
    if config.optimizer == "adamw":
        return optim.AdamW(parameters, lr=config.lr, weight_decay=config.weight_decay)
    return optim.Adam(parameters, lr=config.lr, weight_decay=config.weight_decay)


def build_scaler(config):
    kind, value = config.loss_scale_kind()
    if kind == "dynamic":
        return DynamicLossScaler(growth_interval=config.loss_scale_growth_interval)
    if kind == "static":
        return StaticLossScaler(value)
    return NoLossScaler()


def evaluate(model, images, labels, batch_size=512):
    """Fraction of correctly classified samples (forward only, in the model's compute dtype)."""
    correct = 0
    with no_grad():
        for start in range(0, len(labels), batch_size):
            logits = model(Tensor(images[start : start + batch_size])).data
            predictions = backend.to_numpy(logits.astype(np.float32).argmax(axis=1))
            correct += int((predictions == labels[start : start + batch_size]).sum())
    return correct / len(labels)
