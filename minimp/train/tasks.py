"""What a run trains on, one class per dataset: the model, the global batches, the loss and the
evaluation. The training loop, the pipeline and data parallelism see only this interface.

  digits       an MLP over the 8x8 digits; evaluated by test accuracy
  shakespeare  a GPT over tiny-shakespeare's characters; evaluated by validation loss (nats per
               character): `--eval-batches` random batches every `--eval-every` steps, the whole
               validation split at the end
"""

from typing import Callable, Protocol, TypeVar

import numpy as np

from minimp import backend, functional, nn
from minimp.backend import Array
from minimp.checkpoints.errors import ConfigError
from minimp.data import global_batch_indices, load_digits, load_shakespeare, text_batch
from minimp.models.gpt import GPT, Block, GPTConfig
from minimp.models.mlp import build_model
from minimp.models.moe import AuxLossWeights, MoE
from minimp.tensor import Tensor, no_grad
from minimp.train.checks import flag
from minimp.train.config import TrainConfig

T = TypeVar("T")


def shipped(load: Callable[[], T], name: str) -> T:
    """The shipped dataset `name`, or ConfigError: a file damaged or replaced since installation
    (NaN pixels, a -1 label, a cut archive) is the installation's fault, not a bug to trace."""
    try:
        return load()
    except (ValueError, KeyError, OSError, EOFError) as error:
        raise ConfigError(f"--dataset {name}: the data shipped with minimp cannot be used "
                          f"({error}); reinstall minimp") from None


class Task(Protocol):
    """What a run trains on: all the training loop, the pipeline and data parallelism see of it."""

    unit: str  # what the progress line counts per second
    final_metric: str  # the name of evaluate's score in the summary and the metrics' last row
    model_flags: tuple[str, ...]  # the flags a checkpoint must be resumed with (model shapes)
    # What the model's own losses weigh (the MoE's auxiliary losses; None: it has none): the
    # training loop sets its grad_scale before each step's actions.
    aux_weights: AuxLossWeights | None

    def build_model(self, rng: np.random.Generator) -> nn.Sequential:
        """The whole float32 model, from the generator."""

    def global_batch(self, step: int) -> tuple[Array, Array]:
        """(inputs, targets) of the step's global batch, on the device; row r is sample r."""

    def sample_input(self, rows: int) -> Array:
        """A micro-batch of `rows` inputs, to learn the activation shapes at the pipeline cuts."""

    def is_block(self, layers: list[nn.Module]) -> bool:
        """What --recompute reruns."""

    def loss(self, logits: Tensor, targets: Array) -> Tensor:
        """The scalar loss of a micro-batch."""

    def evaluate(self, model: nn.Module, batches: int | None = None) -> float:
        """The score of the whole model's current weights."""


class DigitsTask:
    """The MLP on the shipped 8x8 digits: rows of 64 pixels, 10 classes."""

    unit = "samples"  # what the progress line counts per second
    final_metric = "test_accuracy"
    # The flags a checkpoint of this task must be resumed with (the model's shapes).
    model_flags: tuple[str, ...] = ("dataset", "layers", "hidden")
    aux_weights: AuxLossWeights | None = None  # the MLP has no loss of its own

    def __init__(self, config: TrainConfig, dtype: np.dtype):
        self.config, self.dtype = config, dtype
        self.dataset = shipped(load_digits, "digits")
        if config.batch_size > len(self.dataset.train_labels):
            raise ConfigError(f"--batch-size {config.batch_size} is larger than the training set "
                              f"({len(self.dataset.train_labels)} samples)")
        # The whole (small) training set sits on the device in the compute dtype: no casts later.
        self.images = backend.to_device(self.dataset.train_images).astype(dtype)
        self.labels = backend.to_device(self.dataset.train_labels)

    def build_model(self, rng: np.random.Generator) -> nn.Sequential:
        data, config = self.dataset, self.config
        return build_model(data.features, data.classes, config.hidden, config.layers, rng)

    def global_batch(self, step: int) -> tuple[Array, Array]:
        """(inputs, targets) of the step's global batch, on the device; row r is sample r."""
        config = self.config
        rows = global_batch_indices(config.seed, step, config.batch_size, len(self.labels))
        rows = backend.to_device(rows)
        return self.images[rows], self.labels[rows]

    def sample_input(self, rows: int) -> Array:
        """A micro-batch of `rows` inputs, to learn the activation shapes at the pipeline cuts."""
        return self.images[:rows]

    def is_block(self, layers: list[nn.Module]) -> bool:
        """What --recompute reruns: a hidden layer, Linear + ReLU (not the output Linear)."""
        return len(layers) > 1 and isinstance(layers[-1], nn.ReLU)

    def loss(self, logits: Tensor, targets: Array) -> Tensor:
        return functional.cross_entropy(logits, targets)

    def evaluate(self, model: nn.Module, batches: int | None = None) -> float:
        """Test accuracy (the whole test set; `batches` is ignored: it is small)."""
        images = backend.to_device(self.dataset.test_images).astype(self.dtype)
        labels, correct = self.dataset.test_labels, 0
        with no_grad():
            for start in range(0, len(labels), 512):
                logits = model(Tensor(images[start : start + 512])).data
                predictions = backend.to_numpy(logits.argmax(axis=1))  # argmax needs no widening
                correct += int((predictions == labels[start : start + 512]).sum())
        return correct / len(labels)


