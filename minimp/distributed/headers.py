"""The ranks' check carried inside the data: messages that begin with their sender's layout.

A checked all-reduce must fail on every rank, in one line, when the ranks pass different arrays;
never hang, never return a wrong sum. One way is to agree first (buffers.agree_on_layout: one
small all-reduce, at 4 KiB about as long as MPI's whole all-reduce). The other, here: every
message of the collective starts with a 32-byte header, (length, dtype code, op code,
disagreed). Up to PACKED_BYTES the payload follows in the same message, so the check costs no
message of its own; a larger payload is sent from where it is, and its header as a message of
its own posted with it (copying the payload behind the header would cost more). Each rank
compares the header it receives with its own layout; a payload of another size is a
disagreement too (MessageSizeError: too short, or longer than the buffer, which MPI truncates).
A rank that has seen a disagreement goes on sending and receiving every message of the
collective (the algorithm's messages depend on the number of ranks only, never on the length,
so no rank waits for a message that never comes) with `disagreed` set in its headers, and the
headers carry the verdict on to the ranks that did not see it themselves. Once every rank has
heard from every other, directly or through a partner (recursive doubling's rounds, a fold and
its unfold), all of them know, and together make one small all-reduce of their layouts that
names the disagreement in the same line everywhere (buffers.raise_disagreement).

The buffers (header and payload, one to send and one to receive into) are kept from call to call
on the communicator (`allreduce_plans`, a PlanCache), by (array type, length, dtype, op): a
training step all-reduces the same few layouts again and again.
"""

from collections import OrderedDict
from typing import Callable, Hashable, cast

import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array, array_module
from minimp.distributed.buffers import dtype_code, op_code
from minimp.distributed.protocol import Communicator, MessageSizeError, Request, Tag

HEADER_BYTES = 32  # four int64: length, dtype code, op code, disagreed (0 or 1)
# Payloads up to this many bytes travel in one message behind their header, larger ones apart
# from it (HeadedBuffers). At p = 2 on this project's machine one call took, packed / apart:
# 4 KiB 5.6 / 8.4 us, 16 KiB 10.8 / 12.5, 32 KiB 16.8 / 13.7, 64 KiB 24.5 / 16.6 (MPI's
# Allreduce 6.1, 14.2, 17.1, 22.4). The limit stays at 32 KiB, not 16, so that a 32 KiB array
# (lesson 8's) still goes in log2(p) messages.
PACKED_BYTES = 32 * 1024
# Buffers for payloads up to this many bytes are kept (two per plan): 16 plans hold 32 MiB at
# most. Larger arrays get new buffers at every call, as they got a scratch buffer before.
LARGEST_KEPT_PAYLOAD = 1 << 20


class PlanCache:
    """A communicator's plans, least recently used first out: at most `max_plans` of them.
    `built` counts the plans made (a plan found again is not made again)."""

    def __init__(self, max_plans: int = 16):
        self.max_plans, self.built = max_plans, 0
        self._plans: OrderedDict[Hashable, object] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plans)

    def get(self, key: Hashable, build: Callable[[], object]) -> object:
        """The plan kept under key, or build()'s, kept from now on."""
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build()
            self.built += 1
            if len(self._plans) > self.max_plans:
                self._plans.popitem(last=False)
        else:
            self._plans.move_to_end(key)
        return plan


