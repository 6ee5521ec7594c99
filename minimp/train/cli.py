"""The command line of `python -m minimp.train`: one flag per TrainConfig field, generated from it,
with its default (or each dataset's) and its help; errors as one line.
"""

import argparse
import dataclasses
from typing import Any, NoReturn

from minimp.train.checks import flag
from minimp.train.config import DATASET_DEFAULTS, TrainConfig


class _Parser(argparse.ArgumentParser):
    """argparse, but its errors read `minimp.train: error: ...` like every other error of the
    command, and under mpirun only rank 0 prints them (every rank still exits with status 2)."""

    def __init__(self, *args: Any, quiet: bool = False, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.quiet = quiet

    def error(self, message: str) -> NoReturn:
        self.exit(2, None if self.quiet else f"minimp.train: error: {message} (see --help)\n")


def build_parser(
    prog: str = "python -m minimp.train", quiet: bool = False
) -> argparse.ArgumentParser:
    """An argparse parser with one flag per TrainConfig field, its default and help shown."""
    parser = _Parser(
        prog=prog,
        quiet=quiet,
        description="Train an MLP on digits or a GPT on Shakespeare with minimp.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for config_field in dataclasses.fields(TrainConfig):
        metadata, help_text = config_field.metadata, config_field.metadata["help"]
        default = config_field.default
        if metadata.get("by_dataset"):
            defaults = ", ".join(
                f"{dataset} {values[config_field.name]}"
                for dataset, values in DATASET_DEFAULTS.items()
            )
            help_text, default = f"{help_text} (default: {defaults})", argparse.SUPPRESS
        elif default is None:  # derived from other flags; the help says how
            default = argparse.SUPPRESS
        if _type_of(config_field.name) is bool and default is argparse.SUPPRESS:
            # A switch with a derived default: --overlap / --no-overlap, neither means "auto".
            parser.add_argument(
                flag(config_field.name), dest=config_field.name, default=argparse.SUPPRESS,
                action=argparse.BooleanOptionalAction, help=help_text,
            )  # fmt: skip
            continue
        if _type_of(config_field.name) is bool:  # a switch: present means True
            parser.add_argument(
                flag(config_field.name), dest=config_field.name, action="store_true",
                help=help_text,
            )  # fmt: skip
            continue
        parser.add_argument(
            flag(config_field.name),
            dest=config_field.name,
            type=_type_of(config_field.name),
            default=default,
            help=help_text,
            choices=metadata.get("choices"),
        )
    return parser


def _type_of(name: str) -> type:
    hint = TrainConfig.__annotations__[name]
    return hint if hint in (int, float, bool) else str


def parse_config(argv: list[str] | None = None, quiet: bool = False) -> TrainConfig:
    """TrainConfig from command-line arguments (argparse rejects unknown flags and bad types)."""
    namespace = build_parser(quiet=quiet).parse_args(argv)
    return TrainConfig(**vars(namespace))
