"""fp8's amax agreement: the ranks that hold the same tensors take the MAX of their amaxes.

Delayed scaling computes each step's scales from the amaxes it recorded. Data-parallel replicas see
different shards of the batch (context-parallel ranks other tokens of the same samples), so their
activations and gradients have different amaxes; if each rank kept its own, their scales, and with
them their fp8 states, would drift apart. One MAX all-reduce of all of a stage's amaxes after each
step (Transformer Engine reduces over its "amax reduction group", the data-, context- and
tensor-parallel ranks) gives every rank the largest amax any of them saw, so all compute the same
scales, bit for bit. For activations that is the amax of the whole batch, every token of it, as
one process sees it. Output gradients are dp x cp times one process's (each rank's loss is the
mean over its own rows and tokens; the all-reduce divides by dp x cp later), so their scales are
1/(dp cp) times one process's and the fp8 values the same (train/fp8.py starts them there).

With --ep an expert's Linears run on one rank of each ep group, on the rows of the whole group;
the stage's other ranks never quantize through their copies of them and record amax 0. The
stage's MAX of an expert's amaxes is then the MAX over the ranks holding it (the expert
data-parallel group): the expert's amax over the whole batch, as one process records it, and
every rank of the stage, holder or not, keeps that state for every expert (replica 0 writes the
checkpoint; --check-replicas compares the state over the replicas). A reduction over the expert
group alone would carry fewer numbers but leave each rank with only its own experts' state.

`AmaxReduction(comm)` is the `reduce_amax` that `precision.update_scales` takes: any group of ranks
sharing tensors passes its communicator (the training command passes a stage's group: its replicas,
its context shards and, with tensor parallelism, the ranks holding the shards of one tensor).
"""

import numpy as np

from minimp.distributed.protocol import Communicator


class AmaxReduction:
    """Elementwise MAX of an amax vector over the ranks of `comm` (one all-reduce of float64
    scalars, exact for float32 amaxes); a no-op on one rank."""

    def __init__(self, comm: Communicator):
        self.comm = comm

    def __call__(self, amaxes: np.ndarray) -> np.ndarray:
        """The MAX over the ranks of each amax, as float32 (amaxes hold no NaN: the quantizers
        record a NaN amax as inf, for which MAX is defined)."""
        if self.comm.size == 1:
            return amaxes
        return self.comm.allreduce_scalars(amaxes, op="max").astype(np.float32)
