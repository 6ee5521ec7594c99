"""The abort rule: under MPI, an exception on one rank ends the whole job.

Plain mpi4py leaves the other ranks waiting forever in a receive that will never come.
"""

import sys
import time
import traceback
from typing import Callable, TypeVar

from minimp.distributed.protocol import Communicator

T = TypeVar("T")


def run_or_abort(main: Callable[..., T], *args: object, comm: Communicator | None = None) -> T:
    """Call main(*args). If it raises (or exits non-zero) on a job of several ranks,
    print this rank's error with its rank number, then MPI_Abort the whole job;
    on one rank, behave like a plain call. KeyboardInterrupt passes through untouched: Ctrl-C
    interrupts every rank at once, and the caller ends the job with one line (`interrupted`)."""
    if comm is None:
        from minimp.distributed.mpi import world

        comm = world()
    try:
        return main(*args)
    except SystemExit as exit_request:
        if comm.size > 1 and exit_request.code not in (None, 0):
            flush_and_pause()
            comm.abort(exit_request.code if isinstance(exit_request.code, int) else 1)
        raise
    except KeyboardInterrupt:  # Ctrl-C reaches every rank: the caller says it once, not each
        raise
    except BaseException as error:
        if comm.size == 1:
            raise
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        sys.stderr.write("".join(f"[rank {comm.rank}] {line}"
                                 for line in "".join(lines).splitlines(True)))
        sys.stderr.write(f"[rank {comm.rank}] aborting all {comm.size} ranks: "
                         f"{type(error).__name__}: {error}\n")
        flush_and_pause()
        comm.abort(1)


def flush_and_pause(seconds: float = 0.5) -> None:
    """Flush this rank's output and give mpirun a moment to forward it: MPI_Abort tears the job
    down at once, and a line still in a pipe would be lost (seen in 1 of 51 injected faults)."""
    sys.stdout.flush()
    sys.stderr.flush()
    time.sleep(seconds)
