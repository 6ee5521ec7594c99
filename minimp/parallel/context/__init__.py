"""Context parallelism: the sequence itself split across ranks, each holding its positions' queries,
keys and values; ring attention passes the key/value blocks around the group (ring.py), over the
zig-zag or contiguous shards of layout.py."""

from minimp.parallel.context.layout import ContextLayout
from minimp.parallel.context.ring import (RingAttention, RingBytes, RingMemory, ring_attention,
                                          ring_bytes, ring_memory, ring_order)
