"""The communicator over real MPI (the only module that calls mpi4py) and its watchdog.

Arrays travel as raw bytes with the uppercase buffer methods (Send, Recv, Sendrecv, Bcast): nothing
is pickled, and float16/bfloat16 need no MPI datatype (MPI libraries disagree on half precision).
All reductions of array data happen in minimp's own code; MPI's Allreduce is used only for a few
scalars (flags, lengths), where it is the simplest correct tool. CuPy arrays go to MPI as they
are when the MPI library is CUDA-aware, and through host memory otherwise.

The watchdog: end the whole job when one communication waits longer than a timeout (last in this
file). MPI has no timeouts: a receive from a rank that froze (SIGSTOP, a deadlocked peer, a hung
GPU) waits forever, and so does the job. PyTorch's process groups therefore abort a collective that
takes longer than their timeout; this is minimp's version. Each blocking call of an MPICommunicator
stamps "waiting since t, for this operation" before it enters MPI and clears the stamp after (two
attribute writes: small messages do not pay for the watch). One daemon thread looks at the stamps a
few times per timeout and, when one is older than the timeout, prints which rank waited for what and
aborts the job. The timeout must be longer than every legitimate wait (evaluation on rank 0,
gathering a checkpoint, a first GPU kernel compile).
"""

import ctypes
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NoReturn

import numpy as np
from numpy.typing import ArrayLike

from minimp import backend
from minimp.backend import Array
from minimp.distributed.headers import PlanCache
from minimp.distributed.protocol import Communicator, MessageSizeError, check_byte_count
from minimp.distributed.protocol import check_op, contiguous_for_wire

if TYPE_CHECKING:
    from mpi4py import MPI


def mpi_is_cuda_aware() -> bool:
    """True when the loaded MPI library accepts GPU memory
    (MPIX_GPU_query_support in MPICH >= 4, MPIX_Query_cuda_support in Open MPI);
    MINIMP_CUDA_AWARE_MPI=0/1 overrides. The PyPI mpich wheel answers no."""
    override = os.environ.get("MINIMP_CUDA_AWARE_MPI")
    if override in ("0", "1"):
        return override == "1"
    try:
        with open("/proc/self/maps") as maps:
            libraries = {line.split()[-1] for line in maps if "libmpi" in line.split()[-1]}
    except OSError:
        return False
    for path in sorted(libraries):
        library = ctypes.CDLL(path)
        if hasattr(library, "MPIX_GPU_query_support"):
            supported = ctypes.c_int(0)
            library.MPIX_GPU_query_support(0, ctypes.byref(supported))  # 0 = MPIX_GPU_SUPPORT_CUDA
            return bool(supported.value)
        if hasattr(library, "MPIX_Query_cuda_support"):
            return bool(library.MPIX_Query_cuda_support())
    return False


