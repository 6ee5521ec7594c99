"""`python -m minimp.train` (or `mpirun -n 4 python -m minimp.train`): parse, check, train.

Bad input is one line, `minimp.train: error: ...`, printed by rank 0, and every rank exits
with status 2 before any message is exchanged, so nothing can hang. Any error after that
(an injected fault, a checkpoint that a rank cannot read) is printed by the rank that hit
it, which then aborts the whole job.
"""

import sys

from minimp.backend import DeviceError, check_device
from minimp.distributed import run_or_abort, world
from minimp.train.checkpoint import CheckpointError
from minimp.train.config import ConfigError, parse_config
from minimp.train.loop import train
from minimp.train.report import require_matplotlib

PROGRAM = "minimp.train"
# Errors a user can fix with a flag or a file; anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, CheckpointError, DeviceError, ImportError)


def _say_error(comm, error, every_rank=False):
    if comm.rank == 0 or every_rank:
        prefix = f"[rank {comm.rank}] " if every_rank and comm.size > 1 else ""
        print(f"{prefix}{PROGRAM}: error: {error}", file=sys.stderr, flush=True)


def _run(config, comm):
    try:
        train(config, log=lambda line: print(line, flush=True), comm=comm)
    except USER_ERRORS as error:
        _say_error(comm, error, every_rank=True)
        if comm.size > 1:
            comm.abort(2)  # the other ranks may be waiting for this one
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    comm = world()
    config = parse_config(argv, quiet=comm.rank != 0)
    try:
        config.validate(comm.size)
        if config.device:
            check_device(config.device)  # CuPy and a GPU are there, or one clear line from rank 0
        if config.plot:
            require_matplotlib()
    except USER_ERRORS as error:
        _say_error(comm, error)
        return 2
    if comm.rank == 0:
        print(f"{PROGRAM}: ranks={comm.size} {config.describe()}", flush=True)
    return run_or_abort(_run, config, comm, comm=comm)


if __name__ == "__main__":
    sys.exit(main())
