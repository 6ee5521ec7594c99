"""What the mixed-precision step asks of tensor parallelism: partial gradients summed, replicated
parameters counted once in the norm, and (--check-replicas) replicated parameters checked equal.

Every tensor-parallel rank holds its own shard of each cut parameter and a whole copy of every
other one (LayerNorms, the row layers' biases, the embeddings). A whole copy gets the same gradient
on every rank, bit for bit, because it is computed from the same activations and the same
(all-reduced) gradients, so no bytes are needed to keep the copies equal. Two exceptions:

- with sequence parallelism, the parameters that act on a slice of the sequence (the blocks'
  LayerNorms and the row layers' biases) see only their slice's positions: each rank's gradient is
  a partial sum, summed over the ranks once a step, after the replicas' average (Megatron-LM does
  the same for its `sequence_parallel` parameters);
- the gradient norm: a cut parameter's squares are spread over the ranks and add up; a whole
  one's are the same on every rank and are counted on tensor-parallel rank 0 only.
"""

from typing import Sequence

from minimp.backend import Array, array_module
from minimp.distributed.protocol import Communicator
from minimp.parallel.replicas import check_same
from minimp.parallel.tensor.mappings import all_reduce
from minimp.parallel.tensor.models import TensorParallelPlan


class TensorParallelGradients:
    """The tensor-parallel part of a step, for this rank's parameters (optimizer positions)."""

    def __init__(self, comm: Communicator, replicated: list[int], partial: list[int]):
        """comm: the tensor-parallel group; replicated: positions of the whole (not cut)
        parameters; partial: those among them whose gradients are partial sums."""
        self.comm, self.replicated, self.partial = comm, replicated, partial

    @classmethod
    def for_names(cls, comm: Communicator, names: list[str],
                  plan: TensorParallelPlan) -> "TensorParallelGradients":
        """From the stage's parameter names and a TensorParallelPlan."""
        replicated = [i for i, name in enumerate(names) if name not in plan.partitions]
        partial = [i for i, name in enumerate(names) if name in plan.partial]
        return cls(comm, replicated, partial)

    def reduce(self, gradients: list[Array | None], like: Sequence[Array] = ()) -> None:
        """Replace each partial gradient, in place, by its sum over the ranks (float32); a
        parameter no gradient reached takes part with zeros shaped like `like[index]`."""
        for index in self.partial:
            grad = gradients[index]
            if grad is None:
                grad = gradients[index] = array_module(like[index]).zeros_like(like[index])
            grad[...] = all_reduce(self.comm, grad)

    def reduce_pieces(self, pieces: dict[int, Array]) -> None:
        """ZeRO: the same sum for this rank's pieces of the partial gradients ({position: piece};
        every tensor-parallel rank holds the same pieces, its replicas' layout being the same)."""
        for index in self.partial:
            if index in pieces:
                pieces[index][...] = all_reduce(self.comm, pieces[index])

    def uncounted(self) -> set[int]:
        """Positions the gradient norm leaves out on this rank: the whole copies, except on
        tensor-parallel rank 0."""
        return set(self.replicated) if self.comm.rank else set()

    def check_replicated(self, masters: Sequence[Array], extra: Sequence[Array] = ()) -> None:
        """Raise ReplicaMismatchError unless every rank holds the same whole parameters (and
        `extra` arrays: fp8 state, the same on every rank after its MAX agreement)."""
        whole = [*(masters[i] for i in self.replicated), *extra]
        check_same(self.comm, whole, "the whole (replicated) parameters of tensor-parallel "
                   "rank(s) {ranks} differ from rank 0's (tensor-parallel copies drifted apart)")