class MPICommunicator(Communicator):
    """A group of MPI processes; satisfies minimp.distributed.protocol.Communicator.

    mpi_comm: the mpi4py communicator it wraps (MPI.COMM_WORLD, or one split from it).
    """

    def __init__(self, mpi_comm: "MPI.Comm"):
        # Imported here, not at the top: importing mpi4py.MPI starts MPI, and `import minimp`
        # should not (the simulated world and one-process training never need it).
        from mpi4py import MPI

        self._MPI, self._comm = MPI, mpi_comm
        self.rank: int = mpi_comm.Get_rank()
        self.size: int = mpi_comm.Get_size()
        self.bytes_sent = 0  # counted for metrics: what this rank put on the wire
        self.messages_sent = 0
        self.scalar_allreduces = 0  # allreduce_scalars calls (their bytes are MPI's, not counted)
        self._cuda_aware: bool | None = None  # asked once, at the first GPU buffer
        self._status = MPI.Status()  # reused: one allocation less per message
        self._watchdog: Watchdog | None = None
        self.waiting: Waiting | None = None  # the blocking call in progress, for the watchdog
        # the checked all-reduce's buffers, kept from call to call (minimp/distributed/headers.py)
        self.allreduce_plans = PlanCache()

    def start_watchdog(self, timeout: float) -> None:
        """Abort the job when a call of this communicator, or of one split from it later, waits
        longer than `timeout` seconds (Watchdog, below)."""
        self._watchdog = Watchdog(timeout, self.rank, print_and_abort(self.abort))
        self._watchdog.watch(self)

    def _wait(self, operation: str, peer: int | None = None) -> None:
        if self._watchdog is not None:
            self.waiting = Waiting(operation, peer)

    def __repr__(self) -> str:
        return f"MPICommunicator(rank={self.rank}, size={self.size})"

    def _wire(self, array: Array) -> Array:
        """The buffer MPI reads or writes for `array`: the array itself (host memory, or GPU memory
        that a CUDA-aware MPI reads once the stream is synchronised), else a host copy of a device
        array, which `_copy_back` returns to the device once a message is received into it."""
        if type(array) is not np.ndarray and backend.is_device_array(array):
            backend.synchronize()
            if self.stages_device_arrays:
                return contiguous_for_wire(array.get())
        return contiguous_for_wire(array)

    @staticmethod
    def _copy_back(array: Array, buffer: Array) -> None:
        """After a receive into `_wire(array)`: a host copy's bytes go to the device array."""
        if buffer is not array:
            array[...] = backend.to_device(buffer)  # GPU memory of this rank's device

    @property
    def stages_device_arrays(self) -> bool:
        """True when device arrays reach MPI as host copies (this MPI is not CUDA-aware); asked
        once, and rank 0 says it once. The ring all-reduce then stages a whole collective at a
        time (minimp/distributed/staging.py)."""
        if self._cuda_aware is None:
            self._cuda_aware = mpi_is_cuda_aware()
            if not self._cuda_aware and self.rank == 0:
                print("minimp.distributed: this MPI is not CUDA-aware; GPU buffers are staged "
                      "through host memory", file=sys.stderr, flush=True)
        return not self._cuda_aware

    def _bytes(self, buffer: Array) -> list:
        return [buffer, self._MPI.BYTE]

    def _raise_if_truncated(self, error: "MPI.Exception", expected: int, source: int) -> None:
        """A message longer than its receive buffer (MPI_ERR_TRUNCATE: MPI delivers the bytes
        that fit and reports the error) raises the MessageSizeError a short message raises, so
        a collective can tell the ranks' disagreement from a failure of MPI."""
        if error.Get_error_class() == self._MPI.ERR_TRUNCATE:
            raise MessageSizeError(
                f"received more than {expected} bytes from rank {source} into a {expected}-byte "
                "buffer (MPI truncated it): the ranks disagree on the array's length or "
                "dtype", truncated=True) from None

    def send(self, array: Array, dest: int, tag: int = 0) -> None:
        buffer = self._wire(array)
        self._wait("send to", dest)
        self._comm.Send(self._bytes(buffer), dest=dest, tag=tag)
        self.waiting = None
        self._count(buffer)

    def recv(self, array: Array, source: int, tag: int = 0) -> None:
        """Receive into `array` (its size must equal the message's)."""
        buffer = self._wire(array)
        self._wait("receive from", source)
        try:
            self._comm.Recv(self._bytes(buffer), source=source, tag=tag, status=self._status)
        except self._MPI.Exception as error:
            self._raise_if_truncated(error, buffer.nbytes, source)
            raise
        finally:  # (a try costs nothing until something is raised)
            self.waiting = None
        self._copy_back(array, buffer)  # first: a short message's bytes are read too
        check_byte_count(self._status.Get_count(self._MPI.BYTE), buffer.nbytes, source)

    def isend(self, array: Array, dest: int, tag: int = 0) -> "MPIRequest":
        """MPI_Isend of the array's bytes (a host copy of a device array, kept by the request)."""
        buffer = self._wire(array)
        request = self._comm.Isend(self._bytes(buffer), dest=dest, tag=tag)
        self._count(buffer)
        return MPIRequest(self, request, buffer, f"finish a send to rank {dest}")

    def irecv(self, array: Array, source: int, tag: int = 0) -> "MPIRequest":
        """MPI_Irecv into the array (through a host buffer when MPI cannot write the device's)."""
        buffer = self._wire(array)
        request = self._comm.Irecv(self._bytes(buffer), source=source, tag=tag)
        return MPIRequest(self, request, buffer, f"receive from rank {source}", (array, source))

    def sendrecv(self, send_array: Array, dest: int, recv_array: Array, source: int, tag: int = 0,
                 recv_tag: int | None = None) -> None:
        """Send to dest and receive from source at once: no ordering of the two can deadlock.
        The receive matches `recv_tag` (default: the same tag as the send)."""
        send_buffer, recv_buffer = self._wire(send_array), self._wire(recv_array)
        if self._watchdog is not None:  # the description is built only for a watchdog to print
            self._wait(f"send to rank {dest} and receive from", source)
        try:
            self._comm.Sendrecv((send_buffer, self._MPI.BYTE), dest=dest, sendtag=tag,
                                recvbuf=(recv_buffer, self._MPI.BYTE), source=source,
                                recvtag=tag if recv_tag is None else recv_tag, status=self._status)
        except self._MPI.Exception as error:  # the send has completed: MPI waits for both
            self._raise_if_truncated(error, recv_buffer.nbytes, source)
            raise
        finally:
            self.waiting = None
        self._count(send_buffer)
        self._copy_back(recv_array, recv_buffer)
        check_byte_count(self._status.Get_count(self._MPI.BYTE), recv_buffer.nbytes, source)

    def bcast(self, array: Array, root: int = 0) -> None:
        """Overwrite `array` on every rank with root's (in place)."""
        buffer = self._wire(array)
        self._wait("broadcast from", root)
        self._comm.Bcast(self._bytes(buffer), root=root)
        self.waiting = None
        if self.rank == root:
            self._count(buffer)
        self._copy_back(array, buffer)

    def allreduce_scalars(self, values: ArrayLike, op: str = "max") -> np.ndarray:
        """Reduce a few float64 scalars (flags, lengths) over all ranks into a new float64 array."""
        check_op(op)
        mpi_op = {"max": self._MPI.MAX, "min": self._MPI.MIN, "sum": self._MPI.SUM}[op]
        contiguous = np.ascontiguousarray(values, dtype=np.float64)
        result = np.empty_like(contiguous)
        self.scalar_allreduces += 1
        self._wait(f"all-reduce ({op}) with all {self.size} ranks")
        self._comm.Allreduce(contiguous, result, op=mpi_op)
        self.waiting = None
        return result

    def barrier(self) -> None:
        self._wait(f"meet all {self.size} ranks at a barrier")
        self._comm.Barrier()
        self.waiting = None

    def node_rank_and_size(self) -> tuple[int, int]:
        """(this rank's number among the ranks on its machine, how many there are): the ranks of
        this communicator that share memory (MPI_COMM_TYPE_SHARED)."""
        local = self._comm.Split_type(self._MPI.COMM_TYPE_SHARED)
        try:
            return local.Get_rank(), local.Get_size()
        finally:
            local.Free()

    def split(self, color: int, key: int = 0) -> "MPICommunicator":
        """Sub-communicators: ranks with the same color form one, ordered by key (then old rank)."""
        self._wait("split the communicator with all ranks")
        child = MPICommunicator(self._comm.Split(color, key))
        self.waiting = None
        if self._watchdog is not None:
            child._watchdog = self._watchdog
            self._watchdog.watch(child)
        return child

    def abort(self, code: int = 1) -> NoReturn:
        """End every process of the job (MPI_Abort on COMM_WORLD)."""
        self._MPI.COMM_WORLD.Abort(code)

    def _count(self, buffer: Array) -> None:
        self.bytes_sent += buffer.nbytes
        self.messages_sent += 1


