"""The ring's two halves with fp8 messages: each chunk sent as fp8 values behind a float32 scale.

The same messages as minimp/distributed/ring.py, each carried by minimp/precision/wire.py's codec:
a chunk of n elements travels as n + 4 bytes (its values, one byte each, and its scale).

  reduce-scatter  at step s rank r quantizes its float32 partial sum of chunk r - s - 1 (its own
                  share at step 0) with that chunk's own scale and sends it; it dequantizes the
                  incoming chunk r - s - 2 and adds its own share to it in float32. A chunk is
                  requantized at every hop: the sum rank r ends with has passed through p - 1
                  quantizations, each of a partial sum (ZeRO++, Wang et al. 2023, section 3.3:
                  the reason qgZ replaces the ring with an all-to-all, below). The owner's sum is
                  float32, never quantized.
  all-gather      the owner quantizes its final chunk once and the message goes around the ring
                  unchanged, byte for byte; every rank, the owner included, writes its decoded
                  values, so every replica ends with the same bits.
  one-shot        `quantized_reduce_scatter_once`: each rank quantizes each other rank's chunk
                  once and sends it straight to it (an all-to-all); the owner adds the p decoded
                  shares in rank order in float32. One quantization per share, the same bytes.

`Fp8RingInFlight` is the same reduce-scatter and all-gather as a state machine of non-blocking
messages (ring_nonblocking.py's RingAllreduce, for the buckets reduced during backward,
minimp/parallel/data/overlap.py): the same encodes, messages and float32 additions in the same
order, so the same bits and bytes as the blocking functions.

Bytes rank r sends per collective, with c_j the elements of chunk j: reduce-scatter
sum_{j != r} (c_j + 4); all-gather sum_{j != r + 1} (c_j + 4); the one-shot reduce-scatter
sum_{j != r} (c_j + 4) too. x and out are float32; only "sum" reduces.
"""

import numpy as np

from minimp.distributed.alltoall import all_to_all
from minimp.distributed.buffers import agree_on_layout
from minimp.distributed.protocol import Communicator, Tag
from minimp.distributed.ring import Bounds, chunk_bounds, ring_step
from minimp.distributed.ring_nonblocking import RingSteps
from minimp.precision.wire import Fp8Wire


def message_buffers(wire: Fp8Wire, bounds: Bounds) -> tuple[np.ndarray, np.ndarray]:
    """Two uint8 buffers, each as long as the largest chunk's message (send and receive)."""
    largest = wire.message_bytes(max((stop - start for start, stop in bounds), default=0))
    return np.empty(largest, np.uint8), np.empty(largest, np.uint8)


def fp8_reduce_scatter_into(comm: Communicator, x: np.ndarray, out: np.ndarray, bounds: Bounds,
                            wire: Fp8Wire) -> None:
    """Afterwards out[bounds[rank]] holds that chunk summed over all ranks (float32), each partial
    sum quantized on its way (the module's docstring). x (flat float32) is only read."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    outgoing, incoming = message_buffers(wire, bounds)
    for step in range(p - 1):
        (send_start, send_stop), (recv_start, recv_stop) = ring_step(comm, bounds, step + 1)
        send = outgoing[: wire.message_bytes(send_stop - send_start)]
        wire.encode((x if step == 0 else out)[send_start:send_stop], send)
        receive = incoming[: wire.message_bytes(recv_stop - recv_start)]
        comm.sendrecv(send, right, receive, left, tag=Tag.RING_REDUCE_SCATTER)
        # float32 on purpose: the dequantized partial sum plus this rank's share, rounded once
        out[recv_start:recv_stop] = wire.decode(receive) + x[recv_start:recv_stop]


def fp8_all_gather_inplace(comm: Communicator, flat: np.ndarray, bounds: Bounds,
                           wire: Fp8Wire) -> None:
    """Rank r starts with chunk r final (float32) in flat; afterwards flat holds every chunk as the
    decoded message of its owner, on every rank, its own chunk included."""
    p, r = comm.size, comm.rank
    right, left = (r + 1) % p, (r - 1) % p
    outgoing, incoming = message_buffers(wire, bounds)
    start, stop = bounds[r]
    message = outgoing[: wire.message_bytes(stop - start)]
    wire.encode(flat[start:stop], message)
    flat[start:stop] = wire.decode(message)  # the owner keeps what the others will hold
    for step in range(p - 1):
        _, (recv_start, recv_stop) = ring_step(comm, bounds, step)
        receive = incoming[: wire.message_bytes(recv_stop - recv_start)]
        comm.sendrecv(message, right, receive, left, tag=Tag.RING_ALL_GATHER)
        flat[recv_start:recv_stop] = wire.decode(receive)
        message, outgoing, incoming = receive, incoming, outgoing  # forwarded next step, as is


def fp8_ring_allreduce_into(comm: Communicator, flat_x: np.ndarray, flat_out: np.ndarray,
                            wire: Fp8Wire) -> None:
    """The sum of flat_x over all ranks into flat_out (p >= 2), the same bits on every rank."""
    bounds = chunk_bounds(flat_x.size, comm.size)
    fp8_reduce_scatter_into(comm, flat_x, flat_out, bounds, wire)
    fp8_all_gather_inplace(comm, flat_out, bounds, wire)


class Fp8RingAllreduce:
    """A bucket's all-reduce on the fp8 wire, called as PersistentAllreduce is: plan(x, out).
    Constructing it is a collective: the ranks agree on the length once (CollectiveMismatchError
    on all otherwise), as PersistentAllreduce's do."""

    def __init__(self, comm: Communicator, size: int, wire: Fp8Wire):
        self.comm, self.size, self.wire = comm, size, wire
        agree_on_layout(comm, size, np.dtype(np.float32), "Fp8RingAllreduce", "sum")

    def __call__(self, x: np.ndarray, out: np.ndarray) -> np.ndarray:
        if x.shape != (self.size,) or x.dtype != np.float32:
            raise ValueError(f"Fp8RingAllreduce: planned for float32 ({self.size},), called "
                             f"with {x.dtype} {x.shape}")
        if self.comm.size == 1:
            out[...] = x
        else:
            fp8_ring_allreduce_into(self.comm, x, out, self.wire)
        return out


