"""The checks of a training configuration, run before anything is built: every number in its range
(NaN and inf included), the parallel layout (layout_checks.py: the dp x tp x pp grid, --tp's cuts,
the schedule), the batch split, ZeRO's shards, injections. (What the model weighs, and whether it
fits in memory: minimp/train/sizes.py.)

Each check raises ConfigError naming the flag and the fix; nothing here allocates or communicates.
"""

import math
import os
from typing import Any

from minimp.backend import DEVICE_ENVIRONMENT_VARIABLE
from minimp.checkpoints.errors import ConfigError
from minimp.train.layout_checks import check_layout
from minimp.train.sizes import zero_unit_sizes

POSITIVE_INTEGERS = (
    "steps",
    "batch_size",
    "micro_batches",
    "layers",
    "hidden",
    "log_every",
    "loss_scale_growth_interval",
    "pp",
    "tp",
    "virtual_stages",
)
NON_NEGATIVE = (
    "weight_decay",
    "max_grad_norm",
    "momentum",
    "dp",
    "threads",
    "check_replicas",
    "seed",
    "save_every",
    "max_consecutive_skips",
    "warmup",
    "lr_decay_steps",
    "eval_every",
    "eval_batches",
    "heads",
    "context",
    "zero",
)
def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def validate(config: Any, world_size: int) -> None:
    _check_ranges(config)
    _check_fp8(config)
    _check_model(config)
    check_layout(config, world_size)
    _check_batch(config, config.data_parallel_size(world_size))
    _check_zero(config, config.data_parallel_size(world_size))
    if config.save_every and not config.save:
        raise ConfigError("--save-every needs --save (the path to save to)")
    _check_distinct_files(config)
    loss_scale_kind(config)
    injection(config, "--inject-overflow", world_size, 0)
    injection(config, "--inject-fault", world_size, 0)


def _check_ranges(config: Any) -> None:
    """Every number inside its range (NaN fails every comparison, so it is caught too)."""
    for name in POSITIVE_INTEGERS:
        if getattr(config, name) <= 0:
            value = getattr(config, name)
            raise ConfigError(f"{_flag(name)} must be a positive integer, got {value}")
    for name in ("lr", "min_lr", "bucket_mb"):
        value = getattr(config, name)
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(f"{_flag(name)} must be a positive number, got {value}")
    for name in NON_NEGATIVE:
        value = getattr(config, name)
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{_flag(name)} must be 0 or more, got {value}")
    if not (config.timeout >= 0 and math.isfinite(config.timeout)):
        raise ConfigError(f"--timeout must be 0 (never) or seconds, got {config.timeout}")
    if not 0.0 <= config.dropout < 1.0:
        raise ConfigError(f"--dropout must lie in [0, 1), got {config.dropout}")
    if not 0.0 <= config.beta2 < 1.0:
        raise ConfigError(f"--beta2 must lie in [0, 1), got {config.beta2}")
    if config.min_lr > config.lr:
        raise ConfigError(f"--min-lr {config.min_lr} is above --lr {config.lr}")


FP8_RECIPES = ("delayed", "current", "none")
FP8_FLAGS = ("fp8_recipe", "fp8_amax_history", "fp8_margin")


def _check_fp8(config: Any) -> None:
    """fp8 flags only with --precision fp8, a known recipe, delayed scaling's numbers in range,
    and the CPU (the emulation casts with ml_dtypes, on NumPy arrays)."""
    given = [name for name in FP8_FLAGS if getattr(config, name) is not None]
    if config.precision != "fp8":
        if given:
            raise ConfigError(f"{_flag(given[0])} needs --precision fp8")
        return
    if config.fp8_recipe not in FP8_RECIPES:
        raise ConfigError(
            f"--fp8-recipe must be one of {', '.join(FP8_RECIPES)}, got {config.fp8_recipe!r}"
        )
    device = config.device or os.environ.get(DEVICE_ENVIRONMENT_VARIABLE, "").strip().lower()
    if device == "gpu":
        raise ConfigError(
            "--precision fp8 is emulated on the CPU (ml_dtypes casts NumPy arrays); "
            "use --device cpu"
        )
    if config.fp8_recipe != "delayed":
        for name in ("fp8_amax_history", "fp8_margin"):  # delayed scaling's numbers
            if getattr(config, name) is not None:
                raise ConfigError(f"{_flag(name)} applies to --fp8-recipe delayed only")
        return
    if config.fp8_amax_history < 1:
        raise ConfigError(
            f"--fp8-amax-history must be a positive integer, got {config.fp8_amax_history}"
        )
    if not 0 <= config.fp8_margin <= 64:
        raise ConfigError(f"--fp8-margin must lie in 0..64, got {config.fp8_margin}")


