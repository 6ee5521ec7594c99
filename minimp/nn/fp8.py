"""A model's Linears in fp8: give each an Fp8Meta, list them by name, save and restore their state.

`enable_fp8(model, recipe)` is minimp's `convert_to_float8_training` (torchao) or te.Linear
(Transformer Engine): every `nn.Linear` gets its own `Fp8Meta`, so each of its three tensors keeps
its own scale. Nothing else changes: attention's two products, the GPT's head (tied to the
embedding), LayerNorm, softmax and the losses stay in the activation dtype, as in Transformer
Engine by default (its recipes put the Linear layers' GEMMs in fp8; fp8 attention is a separate
option) and in DeepSeek-V3 (which keeps the embedding, the output head, normalization and attention
in higher precision).

The state of a model is named "<module name>.<tensor>" ("3.attn.c_attn.input"), so a pipeline
stage saves and restores the quantizers of its own layers under the names one process would use.
"""

from typing import Iterator, Mapping

import numpy as np

from minimp.nn.layers import Linear
from minimp.nn.module import Module
from minimp.precision.fp8_scaling import Fp8Meta, Fp8Quantizer, Fp8Recipe
from minimp.precision.fp8_scaling import load_quantizers_state_dict, quantizers_state_dict
from minimp.precision.recipes import BlockScaledMeta, BlockScaling


def enable_fp8(model: Module, recipe: Fp8Recipe | BlockScaling) -> Module:
    """Give every Linear of the model its own Fp8Meta of this recipe (a BlockScaledMeta for a
    block-scaled recipe, which keeps no state); returns the model."""
    for _, module in model.named_modules():
        if isinstance(module, Linear):
            module.fp8_meta = (BlockScaledMeta(recipe) if isinstance(recipe, BlockScaling)
                               else Fp8Meta(recipe))
    return model


def fp8_metas(model: Module) -> list[tuple[str, Fp8Meta | BlockScaledMeta]]:
    """(module name, Fp8Meta) of every fp8 Linear, in named_modules() order."""
    return [(name, module.fp8_meta) for name, module in model.named_modules()
            if isinstance(module, Linear) and module.fp8_meta is not None]


def fp8_quantizers(model: Module) -> Iterator[tuple[str, Fp8Quantizer]]:
    """("3.attn.c_attn.input", quantizer) for each tensor of each fp8 Linear."""
    for name, meta in fp8_metas(model):
        for tensor, quantizer in meta.quantizers():
            yield f"{name}.{tensor}", quantizer


def fp8_state_dict(model: Module) -> dict[str, np.ndarray]:
    """{"<quantizer name>/<field>": array}: what a checkpoint keeps of the model's fp8 scaling
    (empty for the stateless recipes)."""
    return quantizers_state_dict(list(fp8_quantizers(model)))


def load_fp8_state_dict(model: Module, state: Mapping[str, np.ndarray]) -> None:
    """Restore what fp8_state_dict returned; everything is checked before anything changes."""
    load_quantizers_state_dict(list(fp8_quantizers(model)), dict(state))
