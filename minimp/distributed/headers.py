"""The ranks' check carried inside the data: messages that begin with their sender's layout.

A checked all-reduce must fail on every rank, in one line, when the ranks pass different arrays;
never hang, never return a wrong sum. One way is to agree first (buffers.agree_on_layout: one
small all-reduce, at 4 KiB about as long as MPI's whole all-reduce). The other, here: the first
message of every step of the collective starts with a 48-byte header (length, dtype code, op
code, payload bytes, whether a second message follows, disagreed). Up to PACKED_BYTES the
payload follows in the same message, so the check costs no message of its own; a larger payload
follows as a second message, sent from where it is (copying it behind the header would cost
more than the message).

Each rank compares the header it receives with its own; a first message of another size is a
disagreement too (MessageSizeError: shorter than the buffer, or longer, which MPI truncates).
Whether a second message comes, the receiver reads in the header; a truncated first message was
a packed one, with none behind it (a header alone always fits). So every message sent is
received, whatever the ranks passed: no rank waits for a message that never comes, and no
message is left to be taken by a later call. A rank that has seen a disagreement goes on with
every message of the collective (their pattern depends on the number of ranks alone), its
additions skipped, with `disagreed` set in its headers, which carry the verdict on to the ranks
that did not see it themselves. Once every rank has heard from every other, directly or through
a partner (recursive doubling's rounds, a fold and its unfold), all of them know, and together
make one small all-reduce of their layouts that names the disagreement in the same line
everywhere (buffers.raise_disagreement).

The buffers (one to send from and one to receive into) are kept from call to call on the
communicator (`allreduce_plans`, a PlanCache), by (array type, length, dtype, op): a training
step all-reduces the same few layouts again and again.
"""

from collections import OrderedDict
from typing import Callable, Hashable, cast

import numpy as np
from numpy.typing import DTypeLike

from minimp.backend import Array, array_module
from minimp.distributed.buffers import dtype_code, op_code
from minimp.distributed.protocol import Communicator, MessageSizeError, Tag

