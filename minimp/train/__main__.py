"""`python -m minimp.train`: parse flags, check them, train; errors are one line and a non-zero exit."""

import sys

from minimp.backend import DeviceError
from minimp.train.checkpoint import CheckpointError
from minimp.train.config import ConfigError, parse_config
from minimp.train.loop import train
from minimp.train.report import require_matplotlib

PROGRAM = "minimp.train"


def _mpi_world_size():
    """Number of ranks when started by mpirun (1 under plain python)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD.Get_size()


def main(argv=None):
    config = parse_config(argv)
    try:
        world_size = _mpi_world_size()
        if world_size > 1:
            raise ConfigError(f"this version trains on one process; it was started on {world_size} ranks "
                              "(run 'python -m minimp.train' without mpirun)")
        config.validate(world_size)
        if config.plot:
            require_matplotlib()
        print(f"{PROGRAM}: {config.describe()}", flush=True)
        train(config, log=lambda line: print(line, flush=True))
    except (ConfigError, CheckpointError, DeviceError, ImportError, ValueError) as error:
        print(f"{PROGRAM}: error: {error}", file=sys.stderr, flush=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
