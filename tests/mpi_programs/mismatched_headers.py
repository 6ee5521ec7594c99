"""Run under mpirun: checked recursive doubling on ranks that disagree, one way at a time.

The last rank passes a longer array (past MPICH's eager limit too: its messages are truncated on
one side and short on the other; and across headers.PACKED_BYTES, 8,192 float32s against 8,195:
one rank's payload follows its header in a second message, the other's does not), another dtype
(across it too, at 8,193 float32s) or another op; every rank must print the same line and go on
to the next case. Then the checked call is compared bit for bit with the old path (agree, then
the bare messages) on agreeing ranks."""

import numpy as np

from minimp import distributed as dist
from minimp.distributed.buffers import checked_allreduce
from minimp.distributed.collectives import recursive_doubling_into

CASES = [("length", 8), ("length", 100_000), ("length", 8192), ("dtype", 8), ("dtype", 8193),
         ("op", 8)]


def main():
    comm = dist.world()
    odd = comm.rank == comm.size - 1
    for by, length in CASES:
        x = np.ones(length + (3 if odd and by == "length" else 0),
                    np.float16 if odd and by == "dtype" else np.float32)
        try:
            dist.allreduce(comm, x, op="max" if odd and by == "op" else "sum")
        except dist.CollectiveMismatchError as error:
            print(f"{by} {length}: {error}", flush=True)
    for length in (1, 1000, 100_003):
        x = np.random.default_rng(comm.rank).normal(0, 1, length).astype(np.float32)
        old = checked_allreduce(recursive_doubling_into, "old", comm, x, "sum", None)
        new = dist.allreduce(comm, x, algorithm="recursive_doubling")
        assert new.tobytes() == old.tobytes(), f"rank {comm.rank}: {length} differs"
    print(f"rank {comm.rank}: the same bits", flush=True)


if __name__ == "__main__":
    dist.run_or_abort(main)