# six int64: length, dtype code, op code, payload bytes, follows (1: the payload comes in a second
# message), disagreed (0 or 1)
HEADER_BYTES = 48
PAYLOAD_BYTES, FOLLOWS, DISAGREED = 3, 4, 5  # places in the header
# Payloads up to this many bytes travel in one message behind their header, larger ones in a
# second message. At p = 2 on this project's machine (load 2) one call took, one message / two:
# 4 KiB 4.7 / 7.6 us, 16 KiB 8.6 / 11.5, 32 KiB 10.3 / 12.8, 64 KiB 14.0 / 15.6, 256 KiB
# 37.3 / 35.4 (MPI's Allreduce 4.0, 10.6, 12.5, 16.2, 40.3). In the machine's slow stretches,
# when bytes one core has just written cost the other far more to read (docs/benchmarks.md,
# "All-reduce against MPI"), the copy behind the header costs more: at 64 KiB one message took
# 1.5x the time of a header and a payload sent apart. 32 KiB keeps lesson 8's array of 32 KiB
# in log2(p) messages.
PACKED_BYTES = 32 * 1024
# Buffers for payloads up to this many bytes are kept (a packed payload's twice, a larger one's
# once, to receive into): 16 plans hold 16 MiB at most. Larger arrays get a new buffer at every
# call, as they got a scratch buffer before.
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
    that had seen no disagreement. A payload arrives in `incoming`. Packed (a payload up to
    PACKED_BYTES), `outgoing` is the payload's place behind the header: a result computed there
    is sent without a copy. Else `outgoing` is None, and a payload is sent from where it is."""

    def __init__(self, like: Array, size: int, dtype: DTypeLike, op: str):
        dtype = np.dtype(dtype)
        xp = array_module(like)
        self.payload_bytes = size * dtype.itemsize
        self.packed = self.payload_bytes <= PACKED_BYTES
        header = np.array([size, dtype_code(dtype), op_code(op), self.payload_bytes,
                           not self.packed, 0], np.int64)
        self._expected = header.tobytes()  # what a partner in agreement sends
        first = HEADER_BYTES + (self.payload_bytes if self.packed else 0)  # the first message
        self._sent, self._received = xp.empty(first, np.uint8), xp.empty(first, np.uint8)
        # A received header starts as this rank's own: a communicator that delivers nothing
        # (calibration's silent one, which times the Python alone) sees agreement.
        for buffer in (self._sent, self._received):
            buffer[:HEADER_BYTES] = xp.asarray(header.view(np.uint8))
        self._sent_header = self._sent[:HEADER_BYTES].view(np.int64)
        self._received_header = self._received[:HEADER_BYTES].view(np.int64)
        self._payload = self._sent[HEADER_BYTES:].view(dtype)  # (empty unless packed)
        self.outgoing: Array | None = self._payload if self.packed else None
        self.incoming = (self._received[HEADER_BYTES:].view(dtype) if self.packed
                         else xp.empty(size, dtype))
        self._xp, self.agreed = xp, True

    def begin(self) -> None:
        """A new collective: no disagreement seen yet."""
        self.agreed = True

    def send(self, comm: Communicator, array: Array, dest: int, tag: int) -> None:
        """array, behind this rank's header, to dest."""
        self._sent_header[DISAGREED] = not self.agreed
        if self.packed:
            if array is not self._payload:
                self._payload[...] = array
            comm.send(self._sent, dest, tag=tag)
        else:
            comm.send(self._sent, dest, tag=tag)
            comm.send(array, dest, tag=Tag.DOUBLING_PAYLOADS)

    def receive(self, comm: Communicator, source: int, tag: int) -> None:
        """incoming from source; agreed stays True only if its header is this rank's."""
        try:
            comm.recv(self._received, source, tag=tag)
        except MessageSizeError as error:
            self.agreed = False
            if error.truncated:  # longer than this rank's first message: a packed one, alone
                return
        self._after_header(comm, source)

    def exchange(self, comm: Communicator, array: Array, partner: int, tag: int) -> None:
        """array to partner and incoming from partner at once (send and receive as above)."""
        self._sent_header[DISAGREED] = not self.agreed
        if not self.packed:  # the partner's first message decides whether a second comes
            header = comm.isend(self._sent, partner, tag=tag)
            payload = comm.isend(array, partner, tag=Tag.DOUBLING_PAYLOADS)
            self.receive(comm, partner, tag)
            header.wait()
            payload.wait()
            return
        if array is not self._payload:
            self._payload[...] = array
        try:
            comm.sendrecv(self._sent, partner, self._received, partner, tag=tag)
        except MessageSizeError as error:
            self.agreed = False
            if error.truncated:
                return
        self._after_header(comm, source=partner)

    def _after_header(self, comm: Communicator, source: int) -> None:
        """A first message has come whole (or short, its header at the start): compare its
        header, and receive the second message its sender sends when the header says so (into
        `incoming`, or, from a rank whose payload is of another size, into a buffer dropped)."""
        if self._received_header.tobytes() == self._expected:
            follows, theirs = not self.packed, self.payload_bytes
        else:
            self.agreed = False
            follows = bool(self._received_header[FOLLOWS])
            theirs = int(self._received_header[PAYLOAD_BYTES])
        if not follows:
            return
        same = not self.packed and theirs == self.payload_bytes
        target = self.incoming if same else self._xp.empty(theirs, np.uint8)
        try:
            comm.recv(target, source, tag=Tag.DOUBLING_PAYLOADS)
        except MessageSizeError:  # (the header said its size: a communicator that lost bytes)
            self.agreed = False


class BareBuffers:
    """HeadedBuffers' interface for messages without headers, between ranks that agreed on the
    array before (a PersistentAllreduce, a call that agreed first): `agreed` stays True, a payload
    arrives in `incoming` (made for one call), and is sent from where it is."""

    agreed, outgoing = True, None

    def __init__(self, like: Array):
        self.incoming = array_module(like).empty_like(like)

    def begin(self) -> None:
        """A new collective (nothing to reset)."""

    def send(self, comm: Communicator, array: Array, dest: int, tag: int) -> None:
        comm.send(array, dest, tag=tag)

    def receive(self, comm: Communicator, source: int, tag: int) -> None:
        comm.recv(self.incoming, source, tag=tag)

    def exchange(self, comm: Communicator, array: Array, partner: int, tag: int) -> None:
        comm.sendrecv(array, partner, self.incoming, partner, tag=tag)


def headed_buffers(comm: Communicator, x: Array, op: str) -> HeadedBuffers:
    """The HeadedBuffers for x's layout and op: kept on comm (its `allreduce_plans`) when it has
    a PlanCache and the payload is at most LARGEST_KEPT_PAYLOAD bytes, else new ones."""
    plans = getattr(comm, "allreduce_plans", None)
    if plans is None or x.nbytes > LARGEST_KEPT_PAYLOAD:
        return HeadedBuffers(x, x.size, x.dtype, op)
    key = (type(x), x.size, x.dtype, op)
    return cast(HeadedBuffers, plans.get(key, lambda: HeadedBuffers(x, x.size, x.dtype, op)))
