"""fp8 in a training run: the scaling state of this stage's Linears, its agreement after each step,
the metrics of a few tensors, and the checkpoint arrays that carry the state.

Every rank builds the whole model and gives every Linear an Fp8Meta; a stage updates the quantizers
of its own layers, so each pipeline stage owns its layers' state. After each optimizer step the
ranks of a stage agree on the step's amaxes (parallel.AmaxReduction over the stage's replicas,
context shards and tensor-parallel shards: a shard's amax is part of the whole tensor's), so
delayed scaling computes the one-process scales on every rank and the replicas stay
bit-identical, fp8 state included (--check-replicas compares it too). Checkpoints keep the state
of delayed scaling as "fp8/<quantizer>/amax_history" and ".../scale" (float32), gathered from the
stages like the masters, so a resume continues bit for bit in any layout.

--precision nvfp4 runs through the same class with recipes.NVFP4, stateless: its random bits are
drawn from (--seed, the step, the layer), so it checkpoints nothing and begin_step tells each
Linear the step. `enable_nvfp4` says which Linears multiply in NVFP4 and which stay in bf16.
"""

import math
from typing import Callable

import numpy as np

from minimp import nn
from minimp.checkpoints.checkpoint import strip_prefix
from minimp.checkpoints.errors import CheckpointError
from minimp.distributed.protocol import Communicator
from minimp.parallel import AmaxReduction, Topology
from minimp.parallel.expert import expert_index
from minimp.precision.fp8_scaling import (DelayedScaling, Float8CurrentScaling, Fp8Meta,
                                          Fp8Quantizer, Fp8Recipe, NoScaling)
from minimp.precision.fp8_scaling import (load_quantizers_state_dict, quantizers_state_dict,
                                          update_scales)
from minimp.precision.recipes import NVFP4, RECIPES, BlockScaledMeta, BlockScaling
from minimp.train.config import TrainConfig

PREFIX = "fp8/"
# Each low-precision recipe by the training flags that choose it, bf16 first: what the docs'
# tables compare (scripts/memory_per_parameter.py, benchmarks/recipe_step_bench.py).
RECIPE_FLAGS: dict[str, dict[str, str]] = {
    "bf16": dict(precision="bf16"),
    "fp8 delayed": dict(precision="fp8", fp8_recipe="delayed"),
    "fp8 rowwise": dict(precision="fp8", fp8_recipe="rowwise"),
    "fp8 blockwise": dict(precision="fp8", fp8_recipe="blockwise"),
    "mxfp8": dict(precision="fp8", fp8_recipe="mxfp8"),
    "nvfp4": dict(precision="nvfp4"),
}
# The share of a GPT's blocks, the last ones, whose Linears stay in bf16 under --precision nvfp4:
# the NVFP4 paper keeps a small share of its linear layers in BF16 (about 16% in its 12B model),
# the final blocks among them, the most sensitive to FP4; here the final blocks alone. The
# embeddings, the head, attention's BMMs and the norms stay bf16 as under fp8.
NVFP4_BF16_SHARE = 0.15


def quantizes_linears(config: TrainConfig) -> bool:
    """Whether the run gives Linears low-precision state: --precision fp8 or nvfp4."""
    return config.precision in ("fp8", "nvfp4")


def bf16_blocks(layers: int) -> int:
    """How many of the last blocks keep bf16 Linears under nvfp4: ceil(15% of --layers), so at
    least one (nanoGPT's 4 blocks: the 4th, 25%, the nearest whole block above 15%)."""
    return math.ceil(NVFP4_BF16_SHARE * layers)


def enable_nvfp4(model: nn.Module, config: TrainConfig) -> list[str]:
    """Give the GPT's Linears outside the last bf16_blocks blocks a BlockScaledMeta of NVFP4, each
    with --seed and its own index among the model's Linears (its random bits' stream); returns
    their names. The Linears of the last blocks keep no meta (bf16, nn.Linear's own GEMMs); the
    embedding, the tied head, attention's two BMMs, softmax and the LayerNorms are no Linears and
    stay bf16 as under --precision fp8. A GPT's top-level modules are the embeddings (0), the
    blocks (1 .. --layers) and the head."""
    last_nvfp4 = config.layers - bf16_blocks(config.layers)
    linears = [(name, module) for name, module in model.named_modules()
               if isinstance(module, nn.Linear)]
    enabled = []
    for index, (name, module) in enumerate(linears):
        if int(name.split(".")[0]) <= last_nvfp4:
            module.fp8_meta = BlockScaledMeta(NVFP4, seed=config.seed, layer=index)
            enabled.append(name)
    return enabled


def recipe(config: TrainConfig) -> Fp8Recipe | BlockScaling:
    """The scaling recipe --fp8-recipe names (with --fp8-amax-history and --fp8-margin), or
    NVFP4 with --precision nvfp4."""
    if config.precision == "nvfp4":
        return NVFP4
    if config.fp8_recipe in RECIPES:  # a scale per group (precision/recipes.py)
        return RECIPES[config.fp8_recipe]
    if config.fp8_recipe == "delayed":
        return DelayedScaling(margin=config.fp8_margin, amax_history_len=config.fp8_amax_history)
    return Float8CurrentScaling() if config.fp8_recipe == "current" else NoScaling()