def quantized_reduce_scatter_once(comm: Communicator, x: np.ndarray,
                                  wire: Fp8Wire) -> np.ndarray:
    """This rank's chunk (chunk_bounds(x.size, p)[rank]) of the sum of x over all ranks: every
    other rank's share of it quantized once and sent straight here (all-to-all), this rank's own
    share exact, added in rank order in float32."""
    bounds = chunk_bounds(x.size, comm.size)
    messages = []
    for start, stop in bounds:
        message = np.empty(wire.message_bytes(stop - start), np.uint8)
        wire.encode(x[start:stop], message)
        messages.append(message)
    start, stop = bounds[comm.rank]
    expected = [wire.message_bytes(stop - start)] * comm.size
    received = all_to_all(comm, messages, expected)
    total = np.zeros(stop - start, np.float32)
    for source, message in enumerate(received):
        total += x[start:stop] if source == comm.rank else wire.decode(message)
    return total


class Fp8RingInFlight(RingSteps):
    """One fp8 ring all-reduce (or, with all_gather=False, its reduce-scatter half) of the flat
    float32 x into out, posted step by step as RingAllreduce (ring_nonblocking.py) posts its own:
    in flight from construction until `progress()` returns True or `wait()` returns, x and out
    untouched meanwhile. Each step encodes the outgoing chunk into a uint8 message, receives the
    incoming one into another, and on completion decodes it: fp8_reduce_scatter_into's and
    fp8_all_gather_inplace's steps, in their order."""

    def __init__(self, comm: Communicator, x: np.ndarray, out: np.ndarray, wire: Fp8Wire,
                 tags: tuple[int, int] = (Tag.RING_REDUCE_SCATTER, Tag.RING_ALL_GATHER), *,
                 bounds: Bounds | None = None, all_gather: bool = True):
        if out.shape != x.shape or x.dtype != np.float32 or out.dtype != np.float32:
            raise ValueError(f"Fp8RingInFlight: x and out must be float32 arrays of one size, "
                             f"got {x.dtype} {x.shape} and {out.dtype} {out.shape}")
        self.wire = wire
        self._begin(comm, x, out, tags, bounds, all_gather)
        self.outgoing, self.incoming = message_buffers(wire, self.bounds)
        self.message = self.outgoing[:0]  # the all-gather's message to forward
        self._start()

    def buffers(self) -> list[np.ndarray]:
        """What it holds while in flight: x, out and its two message buffers."""
        return [self.x, self.out, self.outgoing, self.incoming]

    def _scattering(self) -> bool:
        return self.step < self.comm.size - 1

    def _incoming(self) -> tuple[int, int]:
        """The bounds of the chunk the current step receives (ring.py's ring_step)."""
        p = self.comm.size
        behind = self.step + 1 if self._scattering() else self.step - (p - 1)
        return ring_step(self.comm, self.bounds, behind)[1]

    def _post(self) -> None:
        p, r, wire = self.comm.size, self.comm.rank, self.wire
        if self._scattering():  # encode this step's partial sum (our own share at step 0)
            (start, stop), _ = ring_step(self.comm, self.bounds, self.step + 1)
            self.message = self.outgoing[: wire.message_bytes(stop - start)]
            wire.encode((self.x if self.step == 0 else self.out)[start:stop], self.message)
            tag = self.tags[0]
        else:
            if self.step == p - 1:  # the owner quantizes its sum once and keeps the decoded copy
                start, stop = self.bounds[r]
                self.message = self.outgoing[: wire.message_bytes(stop - start)]
                wire.encode(self.out[start:stop], self.message)
                self.out[start:stop] = wire.decode(self.message)
            tag = self.tags[1]
        start, stop = self._incoming()
        receive = self.incoming[: wire.message_bytes(stop - start)]
        left, right = (r - 1) % p, (r + 1) % p
        self.requests = [self.comm.irecv(receive, left, tag=tag),
                         self.comm.isend(self.message, right, tag=tag)]

    def _finish_step(self) -> None:
        """Both messages of the step are complete: decode (and add, in the reduce-scatter), then
        post the next step."""
        start, stop = self._incoming()
        receive = self.incoming[: self.wire.message_bytes(stop - start)]
        if self._scattering():
            # float32 on purpose: the dequantized partial sum plus this rank's share, rounded once
            self.out[start:stop] = self.wire.decode(receive) + self.x[start:stop]
        else:
            self.out[start:stop] = self.wire.decode(receive)
            # the received message is forwarded next step, as is: swap the buffers' roles
            self.message, self.outgoing, self.incoming = receive, self.incoming, self.outgoing
        self.step += 1
        self.requests = []
        if not self.done:
            self._post()