class ShakespeareTask:
    """A character-level GPT on tiny shakespeare (nanoGPT's shakespeare_char)."""

    unit = "tokens"
    final_metric = "val_loss"
    model_flags: tuple[str, ...] = ("dataset", "layers", "hidden", "heads", "context")

    def __init__(self, config: TrainConfig, dtype: np.dtype):
        self.config, self.dtype = config, dtype
        self.dataset = shipped(load_shakespeare, "shakespeare")
        self.gpt_config = GPTConfig(
            vocab_size=self.dataset.vocab_size, context=config.context, layers=config.layers,
            heads=config.heads, width=config.hidden, dropout=config.dropout,
            experts=config.experts, top_k=config.top_k, capacity_factor=config.capacity_factor,
            expert_hidden=config.expert_hidden)
        self.aux_weights: AuxLossWeights | None = (AuxLossWeights(
            config.aux_loss_coef, config.router_z_loss_coef) if config.experts else None)

    def build_model(self, rng: np.random.Generator) -> GPT:
        """The GPT; with --experts its mixtures weigh their auxiliary losses by aux_weights."""
        model = GPT(self.gpt_config, rng)
        for module in model.modules():
            if isinstance(module, MoE) and self.aux_weights is not None:
                module.aux_weights = self.aux_weights
        return model

    def global_batch(self, step: int) -> tuple[Array, Array]:
        config = self.config
        inputs, targets = text_batch(self.dataset.train, config.seed, step, config.batch_size,
                                     config.context)
        return backend.to_device(inputs), backend.to_device(targets)

    def sample_input(self, rows: int) -> Array:
        return backend.to_device(np.zeros((rows, self.config.context), np.int64))

    def is_block(self, layers: list[nn.Module]) -> bool:
        """What --recompute reruns: a transformer block (not the embeddings or the head)."""
        return isinstance(layers[0], Block)

    def loss(self, logits: Tensor, targets: Array) -> Tensor:
        """Mean cross-entropy over every position of every sample (nats per character).

        With --experts the gradient is that of ce + aux_loss_coef x aux + router_z_loss_coef x z
        (Switch's recipe), but the auxiliary losses are not added here: each mixture attaches
        its own to its output's graph (models/moe.py's AttachAuxLoss), where backward finds them
        on any pipeline stage and in a recomputed block. The value stays the cross-entropy (what
        the metrics' "loss" and the evaluations report; the metrics carry `aux_loss` apart)."""
        batch, tokens, vocabulary = logits.shape
        rows = logits.reshape(batch * tokens, vocabulary)  # (B*T, V)
        return functional.cross_entropy(rows, targets.reshape(batch * tokens))

    def evaluate(self, model: nn.Module, batches: int | None = None) -> float:
        """Validation loss: over `batches` random batches of windows (drawn once from the seed,
        so every evaluation scores the same windows and the curve is not noise), or with
        batches=None over the whole split, cut into consecutive windows of `--context`
        characters, each position predicting the next."""
        config, data = self.config, self.dataset.validation
        if batches is None:
            windows = (len(data) - 1) // config.context
            starts = np.arange(windows) * config.context
        else:
            rng = np.random.default_rng([config.seed, 2**31, batches])  # apart from training's
            starts = rng.integers(0, len(data) - config.context, size=batches * config.batch_size)
        total, count = 0.0, 0
        chunk = max(1, 32768 // config.context)  # windows per forward: 32,768 tokens at a time
        model.eval()
        try:
            with no_grad():
                for first in range(0, len(starts), chunk):
                    window = starts[first : first + chunk, None] + np.arange(config.context)
                    inputs = backend.to_device(data[window].astype(np.int64))
                    targets = backend.to_device(data[window + 1].astype(np.int64))
                    loss = self.loss(model(Tensor(inputs)), targets)
                    total, count = total + loss.item() * len(window), count + len(window)
        finally:
            model.train()
        return total / count


TASKS: dict[str, type[DigitsTask] | type[ShakespeareTask]] = {
    "digits": DigitsTask,
    "shakespeare": ShakespeareTask,
}


def resume_flags(config: TrainConfig) -> dict:
    """{"--seed": 0, ...}: the flags a checkpoint must be resumed with, as a checkpoint keeps them
    (the model, the batch order, the optimizer state's shapes and, in fp8, the meaning of the saved
    scaling state depend on them; the learning rate and --steps may change)."""
    names = (*TASKS[config.dataset].model_flags, "seed", "batch_size", "optimizer")
    if config.precision == "fp8":
        names += ("fp8_recipe", "fp8_amax_history", "fp8_margin")
    if config.experts:  # (only then: a dense checkpoint's flags stay as they were)
        names += ("experts", "top_k", "capacity_factor", "expert_hidden")
    return {flag(name): getattr(config, name) for name in names}