@dataclass(eq=False)
class MPIRequest:
    """An MPI request and the buffer it uses; wait() is watched by the communicator's watchdog like
    any blocking call. A receive's message must fill its buffer exactly, and a host copy of a
    device array goes back to the device."""

    comm: MPICommunicator
    request: "MPI.Request"
    buffer: Array | None  # held until complete, then None: the memory pool reuses what nobody holds
    what: str  # what the watchdog says this rank waits for
    receive: tuple[Array, int] | None = None  # a receive's array and the rank it comes from

    def wait(self) -> None:
        if self.buffer is None:
            return
        self.comm._wait(self.what)
        status = self.comm._MPI.Status()
        try:
            self.request.Wait(status)
        except self.comm._MPI.Exception as error:
            self._fail(error)
        finally:
            self.comm.waiting = None
        self._finish(self.buffer, status)

    def test(self) -> bool:
        if self.buffer is not None:
            status = self.comm._MPI.Status()
            try:
                complete = self.request.Test(status)
            except self.comm._MPI.Exception as error:
                self._fail(error)
            if complete:
                self._finish(self.buffer, status)
        return self.buffer is None

    def _fail(self, error: "MPI.Exception") -> NoReturn:
        """The request completed with an error: it is over (wait() again returns at once); a
        receive truncated raises MessageSizeError, any other error as MPI raised it."""
        buffer, receive = self.buffer, self.receive
        self.buffer, self.receive = None, None
        if receive is not None and buffer is not None:
            self.comm._raise_if_truncated(error, buffer.nbytes, receive[1])
        raise error

    def _finish(self, buffer: Array, status: "MPI.Status") -> None:
        self.buffer = None
        if self.receive is not None:
            array, source = self.receive
            self.receive = None
            self.comm._copy_back(array, buffer)
            check_byte_count(status.Get_count(self.comm._MPI.BYTE), buffer.nbytes, source)


