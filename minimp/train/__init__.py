"""The training command (`python -m minimp.train`): configuration, loop, checkpoints, reports."""

from minimp.train.config import ConfigError, TrainConfig, parse_config
from minimp.train.build import build_model, evaluate
from minimp.train.loop import train

__all__ = ["ConfigError", "TrainConfig", "build_model", "evaluate", "parse_config", "train"]
