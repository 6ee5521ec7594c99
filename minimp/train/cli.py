"""The command line of `python -m minimp.train`: one flag per TrainConfig field, generated from it,
with its default (or each dataset's) and its help; errors as one line.
"""

import argparse
import dataclasses

from minimp.checkpoints.errors import CommandParser
from minimp.train.checks import flag
from minimp.train.config import DATASET_DEFAULTS, TrainConfig


def build_parser(quiet: bool = False) -> argparse.ArgumentParser:
    """An argparse parser with one flag per TrainConfig field, its default and help shown; its
    errors are one line, `minimp.train: error: ...`, and under mpirun only rank 0 prints them
    (`quiet` elsewhere; every rank still exits with status 2)."""
    description = "Train an MLP on digits or a GPT on Shakespeare with minimp."
    parser = CommandParser("minimp.train", description, quiet=quiet)
    for config_field in dataclasses.fields(TrainConfig):
        name, metadata, default = config_field.name, config_field.metadata, config_field.default
        help_text = metadata["help"]
        kind = config_field.type if config_field.type in (int, float, bool) else str
        if metadata.get("by_dataset"):
            defaults = ", ".join(f"{dataset} {values[name]}"
                                 for dataset, values in DATASET_DEFAULTS.items())
            help_text, default = f"{help_text} (default: {defaults})", argparse.SUPPRESS
        elif default is None:  # derived from other flags; the help says how
            default = argparse.SUPPRESS
        if kind is bool and default is argparse.SUPPRESS:
            # A switch with a derived default: --overlap / --no-overlap, neither means "auto".
            parser.add_argument(flag(name), default=default, action=argparse.BooleanOptionalAction,
                                help=help_text)
        elif kind is bool:  # a switch: present means True
            parser.add_argument(flag(name), action="store_true", help=help_text)
        else:
            parser.add_argument(flag(name), type=kind, default=default, help=help_text,
                                choices=metadata.get("choices"))
    return parser


def parse_config(argv: list[str] | None = None, quiet: bool = False) -> TrainConfig:
    """TrainConfig from command-line arguments (argparse rejects unknown flags and bad types)."""
    return TrainConfig(**vars(build_parser(quiet=quiet).parse_args(argv)))
