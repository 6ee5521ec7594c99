"""Errors for people: what a user can fix with a flag or a file, and how every rank agrees on one.

A user error is one line, `minimp.train: error: ...`, printed once, and every rank exits with a
non-zero status; train, sample and export say their bad flags and user errors so (the parser and the
runner below). When all ranks meet the error at the same point (bad flags, a setup step that failed
on some rank, a run that diverged: the loss and the skip decision are the same everywhere) no rank
is left waiting, so the job ends without MPI_Abort and without a line per rank.
"""

import argparse
import os
import sys
from typing import Any, Callable, NoReturn

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


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the program is (files.exit_cleanly_on_sigterm): it unwinds as Ctrl-C
    does, and the command says `terminated` and exits 143 (128 + SIGTERM) instead of 130."""


def stopped_by(stop: KeyboardInterrupt) -> tuple[str, int]:
    """(what stopped the command, its exit status): Ctrl-C or SIGTERM."""
    return ("terminated", 143) if isinstance(stop, Terminated) else ("interrupted", 130)


class AgreedError(Exception):
    """A user error that every rank of the job raised at the same point: `speaker` says whether
    this rank prints it (exactly one does), `exit_code` what every rank exits with."""

    def __init__(self, error: BaseException, speaker: bool, exit_code: int = 2):
        super().__init__(str(error))
        self.error, self.speaker, self.exit_code = error, speaker, exit_code


def agree_on_error(comm: Communicator, work: Callable[[], object]) -> None:
    """Every rank calls this with its work (what may fail for a user's reason, and sends no
    message), which raises the user error it met or none. If any rank met one, every rank raises
    AgreedError, and the lowest such rank is the one that prints its message. One small all-reduce
    after the work: call it where all ranks are, between two collectives."""
    error = None
    try:
        work()
    except USER_ERRORS as caught:
        error = caught
    code = float(comm.rank if error is not None else comm.size)
    first = int(comm.allreduce_scalars([code], op="min")[0])
    if first == comm.size:
        return
    if error is None:  # another rank failed: follow it quietly
        error = ConfigError(f"rank {first} could not start")
    exit_code = 1 if isinstance(error, DivergenceError) else 2
    raise AgreedError(error, speaker=comm.rank == first, exit_code=exit_code)


class _DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """argparse's `(default: X)` after each help, but not `(default: )` or `(default: None)` (an
    output not written, a flag not given, a required flag), nor twice where the help already says
    its default; choices shown without the empty one."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        blank = isinstance(action.default, str) and not action.default.strip()  # "", "\n"
        if blank or action.default is None or action.required or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)

    def _metavar_formatter(self, action: argparse.Action, default_metavar: str) -> Any:
        if action.choices is not None and "" in action.choices:
            shown = "{" + ",".join(str(c) for c in action.choices if c != "") + "}"
            return lambda size: (shown,) * size if isinstance(size, int) else (shown,)
        return super()._metavar_formatter(action, default_metavar)


class CommandParser(argparse.ArgumentParser):
    """argparse, but its errors read `PROGRAM: error: ... (see --help)`, one line like every other
    error of the command (argparse's own prints the whole usage first), and exit with status 2;
    `quiet`: print nothing (under mpirun, every rank but rank 0, which all still exit with 2)."""

    def __init__(self, program: str, description: str, quiet: bool = False):
        super().__init__(prog=f"python -m {program}", description=description,
                         formatter_class=_DefaultsHelpFormatter)
        self.program, self.quiet = program, quiet

    def error(self, message: str) -> NoReturn:
        self.exit(2, None if self.quiet else f"{self.program}: error: {message} (see --help)\n")


def say(program: str, error: BaseException, rank: int | None = None) -> None:
    """A user error as its one line on stderr, `PROGRAM: error: ...`; `rank`: the rank that alone
    met it, in a job of several."""
    prefix = "" if rank is None else f"[rank {rank}] "
    print(f"{prefix}{program}: error: {error}", file=sys.stderr, flush=True)


def run_command(program: str, command: Callable[[], int]) -> int:
    """command()'s exit status, or 2 when it raises a user error, which is said in one line (any
    other error is a bug and keeps its traceback); 141 when the reader of its output left, 130
    on Ctrl-C, 143 on SIGTERM, each without a traceback."""
    try:
        return command()
    except USER_ERRORS as error:
        say(program, error)
        return 2
    except BrokenPipeError:
        return reader_left()
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM: files are written atomically
        word, code = stopped_by(stop)
        print(f"{program}: {word}", file=sys.stderr)
        return code


def reader_left() -> int:
    """The exit status of a command whose reader closed the pipe (`... | head`): 141, as a shell
    reports a program SIGPIPE ended, without an error at exit (stdout now goes nowhere)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 141
