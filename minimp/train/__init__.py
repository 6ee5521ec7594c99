"""The training command (`python -m minimp.train`): configuration, loop, checkpoints, reports."""

from minimp.checkpoints.errors import ConfigError
from minimp.train.cli import parse_config
from minimp.train.config import TrainConfig
from minimp.train.loop import train
from minimp.train.tasks import TASKS, build_model
