"""train/build.py: the optimizer and scaler a run builds from its flags."""

import numpy as np
import pytest

from minimp import optim
from minimp.train import TrainConfig
from minimp.train.build import build_optimizer
from minimp.train.tasks import TASKS


@pytest.mark.parametrize("optimizer", ["adamw", "adam", "sgd"])
def test_the_gpt_decays_its_matrices_and_embeddings_not_its_biases_and_norm_gains(optimizer):
    """nanoGPT's groups: weight decay pulls 2-D weights toward 0; on a LayerNorm gain or a bias
    it would only fight the layer (a gain pulled to 0 silences its features)."""
    config = TrainConfig(dataset="shakespeare", layers=1, hidden=8, heads=2, context=8,
                         weight_decay=0.1, optimizer=optimizer)
    model = TASKS["shakespeare"](config, np.float32).build_model(np.random.default_rng(0))
    named = list(model.named_parameters())
    built = build_optimizer(config, named)
    decays = dict(zip([name for name, _ in named], built.weight_decays))
    matrices = {name for name, p in named if p.ndim == 2}
    assert matrices == {"0.wte.weight", "0.wpe.weight", "1.attn.c_attn.weight",
                        "1.attn.c_proj.weight", "1.mlp.c_fc.weight", "1.mlp.c_proj.weight"}
    assert all(decays[name] == (0.1 if name in matrices else 0.0) for name in decays)
    kinds = {"adamw": optim.AdamW, "adam": optim.Adam, "sgd": optim.SGD}
    assert isinstance(built, kinds[optimizer])


def test_the_mlp_decays_every_parameter_by_the_flag():
    config = TrainConfig(layers=1, hidden=8, weight_decay=0.1)
    model = TASKS["digits"](config, np.float32).build_model(np.random.default_rng(0))
    built = build_optimizer(config, list(model.named_parameters()))
    assert built.weight_decays == [0.1] * len(built.params)