def world() -> MPICommunicator:
    """The communicator over MPI.COMM_WORLD (size 1 under plain `python`)."""
    from mpi4py import MPI

    return MPICommunicator(MPI.COMM_WORLD)


class Waiting:
    """What a communicator is blocked in: since when (time.monotonic), which call, with whom."""

    __slots__ = ("since", "operation", "peer")

    def __init__(self, operation: str, peer: int | None):
        self.since, self.operation, self.peer = time.monotonic(), operation, peer

    def describe(self) -> str:
        return self.operation if self.peer is None else f"{self.operation} rank {self.peer}"


class Watchdog:
    """A daemon thread that calls `abort(message)` when a watched communicator's current wait is
    older than `timeout` seconds. Watch a communicator with `watch(comm)` (its `waiting`
    attribute is read, never written, by the thread)."""

    def __init__(self, timeout: float, rank: int, abort: Callable[[str], None]):
        if not timeout > 0:
            raise ValueError(f"a watchdog needs a positive timeout, got {timeout}")
        self.timeout, self.rank, self.abort = timeout, rank, abort
        self.watched: list = []
        self.fired = False
        self._thread = threading.Thread(target=self._run, name="minimp-watchdog", daemon=True)
        self._thread.start()

    def watch(self, comm: object) -> None:
        self.watched.append(comm)

    def _run(self) -> None:
        period = min(1.0, self.timeout / 10)
        while not self.fired:
            time.sleep(period)
            now = time.monotonic()
            for comm in tuple(self.watched):
                waiting = getattr(comm, "waiting", None)
                if waiting is not None and now - waiting.since > self.timeout:
                    self.fired = True
                    self.abort(f"[rank {self.rank}] minimp: waited {now - waiting.since:.0f} s to "
                               f"{waiting.describe()}; a rank is frozen, deadlocked or far slower "
                               f"than the others. Aborting the job (--timeout {self.timeout:g} s).")
                    return


def print_and_abort(abort: Callable[[int], None]) -> Callable[[str], None]:
    """The watchdog's action under MPI: the message straight to stderr, a moment for mpirun to
    forward it, then MPI_Abort of the whole job (from this thread: MPI runs THREAD_MULTIPLE)."""

    def act(message: str) -> None:
        os.write(sys.stderr.fileno(), (message + "\n").encode())
        time.sleep(0.5)
        abort(3)

    return act
