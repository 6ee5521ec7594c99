"""Errors for people: what a user can fix with a flag or a file, and how every rank agrees on one.

A user error is one line, `minimp.train: error: ...`, printed once, and every rank exits with a
non-zero status. When all ranks meet the error at the same point (bad flags, a setup step that
failed on some rank, a run that diverged: the loss and the skip decision are the same everywhere)
no rank is left waiting, so the job ends without MPI_Abort and without a line per rank.
"""

from minimp.backend import DeviceError
from minimp.distributed.protocol import Communicator


class ConfigError(ValueError):
    """A flag value that cannot work; the message says what to change."""


class CheckpointError(ValueError):
    """A checkpoint that is missing, unreadable, or written for another model or run."""


class DivergenceError(RuntimeError):
    """Training cannot learn any more (non-finite loss, or every step skipped for too long)."""


# Errors a user can fix with a flag or a file; anything else is a bug and keeps its traceback.
USER_ERRORS = (ConfigError, CheckpointError, DeviceError, DivergenceError, ImportError)


class AgreedError(Exception):
    """A user error that every rank of the job raised at the same point: `speaker` says whether
    this rank prints it (exactly one does), `exit_code` what every rank exits with."""

    def __init__(self, error: BaseException, speaker: bool, exit_code: int = 2):
        super().__init__(str(error))
        self.error, self.speaker, self.exit_code = error, speaker, exit_code


def agree_on_error(comm: Communicator, error: BaseException | None) -> None:
    """Every rank calls this with the user error it met (or None). If any rank met one, every rank
    raises AgreedError, and the lowest such rank is the one that prints its message. One small
    all-reduce: call it where all ranks are, between two collectives."""
    code = float(comm.rank if error is not None else comm.size)
    first = int(comm.allreduce_scalars([code], op="min")[0])
    if first == comm.size:
        return
    if error is None:  # another rank failed: follow it quietly
        error = ConfigError(f"rank {first} could not start")
    exit_code = 1 if isinstance(error, DivergenceError) else 2
    raise AgreedError(error, speaker=comm.rank == first, exit_code=exit_code)
