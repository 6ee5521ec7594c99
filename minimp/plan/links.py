"""What a collective costs on one network, for the planner: two models behind one interface.

`AlphaBeta` prices a stated network (costmodel.Network: latency alpha, seconds per byte beta,
reduction gamma) with the ring formulas of Thakur, Rabenseifner & Gropp (2005), p ranks, n bytes:

  all-reduce       2(p-1) alpha + 2(p-1)/p n beta + (p-1)/p n gamma   (costmodel's ring)
  reduce-scatter   (p-1) alpha + (p-1)/p n beta + (p-1)/p n gamma     (the all-reduce's first half)
  all-gather       (p-1) alpha + (p-1)/p n beta                        (its second half)
  send             alpha + n beta                                      (one message, Hockney)
  all-to-all       (p-1) alpha + (p-1)/p n beta                        (pairwise, costmodel's)

`Measured` prices them with this machine's fitted terms (machinemodel.MachineModel: the agreement,
the Python around the messages, each Sendrecv, each add), measured under one sharing of the cores
and used for a group of any size inside it: a dp = 2 group of a 4-rank job runs under the 4
ranks' sharing, with p = 2. Its reduce-scatter and all-gather are the halves of minimp's ring
(distributed/ring.py), each with the all-reduce's agreement and half of its Python; its
all-to-all is minimp's (distributed/alltoall.py): the agreement, then p - 1 messages of n/p bytes
(its Python around them is not measured: not counted).
"""

import dataclasses
from dataclasses import dataclass
from typing import Protocol

from minimp.measure.costmodel import Network, alltoall_time, ring_allreduce_time
from minimp.measure.machinemodel import MachineModel


class Links(Protocol):
    """Seconds for the collectives the planner uses, over `ranks` ranks of one network."""

    def all_reduce(self, nbytes: float, ranks: int) -> float: ...

    def reduce_scatter(self, nbytes: float, ranks: int) -> float: ...

    def all_gather(self, nbytes: float, ranks: int) -> float: ...

    def send(self, nbytes: float) -> float: ...

    def all_to_all(self, nbytes: float, ranks: int) -> float: ...


@dataclass(frozen=True)
class AlphaBeta:
    """Ring collectives on a stated alpha-beta(-gamma) network."""

    network: Network

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        return ring_allreduce_time(nbytes, ranks, self.network) if ranks > 1 else 0.0

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        net, share = self.network, (ranks - 1) / ranks
        return (ranks - 1) * net.alpha + share * nbytes * (net.beta + net.gamma)

    def all_gather(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        net = self.network
        return (ranks - 1) * net.alpha + (ranks - 1) / ranks * nbytes * net.beta

    def send(self, nbytes: float) -> float:
        return self.network.alpha + nbytes * self.network.beta

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        return alltoall_time(nbytes, ranks, self.network)


@dataclass(frozen=True)
class Measured:
    """minimp's ring collectives with a machine model's measured terms (see the docstring)."""

    model: MachineModel

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        return dataclasses.replace(self.model, ranks=ranks).allreduce_time("ring", nbytes)

    def reduce_scatter(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        chunk = nbytes / ranks
        steps = (ranks - 1) * (self.model.message(chunk) + self.model.adds(chunk))
        return self._fixed(ranks) + steps

    def all_gather(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        return self._fixed(ranks) + (ranks - 1) * self.model.message(nbytes / ranks)

    def send(self, nbytes: float) -> float:
        return self.model.message(nbytes)

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        if ranks == 1:
            return 0.0
        return self.model.agree + (ranks - 1) * self.model.message(nbytes / ranks)

    def _fixed(self, ranks: int) -> float:
        """One half of a ring all-reduce's fixed cost: its agreement, half its Python."""
        return self.model.agree + self.model.python["ring"](ranks) / 2
