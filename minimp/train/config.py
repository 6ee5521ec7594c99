"""Training configuration: one dataclass, and the argparse CLI generated from it field by field."""

import argparse
import dataclasses
import math
from dataclasses import dataclass, field

from minimp.train.errors import ConfigError


def _flag(default, help, **extra):
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    precision: str = _flag(
        "fp16", "activation dtype; masters are always fp32", choices=("fp32", "fp16", "bf16")
    )
    loss_scale: str = _flag(
        "auto", "'dynamic', 'none' or a number; auto = dynamic for fp16, none otherwise"
    )
    loss_scale_growth_interval: int = _flag(2000, "clean steps before the dynamic scale doubles")
    steps: int = _flag(
        500, "total number of optimizer steps (numbered from 1; a resume continues to it)"
    )
    batch_size: int = _flag(64, "global batch size (samples per optimizer step, over all ranks)")
    micro_batches: int = _flag(
        1, "split each batch into this many micro-batches (gradient accumulation)"
    )
    lr: float = _flag(1e-3, "learning rate")
    optimizer: str = _flag(
        "adam", "optimizer updating the fp32 masters", choices=("sgd", "adam", "adamw")
    )
    momentum: float = _flag(0.9, "SGD momentum")
    weight_decay: float = _flag(0.0, "weight decay (L2 for sgd/adam, decoupled for adamw)")
    max_grad_norm: float = _flag(0.0, "clip the unscaled gradient norm to this (0 = no clipping)")
    seed: int = _flag(0, "seed of the initial weights and of the batch order")
    layers: int = _flag(4, "number of hidden layers (Linear + ReLU each)")
    hidden: int = _flag(128, "width of every hidden layer")
    dataset: str = _flag("digits", "dataset shipped with minimp", choices=("digits",))
    device: str = _flag(
        "", "cpu or gpu (default: $MINIMP_DEVICE, else cpu)", choices=("", "cpu", "gpu")
    )
    save: str = _flag("", "write a checkpoint (.npz) here at the end")
    resume: str = _flag("", "continue from this checkpoint (.npz)")
    metrics: str = _flag("", "write one JSON object per step to this .jsonl file")
    plot: str = _flag("", "draw loss and loss scale to this .png (needs matplotlib)")
    log_every: int = _flag(50, "print a progress line every this many steps")
    inject_overflow: str = _flag(
        "", "STEP:RANK: make that rank's gradients non-finite at that step"
    )
    threads: int = _flag(0, "BLAS threads per rank (0 = this machine's cores / its ranks)")
    dp: int = _flag(0, "data-parallel replicas (0 = the job's ranks / --pp)")
    pp: int = _flag(1, "pipeline stages: the layers are split into this many contiguous stages")
    schedule: str = _flag("1f1b", "pipeline schedule", choices=("gpipe", "1f1b"))
    timeline: str = _flag("", "write each stage's forward/backward times to this .json file")
    bucket_mb: float = _flag(25.0, "gradient bucket size in MiB for the data-parallel all-reduce")
    grad_comm_dtype: str = _flag("fp32", "dtype of gradients on the wire", choices=("fp32", "fp16"))
    grad_average: str = _flag(
        "before",
        "divide by the number of replicas before or after the all-reduce",
        choices=("before", "after"),
    )
    check_replicas: int = _flag(
        0, "every this many steps, compare the replicas' weights (0 = never)"
    )
    inject_fault: str = _flag(
        "", "STEP:RANK: raise an error on that rank at that step (see a failure)"
    )
    save_every: int = _flag(0, "also save --save every this many steps (0 = only at the end)")
    max_consecutive_skips: int = _flag(
        100, "stop with an error after this many skipped steps in a row (0 = never)"
    )
    timeout: float = _flag(
        600.0, "abort the job when one message waits longer than this many seconds (0 = never)"
    )

    def data_parallel_size(self, world_size: int) -> int:
        """The resolved --dp: the job's ranks divided by --pp unless given."""
        return self.dp or max(1, world_size // max(self.pp, 1))

    def validate(self, world_size: int = 1) -> None:
        """Raise ConfigError naming the flag and the fix for the first value that cannot work."""
        self._check_ranges()
        self._check_grid(world_size)
        self._check_batch(self.data_parallel_size(world_size))
        if self.save_every and not self.save:
            raise ConfigError("--save-every needs --save (the path to save to)")
        self.loss_scale_kind()
        self.overflow_injection(world_size)
        self.fault_injection(world_size)

    def _check_ranges(self) -> None:
        """Every number inside its range (NaN fails every comparison, so it is caught too)."""
        for name in POSITIVE_INTEGERS:
            if getattr(self, name) <= 0:
                raise ConfigError(
                    f"--{_dashed(name)} must be a positive integer, got {getattr(self, name)}"
                )
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(f"--lr must be a positive number, got {self.lr}")
        for name in NON_NEGATIVE:
            value = getattr(self, name)
            if not (value >= 0 and math.isfinite(value)):
                raise ConfigError(f"--{_dashed(name)} must be 0 or more, got {value}")
        if not (self.bucket_mb > 0 and math.isfinite(self.bucket_mb)):
            raise ConfigError(f"--bucket-mb must be a positive number, got {self.bucket_mb}")
        if not (self.timeout >= 0 and math.isfinite(self.timeout)):
            raise ConfigError(f"--timeout must be 0 (never) or seconds, got {self.timeout}")

    def _check_grid(self, world_size: int) -> None:
        """--dp x --pp must tile the job's ranks, and the model must have a layer per stage."""
        if self.pp > self.layers + 1:
            raise ConfigError(
                f"--pp {self.pp} needs at least {self.pp} layers with weights, the model has "
                f"{self.layers + 1} ({self.layers} hidden + output; use --layers)"
            )
        if world_size % self.pp:
            raise ConfigError(
                f"--pp {self.pp} does not divide the {world_size} ranks of this job "
                f"(start a multiple of {self.pp} ranks with mpirun -n)"
            )
        dp = self.data_parallel_size(world_size)
        if dp * self.pp != world_size:
            raise ConfigError(
                f"--dp {dp} does not match the {world_size} ranks of this job "
                f"(use --dp {world_size // self.pp}, or start {dp * self.pp} ranks with mpirun -n)"
            )

    def _check_batch(self, dp: int) -> None:
        """Each replica takes an equal share of the batch, cut into equal micro-batches."""
        if self.batch_size % dp:
            raise ConfigError(
                f"--batch-size {self.batch_size} is not divisible by the {dp} data-parallel "
                f"replicas (use a multiple of {dp})"
            )
        local = self.batch_size // dp
        if local % self.micro_batches:
            raise ConfigError(
                f"each replica's batch of {local} is not divisible by "
                f"--micro-batches {self.micro_batches} "
                f"(pick a batch size that is a multiple of {dp * self.micro_batches})"
            )

    def parameter_count(self) -> int:
        """Parameters of the model these flags build (before it is built)."""
        features, classes = DATASET_SHAPES[self.dataset]
        width, count = features, 0
        for _ in range(self.layers):
            count, width = count + width * self.hidden + self.hidden, self.hidden
        return count + width * classes + classes

    def check_memory(self, ranks_on_this_node: int, available: int) -> None:
        """Refuse, before anything is allocated, a model that cannot fit: every rank builds the
        whole model in float32 and in the compute dtype (6 bytes a parameter), and keeps for its
        stage a float32 master, gradient accumulator and two optimizer slots, a 16-bit gradient
        and two wire buffers (26 bytes a parameter, over --pp stages), plus its activations (at
        most the whole batch: 12 bytes per row, width and layer bound them)."""
        parameters = self.parameter_count()
        per_rank = 6 * parameters + 26 * parameters // self.pp
        per_rank += 12 * self.batch_size * self.hidden * (self.layers + 1)
        needed = per_rank * ranks_on_this_node
        if needed > available:
            raise ConfigError(
                f"the model has {parameters:,} parameters: about {needed / 2**30:.1f} GiB for the "
                f"{ranks_on_this_node} rank(s) on this machine, which has "
                f"{available / 2**30:.1f} GiB free (lower --hidden or --layers)"
            )

    def describe(self) -> str:
        """The resolved configuration on one line, as rank 0 prints it at start."""
        kind, value = self.loss_scale_kind()
        settings = dataclasses.asdict(self)
        settings["loss_scale"] = f"{kind}" if value is None else f"static {value:g}"
        return "config " + " ".join(
            f"{key}={value}" for key, value in settings.items() if value != ""
        )

    def loss_scale_kind(self) -> tuple[str, float | None]:
        """('dynamic'|'none'|'static', value) after resolving 'auto' by precision."""
        text = self.loss_scale.strip().lower()
        if text == "auto":
            return ("dynamic", None) if self.precision == "fp16" else ("none", None)
        if text in ("dynamic", "none"):
            return text, None
        try:
            value = float(text)
        except ValueError:
            raise ConfigError(
                f"--loss-scale must be 'dynamic', 'none' or a number, got {self.loss_scale!r}"
            )
        if not (value > 0 and math.isfinite(value)):
            raise ConfigError(
                f"--loss-scale must be a positive finite number, got {self.loss_scale}"
            )
        return "static", value

    def overflow_injection(self, world_size: int = 1, after: int = 0) -> tuple[int, int] | None:
        """(step, rank) from --inject-overflow STEP:RANK, or None; `after`: the step a resumed
        run starts after (an injection that can never fire is an error, not silence)."""
        return self._injection("--inject-overflow", self.inject_overflow, world_size, after)

    def fault_injection(self, world_size: int = 1, after: int = 0) -> tuple[int, int] | None:
        """(step, rank) from --inject-fault STEP:RANK, or None."""
        return self._injection("--inject-fault", self.inject_fault, world_size, after)

    def _injection(self, flag: str, text: str, world_size: int, after: int):
        if not text:
            return None
        try:
            step, rank = (int(part) for part in text.split(":"))
        except ValueError:
            raise ConfigError(f"{flag} takes STEP:RANK (e.g. 5:0), got {text!r}") from None
        if not 0 <= rank < world_size:
            raise ConfigError(f"{flag} {text}: the rank must lie in 0..{world_size - 1}")
        if not after < step <= self.steps:
            raise ConfigError(
                f"{flag} {text} can never fire: this run takes steps {after + 1}..{self.steps}"
            )
        return step, rank


POSITIVE_INTEGERS = (
    "steps",
    "batch_size",
    "micro_batches",
    "layers",
    "hidden",
    "log_every",
    "loss_scale_growth_interval",
    "pp",
)
# (input features, classes) of each dataset, known before it is loaded (tests check they match).
DATASET_SHAPES = {"digits": (64, 10)}
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
)


def _dashed(name):
    return name.replace("_", "-")


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors read `minimp.train: error: ...` like every other error of the
    command, and under mpirun only rank 0 prints them (every rank still exits with status 2)."""

    def __init__(self, *args, quiet=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def error(self, message):
        self.exit(2, None if self.quiet else f"minimp.train: error: {message} (see --help)\n")


def build_parser(
    prog: str = "python -m minimp.train", quiet: bool = False
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per TrainConfig field, its default and help shown."""
    parser = _Parser(
        prog=prog,
        quiet=quiet,
        description="Train an MLP with minimp (mixed precision).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for config_field in dataclasses.fields(TrainConfig):
        metadata = config_field.metadata
        parser.add_argument(
            f"--{_dashed(config_field.name)}",
            dest=config_field.name,
            type=config_field.type if config_field.type in (int, float) else str,
            default=config_field.default,
            help=metadata["help"],
            choices=metadata.get("choices"),
        )
    return parser


def parse_config(argv: list[str] | None = None, quiet: bool = False) -> TrainConfig:
    """TrainConfig from command-line arguments
    (argparse itself rejects unknown flags and bad types)."""
    namespace = build_parser(quiet=quiet).parse_args(argv)
    return TrainConfig(**vars(namespace))
