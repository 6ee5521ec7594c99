"""The MLP the digits train: Linear and ReLU, hidden layers of one width, float32."""

import numpy as np

from minimp import nn


def build_model(features: int, classes: int, hidden: int, layers: int,
                rng: np.random.Generator) -> nn.Sequential:
    """MLP: features -> hidden (x layers, each Linear + ReLU) -> classes, float32, from rng."""
    modules, width = [], features
    for _ in range(layers):
        modules += [nn.Linear(width, hidden, rng=rng), nn.ReLU()]
        width = hidden
    modules.append(nn.Linear(width, classes, rng=rng))
    return nn.Sequential(*modules)
