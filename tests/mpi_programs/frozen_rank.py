"""Run under mpirun: rank 1 stops answering (it sleeps, as a SIGSTOPped or deadlocked rank would);
the watchdog of the others must end the job, naming what they waited for."""

import sys
import time

import numpy as np

from minimp import distributed as dist


def main():
    comm = dist.world()
    comm.start_watchdog(float(sys.argv[1]))
    if comm.rank == 1:
        time.sleep(120)  # frozen: never sends
    buffer = np.empty(4, np.float32)
    comm.recv(buffer, 1)  # rank 0 waits here


if __name__ == "__main__":
    dist.run_or_abort(main)
