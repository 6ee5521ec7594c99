"""The fp8 wire codec: a float32 chunk as one message of fp8 values behind its float32 scale.

A message is bytes: the chunk's scale_inv (float32, SCALE_BYTES = 4 bytes), then one byte per
element, the chunk divided by that scale and cast to the element format. The scale is current
scaling over the whole chunk (minimp/precision/blocks.py's "current" rule with one group): the
chunk's amax lands on the format's max, so no value saturates and the precision left is the
format's mantissa. Decoding is blocks.dequantize: value * scale_inv, rounded once in float32.

Why E4M3 for gradients. E5M2 is the classic gradient format (Transformer Engine's HYBRID recipe)
because one per-tensor scale, delayed, must cover a gradient's whole range from an old amax. Here
the scale is the chunk's own amax, taken just before the send (current scaling), so the range
E5M2 buys is not needed: E4M3 keeps 17.8 binades below the amax (448 down to its smallest
subnormal, 2^-9), enough for a gradient chunk, and one more mantissa bit halves the rounding
error, which the ring pays at every hop. DeepSeek-V3 uses E4M3 everywhere for the same reason
(fine-grained current scaling). benchmarks/wire_bench.py prints both formats' errors.

A chunk with a NaN or an infinity encodes as NaN (its scale NaN, blocks.py's edge rule), so a
non-finite gradient is not lost on the wire; an empty chunk still carries its scale (1), so every
message is elements + 4 bytes and the formulas need no special case.
"""

from dataclasses import dataclass

import numpy as np

from minimp.precision.blocks import E4M3, E5M2, BlockQuantized, ElementFormat, dequantize
from minimp.precision.blocks import quantize
from minimp.precision.casting import ACTIVATION_DTYPES

FLOAT32 = np.dtype(np.float32)
SCALE_BYTES = FLOAT32.itemsize  # each message's float32 scale_inv, in front of its values
WIRE_FORMATS = {"fp8": E4M3, "fp8_e5m2": E5M2}  # the values' format of each wire name


@dataclass(frozen=True)
class Fp8Wire:
    """How a float32 chunk travels: fmt values (one byte each) behind a float32 scale_inv."""

    fmt: ElementFormat = E4M3

    def message_bytes(self, elements: int) -> int:
        """Bytes of the message of a chunk of `elements`: its values and its scale."""
        return elements * self.fmt.dtype.itemsize + SCALE_BYTES

    def encode(self, chunk: np.ndarray, message: np.ndarray) -> None:
        """Write the flat float32 chunk into `message` (uint8, message_bytes(chunk.size) long)."""
        if chunk.size == 0:
            scale_inv = np.ones((1, 1), FLOAT32)  # nothing to scale: the scale alone travels
        else:
            q = quantize(chunk.reshape(1, -1), self.fmt, "tensor", "current")
            scale_inv = q.scale_inv.astype(FLOAT32)
            message[SCALE_BYTES:] = q.data.reshape(-1).view(np.uint8)
        message[:SCALE_BYTES] = scale_inv.reshape(1).view(np.uint8)

    def decode(self, message: np.ndarray) -> np.ndarray:
        """The float32 chunk a message carries (a new array): value * scale_inv."""
        values = message[SCALE_BYTES:].view(self.fmt.dtype)
        if values.size == 0:
            return np.empty(0, FLOAT32)
        scale_inv = message[:SCALE_BYTES].copy().view(FLOAT32).reshape(1, 1)
        group = (1, values.size)
        q = BlockQuantized(values.reshape(group), scale_inv, np.float32(1.0), group, self.fmt,
                           "current")
        return dequantize(q).reshape(-1)

    def round_trip(self, chunk: np.ndarray) -> np.ndarray:
        """decode(encode(chunk)): the float32 values a receiver of this chunk would hold."""
        message = np.empty(self.message_bytes(chunk.size), np.uint8)
        self.encode(chunk, message)
        return self.decode(message)


def wire_of(name: str) -> Fp8Wire:
    """The Fp8Wire of a wire name ("fp8": E4M3 values; "fp8_e5m2": E5M2)."""
    if name not in WIRE_FORMATS:
        raise ValueError(f"minimp.precision.wire: unknown fp8 wire {name!r}; choose one of "
                         f"{', '.join(WIRE_FORMATS)}")
    return Fp8Wire(WIRE_FORMATS[name])


def grad_wire(name: str) -> "np.dtype | Fp8Wire":
    """What --grad-comm-dtype (or --param-gather-dtype) names: an Fp8Wire for "fp8", else the
    16- or 32-bit dtype the values travel in (precision/casting.py's ACTIVATION_DTYPES)."""
    return Fp8Wire(WIRE_FORMATS[name]) if name in WIRE_FORMATS else ACTIVATION_DTYPES[name]


def buffer_bytes(name: str) -> int:
    """Bytes per element of the send and receive buffers a wire's collectives hold: an fp8 wire
    packs gradients into float32 buffers (its messages are made chunk by chunk, one at a time)."""
    wire = grad_wire(name)
    return FLOAT32.itemsize if isinstance(wire, Fp8Wire) else wire.itemsize