class HeadedBuffers:
    """One rank's memory for the headed messages of arrays of one (length, dtype, op), and
    `agreed`: whether every message received since `begin()` came from a rank with this layout
    that had seen no disagreement. A payload arrives in `incoming`. Up to PACKED_BYTES the header
    and the payload travel as one message, and `outgoing` is the payload's place behind the
    header (a result computed there is sent without a copy); above, the header travels as a
    message of its own, posted with the payload, which is sent from where it is (`outgoing` is
    None): copying a large array behind a header costs more than a second message."""

    def __init__(self, like: Array, size: int, dtype: DTypeLike, op: str):
        dtype = np.dtype(dtype)
        xp = array_module(like)
        header = np.array([size, dtype_code(dtype), op_code(op), 0], np.int64)
        self._expected = header.tobytes()  # what a partner in agreement sends
        self.packed = size * dtype.itemsize <= PACKED_BYTES
        # A received header starts as this rank's own: a communicator that delivers nothing
        # (calibration's silent one, which times the Python alone) sees agreement.
        if self.packed:
            self._sent = xp.empty(HEADER_BYTES + size * dtype.itemsize, np.uint8)
            self._received = xp.empty_like(self._sent)
            for buffer in (self._sent, self._received):
                buffer[:HEADER_BYTES] = xp.asarray(header.view(np.uint8))
            self._sent_header = self._sent[:HEADER_BYTES].view(np.int64)
            self._received_header = self._received[:HEADER_BYTES].view(np.int64)
            self._payload = self._sent[HEADER_BYTES:].view(dtype)
            self.outgoing: Array | None = self._payload
            self.incoming = self._received[HEADER_BYTES:].view(dtype)
        else:
            self._sent_header, self._received_header = xp.array(header), xp.array(header)
            self.outgoing, self.incoming = None, xp.empty(size, dtype)
        self.agreed = True

    def begin(self) -> None:
        """A new collective: no disagreement seen yet."""
        self.agreed = True

    def send(self, comm: Communicator, array: Array, dest: int, tag: int) -> None:
        """array, behind this rank's header, to dest."""
        self._sent_header[3] = not self.agreed
        if not self.packed:
            header = comm.isend(self._sent_header, dest, tag=Tag.DOUBLING_HEADERS)
            comm.send(array, dest, tag=tag)
            header.wait()
            return
        if array is not self._payload:
            self._payload[...] = array
        comm.send(self._sent, dest, tag=tag)

    def receive(self, comm: Communicator, source: int, tag: int) -> None:
        """incoming from source; agreed stays True only if its header is this rank's."""
        header = None if self.packed else self._receive_header(comm, source)
        try:
            comm.recv(self._received if self.packed else self.incoming, source, tag=tag)
        except MessageSizeError:  # another length or dtype size: MPI has completed the message
            self.agreed = False
        self._check(header)

    def exchange(self, comm: Communicator, array: Array, partner: int, tag: int) -> None:
        """array to partner and incoming from partner at once (send and receive as above)."""
        self._sent_header[3] = not self.agreed
        header, sent = None, None
        if self.packed:
            if array is not self._payload:
                self._payload[...] = array
            outgoing, incoming = self._sent, self._received
        else:
            header = self._receive_header(comm, partner)
            sent = comm.isend(self._sent_header, partner, tag=Tag.DOUBLING_HEADERS)
            outgoing, incoming = array, self.incoming
        try:
            comm.sendrecv(outgoing, partner, incoming, partner, tag=tag)
        except MessageSizeError:
            self.agreed = False
        if sent is not None:
            sent.wait()
        self._check(header)

    def _receive_header(self, comm: Communicator, source: int) -> Request:
        return comm.irecv(self._received_header, source, tag=Tag.DOUBLING_HEADERS)

    def _check(self, header: Request | None) -> None:
        """Wait for a header of its own (if any); agreed stays True if the header is ours."""
        if header is not None:
            header.wait()
        if self.agreed and self._received_header.tobytes() != self._expected:
            self.agreed = False


def headed_buffers(comm: Communicator, x: Array, op: str) -> HeadedBuffers:
    """The HeadedBuffers for x's layout and op: kept on comm (its `allreduce_plans`) when it has
    a PlanCache and the payload is at most LARGEST_KEPT_PAYLOAD bytes, else new ones."""
    plans = getattr(comm, "allreduce_plans", None)
    if plans is None or x.nbytes > LARGEST_KEPT_PAYLOAD:
        return HeadedBuffers(x, x.size, x.dtype, op)
    key = (type(x), x.size, x.dtype, op)
    return cast(HeadedBuffers, plans.get(key, lambda: HeadedBuffers(x, x.size, x.dtype, op)))