def start_output_gradient_scales(quantizers: list[tuple[str, Fp8Quantizer]],
                                 replicas: int) -> None:
    """Delayed scaling's first output-gradient scales: 1/replicas (dp x cp), not 1.

    A replica's loss is the mean over its own rows and tokens, so its output gradients are
    dp x cp times one process's (parallel/amax.py), and the agreed amaxes make their scales
    1/(dp cp) times one process's from step 2 on: the same fp8 codes. At scale 1 in step 1 they
    would not be (E5M2 rounds x and 2x apart below its normals, where step 1's gradients lie):
    starting at 1/(dp cp) makes every step quantize them as one process does."""
    for name, quantizer in quantizers:
        if name.endswith(".grad_output") and quantizer.recipe.has_state:
            quantizer.scale = np.float32(1.0 / replicas)


class Fp8Run:
    """This rank's fp8 quantizers (those of its stage's layers), their agreement and metrics."""

    def __init__(self, model: nn.Module, ranges: list[tuple[int, int]], topology: Topology,
                 whole: nn.Module | None = None):
        """model: the model this rank trains, its Linears given Fp8Metas; ranges: this stage's
        layers, a range per chunk; whole: the whole model rank 0 evaluates, when `model` is a
        tensor-parallel shard of it (by default `model` itself)."""
        self.model, self.topology = model if whole is None else whole, topology
        self.trained = model
        self.quantizers = [
            (name, quantizer) for name, quantizer in nn.fp8_quantizers(model)
            if any(start <= int(name.split(".")[0]) < stop for start, stop in ranges)]
        # With --ep too: a rank records nothing for the experts it does not hold (0), so the
        # stage's MAX of an expert's amaxes is the MAX over its holders (parallel/amax.py).
        self.reduce_amax = AmaxReduction(topology.stage_group)
        start_output_gradient_scales(self.quantizers, topology.dp * topology.cp)
        # A few tensors to watch in the metrics: the first and the last dense Linear's three (an
        # expert's current scale is said by the ranks holding it, which rank 0 may not be).
        # A block-scaled recipe has no per-tensor scale to watch (the same on every rank).
        linears = [name for name, meta in nn.fp8_metas(model)
                   if expert_index(name) is None and meta.per_tensor]
        ends = (linears[0], linears[-1]) if linears else ()
        self.watched = [f"{linear}.{tensor}" for linear in ends for tensor in Fp8Meta.TENSORS]

    def begin_step(self, step: int) -> None:
        """Tell every block-scaled Linear the step (NVFP4 draws its random bits from it)."""
        for _, meta in nn.fp8_metas(self.trained):
            if isinstance(meta, BlockScaledMeta):
                meta.begin_step(step)

    def end_step(self, world: Communicator, timed: Callable) -> dict[str, dict]:
        """After the optimizer step, on every rank: the statistics of the watched tensors (one SUM
        all-reduce over the job), then this stage's next scales from amaxes agreed across its
        replicas, context shards and tensor-parallel shards. Returns {tensor: {"scale",
        "underflow", "saturated"}} for the metrics row. `timed(function, name)`: wraps the two
        collectives (the trainer times communication)."""
        statistics = (self._watched_statistics(timed(world.allreduce_scalars, "fp8_statistics"))
                      if self.watched else {})
        quantizers = [quantizer for _, quantizer in self.quantizers]
        update_scales(quantizers, timed(self.reduce_amax, "fp8_amax"))
        return statistics

    def _watched_statistics(self, allreduce_scalars: Callable) -> dict[str, dict[str, float]]:
        """Each watched tensor's scale this step (said by one rank of the stage that owns it:
        replica 0's context shard 0's tensor shard 0) and the fractions of its values, over every
        rank's share of the batch, that underflowed to zero or saturated."""
        own = dict(self.quantizers)
        table = np.zeros((len(self.watched), 4))  # scale, underflow, saturated, values
        for row, name in enumerate(self.watched):
            quantizer = own.get(name)
            if quantizer is not None:
                topology = self.topology  # one rank of the stage says the scale they share
                first = topology.dp_rank == topology.cp_rank == topology.tp_rank == 0
                scale = float(quantizer.scale) if first else 0.0
                table[row] = scale, quantizer.underflow, quantizer.saturated, quantizer.count
        table = allreduce_scalars(table.reshape(-1), "sum").reshape(table.shape)
        return {name: {"scale": float(scale), "underflow": float(underflow / max(count, 1)),
                       "saturated": float(saturated / max(count, 1))}
                for name, (scale, underflow, saturated, count) in zip(self.watched, table)}

    def state_arrays(self) -> dict[str, np.ndarray]:
        """This stage's fp8 state under checkpoint names ("fp8/3.attn.c_attn.input/scale")."""
        state = quantizers_state_dict(self.quantizers)
        return {PREFIX + key: array for key, array in state.items()}

    def checked_state(self, path: str, arrays: dict[str, np.ndarray]) -> dict | None:
        """This stage's state from a checkpoint's arrays, checked (CheckpointError if incomplete
        or wrong); None when the checkpoint holds no fp8 state (a bf16 run's, or a stateless
        recipe's): the scales then start at 1, as a new run's do."""
        state = strip_prefix(arrays, PREFIX)
        if not state:
            return None
        try:
            load_quantizers_state_dict(self.quantizers, state, check_only=True)
        except (KeyError, ValueError) as error:
            raise CheckpointError(f"checkpoint {path}: {error.args[0]}") from None
        return state

    def load_state(self, state: dict[str, np.ndarray]) -> None:
        """Load what checked_state returned into this stage's quantizers."""
        load_quantizers_state_dict(self.quantizers, state)

    def load_whole_model(self, merged: dict[str, np.ndarray]) -> None:
        """Every stage's fp8 state, gathered onto rank 0, into rank 0's whole model (before it
        evaluates the model on its own)."""
        state = strip_prefix(merged, PREFIX)
        if state:
            nn.load_fp8_state_dict(self.model, state)

