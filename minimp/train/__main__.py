"""`python -m minimp.train` (or `mpirun -n 4 python -m minimp.train`): parse, check, train.

Rank 0 prints what runs (the flags that differ from the dataset's defaults), a progress line every
--log-every steps, a line for each skipped step as it happens, and a summary at the end.

Everything that can be checked is checked before the first step: every flag, the output paths
(rank 0 writes the files), the memory the model needs, the device, matplotlib for --plot. Bad input
is one line, `minimp.train: error: ...`, printed by one rank, and every rank exits with status 2.
Errors that all ranks meet together later (a setup step that failed on some rank, a run that
diverged) end the job the same way, without MPI_Abort. An error on one rank alone (an injected
fault, a bug) is printed by that rank, which then aborts the whole job; so does the watchdog when a
message waits longer than --timeout.
"""

import os
import sys
import time

from minimp import backend
from minimp.checkpoints import checkpoint
from minimp.checkpoints.errors import (USER_ERRORS, AgreedError, ConfigError, agree_on_error,
                                       reader_left, say, stopped_by)
from minimp.checkpoints.files import check_output, exit_cleanly_on_sigterm, read_meta, same_file
from minimp.distributed import MPICommunicator, run_or_abort, world
from minimp.distributed.launch import flush_and_pause
from minimp.distributed.protocol import Communicator
from minimp.train.cli import parse_config
from minimp.train.config import TrainConfig
from minimp.train import threads
from minimp.train.loop import rank_threads, train
from minimp.train.plot import plot_formats
from minimp.train.sizes import check_memory
from minimp.train.tasks import resume_flags

PROGRAM = "minimp.train"


def check_before_training(config: TrainConfig, comm: Communicator) -> None:
    """Raise the first user error this rank can find before any work is done."""
    config.validate(comm.size)
    check_memory(config, comm.ranks_on_this_node(), backend.available_memory(),
                 world_size=comm.size)
    if config.device:
        backend.check_device(config.device)  # CuPy and a GPU are there
    if comm.rank == 0:  # the files are rank 0's to write
        check_outputs(config)


# The kind of file each output writes (what it may replace: files.REPLACEABLE).
OUTPUT_KINDS = {"save": "checkpoint", "metrics": "metrics", "timeline": "timeline", "plot": "plot"}


def check_outputs(config: TrainConfig) -> None:
    """Every output can be written and replaces nothing but an output of its own kind (that
    no two name one file is config.validate's check), and --save no checkpoint of another run:
    only --resume's, or one trained with the flags a resume of it would need."""
    for name, kind in OUTPUT_KINDS.items():
        path = getattr(config, name)
        if path:
            suffixes = plot_formats() if name == "plot" else ()
            check_output(f"--{name}", path, kind, force=config.force, suffixes=suffixes)
    meta = read_meta(config.save) if config.save and os.path.isfile(config.save) else None
    if meta is None or config.force or (config.resume and same_file(config.save, config.resume)):
        return
    saved = meta.get("flags") if isinstance(meta.get("flags"), dict) else {}
    differing = checkpoint.differing_flag(saved, resume_flags(config))
    if differing is not None:
        raise ConfigError(f"--save {config.save} holds the checkpoint of another run (trained with "
                          f"{differing[1]}); choose another path, or pass --force to replace it")


class Printer:
    """The run's lines to stdout. A stdout that cannot be written (`> log` on a full disk) costs
    the lines, not the run: the first failure is kept in `error`, later lines are dropped, and
    the run ends with exit 1 naming it (a reader that left the pipe ends the run: `| head`)."""

    def __init__(self) -> None:
        self.error = ""

    def __call__(self, line: str) -> None:
        if self.error:
            return
        try:
            print(line, flush=True)
        except BrokenPipeError:
            raise
        except OSError as error:
            self.error = error.strerror or str(error)


def _run(config: TrainConfig, comm: MPICommunicator) -> int:
    try:
        agree_on_error(comm, lambda: check_before_training(config, comm))
        if config.timeout and comm.size > 1:
            comm.start_watchdog(config.timeout)
        printer = Printer()
        chosen = rank_threads(config, comm)  # on every rank: counting a node's ranks is collective
        if comm.rank == 0:
            printer(f"{PROGRAM}: {config.describe(comm.size)}")
            printer(f"  {threads.describe(chosen)}")
        interactive = sys.stdout.isatty()  # a terminal: one progress bar instead of lines
        result = train(config, log=printer, comm=comm, interactive=interactive, threads=chosen)
        failures = [f"{flag} {getattr(config, flag[2:])} ({why})"
                    for flag, why in result["failed_outputs"].items()]
        failures += [f"the lines on stdout ({printer.error})"] if printer.error else []
        if failures:  # rank 0's: the run is complete, a report of it is not
            saved = f"; the checkpoint {config.save} was saved" if config.save else ""
            failed = ", ".join(failures)
            print(f"{PROGRAM}: error: could not write {failed}{saved}", file=sys.stderr)
            return 1
    except AgreedError as error:  # every rank is here: one says it, all exit, nobody waits
        if error.speaker:
            say(PROGRAM, error)
        return error.exit_code
    except USER_ERRORS as error:  # this rank alone: the others may be waiting for it
        say(PROGRAM, error, comm.rank if comm.size > 1 else None)
        if comm.size > 1:
            time.sleep(0.5)  # let mpirun forward the line before the job is torn down
            comm.abort(2)
        return 2
    return 0


def main(argv: list[str] | None = None) -> int:
    comm = world()
    exit_cleanly_on_sigterm()
    try:
        # argparse's errors: rank 0 prints them, every rank exits with status 2
        config = parse_config(argv, quiet=comm.rank != 0)
        return run_or_abort(_run, config, comm, comm=comm)
    except BrokenPipeError:  # `python -m minimp.train | head`: the reader left, the run ends
        return reader_left()
    except KeyboardInterrupt as stop:  # Ctrl-C, SIGTERM: a file being written was cleaned up
        return _stopped(comm, stop)


def _stopped(comm: MPICommunicator, stop: KeyboardInterrupt) -> int:
    """Ctrl-C (exit status 130) or SIGTERM (143): one line for the job. mpirun passes the signal
    to every rank: rank 0 says it and leaves at once; any other rank waits a moment first, so it
    speaks only where it was stopped alone (rank 0 leaving ends the job, this rank with it)."""
    word, code = stopped_by(stop)
    if comm.rank != 0:
        time.sleep(0.5)
    print(f"{PROGRAM}: {word}; files already saved are intact", file=sys.stderr)
    if comm.size > 1:
        # A rank may be deep in an MPI wait its peers will never answer, where no Python signal
        # handler runs: leaving without MPI_Finalize makes mpirun end them all at once (and
        # MPI_Abort would print a line per rank).
        flush_and_pause(0.0)
        os._exit(code)
    return code

if __name__ == "__main__":
    sys.exit(main())
