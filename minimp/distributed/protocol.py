"""The communicator contract: what every communicator offers, its reduce operations, its tags.

Two classes satisfy `Communicator`: `MPICommunicator` (real processes under `mpirun`) and
`SimulatedCommunicator` (threads of one process). Collectives and strategies are written against
this Protocol only, so the same code runs in a notebook, in a test and on a cluster.
"""

from enum import IntEnum
from typing import NoReturn, Protocol, runtime_checkable

import numpy as np
from numpy.typing import ArrayLike

from minimp.backend import Array

# The reductions minimp's collectives and the scalar all-reduce know, by name. Array reductions
# happen in minimp's own code (float32 for 16-bit inputs); MPI only ever reduces float64 scalars.
REDUCE_OPS: dict[str, np.ufunc] = {"sum": np.add, "max": np.maximum, "min": np.minimum}


class Tag(IntEnum):
    """Message tags, one per purpose. MPI delivers messages of one (source, tag, communicator) in
    the order they were sent, so a tag only has to tell apart messages that can be in flight at
    the same time; a named tag also says in a message trace what each message was for."""

    BROADCAST = 1  # the simulated world's linear broadcast
    RING_REDUCE_SCATTER = 2
    RING_ALL_GATHER = 3
    NAIVE_TO_ROOT = 4
    DOUBLING_FOLD = 5  # recursive doubling, p not a power of two: extra ranks hand in their data
    DOUBLING_EXCHANGE = 6
    DOUBLING_UNFOLD = 7  # ... and get the result back
    GATHER_ARRAYS = 8  # named arrays collected onto one rank (checkpoints, timelines)
    PIPELINE_FORWARD = 9  # activations, stage s -> s + 1
    PIPELINE_BACKWARD = 10  # their gradients, stage s + 1 -> s
    DOUBLING_PAYLOADS = 11  # recursive doubling's payloads that follow their header (headers.py)
    ALL_TO_ALL_COUNTS = 12  # an all-to-all's per-rank counts, sent before its payloads
    ALL_TO_ALL = 13  # ... and its payloads (context parallelism's Ulysses, expert dispatch)
    CONTEXT_KEYS_VALUES = 14  # ring attention: key/value blocks, rank r -> r + 1 of the cp ring
    CONTEXT_GRADIENTS = 15  # ... and, in backward, their gradients travelling with them
    # Gradient buckets whose rings are in flight at once (minimp/parallel/data/overlap.py): bucket
    # b's reduce-scatter uses GRADIENT_BUCKETS + 2b, its all-gather GRADIENT_BUCKETS + 2b + 1.
    GRADIENT_BUCKETS = 1000


def check_op(op: str) -> None:
    """Raise ValueError unless op names one of REDUCE_OPS."""
    if op not in REDUCE_OPS:
        raise ValueError(f"op must be one of {sorted(REDUCE_OPS)}, got {op!r}")


def contiguous_for_wire(array: Array) -> Array:
    """The array itself, if C-contiguous. Both communicators send through this, so both refuse
    the same arrays: a non-contiguous one would need a hidden copy."""
    if not array.flags.c_contiguous:
        raise ValueError("communication needs a C-contiguous array (use numpy.ascontiguousarray); "
                         f"got one of shape {array.shape} with strides {array.strides}")
    return array


def byte_view(array: Array) -> Array:
    """The array's memory as a flat uint8 array (no copy), if C-contiguous. MPI is handed the
    array itself (with MPI.BYTE it reads the bytes of any dtype, bfloat16 too); the simulated world
    copies these bytes."""
    return contiguous_for_wire(array).reshape(-1).view(np.uint8)


class MessageSizeError(ValueError):
    """A message did not fill its receive buffer exactly: the ranks disagree on the array.
    `truncated`: it was longer than the buffer (MPI wrote what fit, which MPI does not promise);
    else it was shorter, and its bytes are at the buffer's start, as MPI puts them."""

    def __init__(self, message: str, truncated: bool):
        super().__init__(message)
        self.truncated = truncated


def check_byte_count(received: int, expected: int, source: int) -> None:
    """A message must fill its receive buffer exactly: anything else means the ranks disagree."""
    if received != expected:
        raise MessageSizeError(f"received {received} bytes from rank {source} into a "
                               f"{expected}-byte buffer: the ranks disagree on the array's length "
                               "or dtype", truncated=received > expected)


class Request(Protocol):
    """A non-blocking send or receive in flight (an MPI_Request). Its array must not be touched
    until wait() has returned (a send's may be read by MPI, a receive's is written)."""

    def wait(self) -> None:
        """Return once the operation is complete (a receive's array holds the message)."""

    def test(self) -> bool:
        """Whether it is complete, without waiting (completing it if so)."""


@runtime_checkable
class Communicator(Protocol):
    """A group of ranks that exchange raw bytes. Ranks are numbered 0..size-1 within the group.

    Arrays travel as their bytes (`byte_view`): they must be C-contiguous, and a receive
    buffer must have exactly the size of the message. Large sends may wait for their
    receiver (MPI's rendezvous protocol), so a pair of ranks that exchange data uses
    `sendrecv`, never send-then-receive on both sides. recv, sendrecv and ranks_on_this_node have
    default bodies written with the other methods; a communicator may override them (MPI's does).
    """

    rank: int
    size: int
    bytes_sent: int  # what this rank put on the wire through this communicator
    messages_sent: int
    scalar_allreduces: int  # allreduce_scalars calls (flags, norms, losses: counted apart)

    def send(self, array: Array, dest: int, tag: int = 0) -> None:
        """Send the array's bytes to rank dest."""

    def recv(self, array: Array, source: int, tag: int = 0) -> None:
        """Receive a message from rank source into array (in place). By default an irecv waited
        for at once (MPI_Recv's meaning)."""
        self.irecv(array, source, tag).wait()

    def isend(self, array: Array, dest: int, tag: int = 0) -> Request:
        """Start sending the array's bytes to rank dest and return at once (MPI_Isend)."""

    def irecv(self, array: Array, source: int, tag: int = 0) -> Request:
        """Start receiving a message from rank source into array and return at once (MPI_Irecv)."""

    def sendrecv(self, send_array: Array, dest: int, recv_array: Array, source: int, tag: int = 0,
                 recv_tag: int | None = None) -> None:
        """Send to dest and receive from source at once (recv_tag defaults to tag). By default an
        irecv and an isend started together, then both waited for (MPI_Sendrecv's meaning), so no
        order of the two can deadlock."""
        receive = self.irecv(recv_array, source, tag if recv_tag is None else recv_tag)
        send = self.isend(send_array, dest, tag)
        receive.wait()
        send.wait()

    def bcast(self, array: Array, root: int = 0) -> None:
        """Overwrite array on every rank with root's."""

    def allreduce_scalars(self, values: ArrayLike, op: str = "max") -> np.ndarray:
        """Reduce a few float64 scalars (flags, lengths) with one of REDUCE_OPS; a new array."""

    def barrier(self) -> None:
        """Return once every rank of the group has called it."""

    def split(self, color: int, key: int = 0) -> "Communicator":
        """Sub-groups as MPI_Comm_split: one per color, ranked by (key, old rank)."""

    def ranks_on_this_node(self) -> int:
        """How many ranks of the group share this machine's cores (node_rank_and_size's count)."""
        return self.node_rank_and_size()[1]

    def node_rank_and_size(self) -> tuple[int, int]:
        """(this rank's number among the ranks on its machine, how many there are)."""

    def abort(self, code: int = 1) -> NoReturn:
        """End the whole job (every rank) with this exit status."""
