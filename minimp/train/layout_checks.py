"""The checks of a run's parallel layout, before anything is built: --tp's cuts (whole heads, the
MLP's pairs, sequence parallelism's slices), the dp x tp x pp grid against the job's ranks, and the
pipeline schedule against the layers and micro-batches.

Each check raises ConfigError naming the flag and the fix; nothing here allocates or communicates.
"""

from typing import Any

from minimp.parallel.pipeline.stage import FIRST_TAG
from minimp.parallel.pipeline.schedules import schedule_problem
from minimp.checkpoints.errors import ConfigError
from minimp.train.sizes import weighted_layers


def check_layout(config: Any, world_size: int) -> None:
    if config.tp > world_size:  # said as such, before what it would cut
        raise ConfigError(
            f"--tp {config.tp} is more than the {world_size} ranks of this job (start at least "
            f"{config.tp} ranks with mpirun -n)"
        )
    _check_tensor_parallel(config)
    _check_grid(config, world_size)
    _check_schedule(config)


def _check_tensor_parallel(config: Any) -> None:
    """--tp cuts whole heads (GPT) or hidden layers in pairs (MLP); --sequence-parallel needs
    --tp, a sequence, and a context the ranks share equally."""
    if not isinstance(config.sequence_parallel, bool):
        raise ConfigError(
            f"--sequence-parallel is a switch (True or False), got {config.sequence_parallel!r}"
        )
    tp = config.tp
    if config.sequence_parallel and tp == 1:
        raise ConfigError(
            "--sequence-parallel splits the sequence over the tensor-parallel ranks: it needs "
            "--tp 2 or more"
        )
    if tp == 1:
        return
    if config.model == "gpt":
        if config.heads % tp:
            raise ConfigError(
                f"--tp {tp} splits the attention heads across ranks, and --heads {config.heads} "
                f"does not divide by {tp} (use --heads divisible by --tp)"
            )
        if config.sequence_parallel and config.context % tp:
            raise ConfigError(
                f"--sequence-parallel gives each of the --tp {tp} ranks an equal slice of the "
                f"sequence, and --context {config.context} does not divide by {tp} "
                "(use a multiple of --tp)"
            )
        return
    if config.sequence_parallel:
        raise ConfigError(
            "--sequence-parallel splits a sequence: it needs the GPT (--dataset shakespeare)"
        )
    if config.layers % 2:
        raise ConfigError(
            f"--tp {tp} pairs the MLP's hidden layers (column-parallel, then row-parallel), and "
            f"--layers {config.layers} is odd (use an even --layers)"
        )
    if config.hidden % tp:
        raise ConfigError(
            f"--tp {tp} splits each hidden layer's {config.hidden} features, which do not divide "
            f"by {tp} (use --hidden divisible by --tp)"
        )


def _check_grid(config: Any, world_size: int) -> None:
    """--dp x --tp x --pp must tile the job's ranks, and the model must have a layer per
    stage."""
    if config.pp > weighted_layers(config):
        what = "embeddings, blocks and head" if config.model == "gpt" else "hidden + output"
        if config.model == "mlp" and config.tp > 1:
            what = "hidden pairs + output: --tp keeps each pair on one stage"
        raise ConfigError(
            f"--pp {config.pp} needs at least {config.pp} layers with weights, the model has "
            f"{weighted_layers(config)} ({what}; use --layers)"
        )
    model_parallel = config.pp * config.tp
    if world_size % model_parallel:
        what = f"--pp {config.pp}" if config.tp == 1 else f"--tp {config.tp} x --pp {config.pp}"
        raise ConfigError(
            f"{what} does not divide the {world_size} ranks of this job "
            f"(start a multiple of {model_parallel} ranks with mpirun -n)"
        )
    dp = config.data_parallel_size(world_size)
    if dp * model_parallel != world_size:
        raise ConfigError(
            f"--dp {dp} does not match the {world_size} ranks of this job (use --dp "
            f"{world_size // model_parallel}, or start {dp * model_parallel} ranks with mpirun -n)"
        )


def _check_schedule(config: Any) -> None:
    """The schedule exists for these sizes, the layers cut into --pp x --virtual-stages chunks,
    every message has a tag MPI guarantees (up to 32767), and zb-h1's split backward meets no
    recomputed block."""
    problem = schedule_problem(
        config.schedule, config.pp, config.micro_batches, config.virtual_stages
    )
    if problem:
        raise ConfigError(problem)
    chunks = config.pp * config.virtual_stages
    if chunks > weighted_layers(config):
        raise ConfigError(
            f"--pp {config.pp} x --virtual-stages {config.virtual_stages} needs {chunks} layers "
            f"with weights, the model has {weighted_layers(config)} (use --layers)"
        )
    if config.pp > 1 and FIRST_TAG + 2 * config.virtual_stages * config.micro_batches > 32767:
        raise ConfigError(
            f"--micro-batches {config.micro_batches} x --virtual-stages "
            f"{config.virtual_stages} needs more message tags than MPI guarantees (32767): "
            "use fewer micro-batches"
        )
    if config.schedule == "zb-h1" and config.recompute:
        raise ConfigError(
            "--schedule zb-h1 does not work with --recompute: a recomputed block's backward "
            "computes its weights' gradients together with its input's, so they cannot be split "
            "into B and W (use --schedule 1f1b with --recompute)"
        )
