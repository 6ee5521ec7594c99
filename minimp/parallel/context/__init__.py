"""Context parallelism: the sequence itself split across ranks, each holding its positions' queries,
keys and values; ring attention passes the key/value blocks around the group (ring.py), over the
zig-zag or contiguous shards of layout.py; Ulysses trades sequence shards for head shards with an
all-to-all (ulysses.py)."""

from minimp.parallel.context.layout import AttentionBytes, ContextLayout
from minimp.parallel.context.ring import (RingAttention, RingMemory, ring_attention,
                                          ring_bytes, ring_memory, ring_order)
from minimp.parallel.context.ulysses import (check_ulysses, heads_to_sequence, sequence_to_heads,
                                             ulysses_attention, ulysses_bytes, ulysses_memory)