def _check_model(config: Any) -> None:
    """The model fits its data: the GPT reads text, the MLP images; heads divide the width."""
    wanted = {"digits": "mlp", "shakespeare": "gpt"}[config.dataset]
    if config.model != wanted:
        raise ConfigError(
            f"--model {config.model} does not train on --dataset {config.dataset} "
            f"(use --model {wanted})"
        )
    if config.model == "gpt":
        if config.heads < 1 or config.hidden % config.heads:
            raise ConfigError(
                f"--heads {config.heads} must divide --hidden {config.hidden} (each head takes "
                "an equal slice of the width)"
            )
        if config.context < 1:
            raise ConfigError(f"--context must be a positive integer, got {config.context}")


def _check_batch(config: Any, dp: int) -> None:
    """Each replica takes an equal share of the batch, cut into equal micro-batches."""
    if config.batch_size % dp:
        raise ConfigError(
            f"--batch-size {config.batch_size} is not divisible by the {dp} data-parallel "
            f"replicas (use a multiple of {dp})"
        )
    local = config.batch_size // dp
    if local % config.micro_batches:
        raise ConfigError(
            f"each replica's batch of {local} is not divisible by "
            f"--micro-batches {config.micro_batches} "
            f"(pick a batch size that is a multiple of {dp * config.micro_batches})"
        )


def _check_zero(config: Any, dp: int) -> None:
    """A ZeRO stage that exists, sharding that leaves no replica empty-handed, and no flag that
    needs the replicas to hold the same state."""
    if config.zero not in (0, 1, 2, 3):
        raise ConfigError(f"--zero must be 0, 1, 2 or 3 (ZeRO's stages), got {config.zero}")
    if not isinstance(config.recompute, bool):
        raise ConfigError(f"--recompute is a switch (True or False), got {config.recompute!r}")
    if not config.zero:
        return
    if config.check_replicas:
        raise ConfigError(
            f"--check-replicas compares the replicas' masters, and --zero {config.zero} gives "
            "each replica a different part of them (use --zero 0 to check replicas)"
        )
    for stage, sizes in enumerate(zero_unit_sizes(config)):
        if max(sizes) < dp:
            raise ConfigError(
                f"--zero {config.zero} over --dp {dp}: pipeline stage {stage}'s largest layer "
                f"has {max(sizes)} parameters, so some replicas would hold none of that stage "
                f"(use --dp {max(sizes)} or fewer, a wider model, or --zero 0)"
            )


def _check_distinct_files(config: Any) -> None:
    """Every file the run writes has a path of its own, and none is the checkpoint it resumes
    from (except --save, which may continue a checkpoint in place): one would overwrite another."""
    files = [
        (_flag(name), os.path.realpath(getattr(config, name)))
        for name in ("resume", "save", "metrics", "timeline", "plot")
        if getattr(config, name)
    ]
    for index, (flag, path) in enumerate(files):
        for other, other_path in files[index + 1 :]:
            if path == other_path and {flag, other} != {"--resume", "--save"}:
                raise ConfigError(
                    f"{other} {getattr(config, other[2:])} is also {flag}'s file, and one would "
                    "overwrite the other: give each its own path"
                )


def loss_scale_kind(config: Any) -> tuple[str, float | None]:
    """('dynamic'|'none'|'static', value) after resolving 'auto' by precision."""
    text = config.loss_scale.strip().lower()
    if text == "auto":
        return ("dynamic", None) if config.precision == "fp16" else ("none", None)
    if text in ("dynamic", "none"):
        return text, None
    try:
        value = float(text)
    except ValueError:
        raise ConfigError(
            f"--loss-scale must be 'dynamic', 'none' or a number, got {config.loss_scale!r}"
        ) from None
    if not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"--loss-scale must be a positive finite number, got {config.loss_scale}")
    return "static", value


def injection(config: Any, flag: str, world_size: int, after: int) -> tuple[int, int] | None:
    """(step, rank) from STEP:RANK of --inject-overflow or --inject-fault, or None."""
    text = getattr(config, flag[2:].replace("-", "_"))
    if not text:
        return None
    try:
        step, rank = (int(part) for part in text.split(":"))
    except ValueError:
        raise ConfigError(f"{flag} takes STEP:RANK (e.g. 5:0), got {text!r}") from None
    if not 0 <= rank < world_size:
        raise ConfigError(f"{flag} {text}: the rank must lie in 0..{world_size - 1}")
    if not after < step <= config.steps:
        raise ConfigError(
            f"{flag} {text} can never fire: this run takes steps {after + 1}..{config.steps}"
        )
    return step, rank
