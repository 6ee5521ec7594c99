"""The expert parameters' gradient reduction: over the replicas that hold the same experts, divided
by every replica.

With --dp D and --ep N, the loss one process computes on the batch is the mean of the D replicas'
losses, L = (1/D) sum_r L_r (each L_r the mean over its B/D samples), so a dense weight's gradient
is (1/D) sum_r dL_r/dw: the mean over the D replicas (DataParallel). An expert's weights live on
one rank of each ep group, and the all-to-all brought it the rows of every rank of that group: its
local gradient is already sum over the N ranks r of the group of dL_r/dw (backward sent each
rank's row gradients to it). The D/N ep groups each hold a copy, so summing over those copies
(the expert data-parallel group, D/N ranks) gives sum over all D ranks of dL_r/dw, and the right
factor is 1/D, not 1/(D/N): the average over the expert group's replicas, divided again by N.
With N = D the group is this rank alone and the reduction is the division only.

The gradient norm: the dense gradients are equal on every replica, the expert ones differ across
an ep group (other experts) and agree within the expert group: the norm adds the dense squares
once and the expert squares summed over the ep group.
"""

from dataclasses import dataclass

from minimp.distributed.protocol import Communicator


@dataclass(frozen=True)
class ExpertGradients:
    """What DataParallel needs to reduce the expert gradients apart: comm, the replicas holding
    the same experts (Topology.expert_dp_group); ep_comm, the ranks holding the other experts
    (Topology.ep_group, for the norm); indices, the expert parameters' optimizer positions."""

    comm: Communicator
    ep_comm: Communicator
    indices: frozenset[int]
