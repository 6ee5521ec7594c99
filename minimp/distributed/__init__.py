"""minimp.distributed: communicators (real MPI and a simulated world) and collectives from scratch.

The transport layer, as `torch.distributed` is PyTorch's: `from minimp import distributed as dist`.
It knows how to move and reduce bytes between ranks and nothing about models; the strategies
that use it (data and pipeline parallelism) live in minimp.parallel and import this package,
never the other way round.
"""

from minimp.distributed.alltoall import AllToAll, all_to_all, all_to_all_bytes, all_to_all_single
from minimp.distributed.alltoall import exchange_counts
from minimp.distributed.buffers import CollectiveMismatchError
from minimp.distributed.collectives import ALGORITHMS, AlgorithmPolicy, PersistentAllreduce
from minimp.distributed.collectives import allreduce, choose_algorithm, naive_allreduce
from minimp.distributed.collectives import recursive_doubling_allreduce
from minimp.distributed.gather import gather_named_arrays
from minimp.distributed.launch import run_or_abort
from minimp.distributed.mpi import MPICommunicator, world
from minimp.distributed.protocol import REDUCE_OPS, Communicator, Tag
from minimp.distributed.ring import all_gather, chunk_bounds, reduce_scatter, ring_allreduce
from minimp.distributed.simulated import DeadlockError, Message, SimulatedCommunicator
from minimp.distributed.simulated import SimulatedWorld, simulate
