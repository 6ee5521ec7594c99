"""Parameters two pipeline stages both hold: the GPT's token embedding, read by the first stage
(the input) and by the last (the head, whose weight is tied to it).

Within one process the two uses share one array and backward adds both gradients into it. Across
stages each of the two ranks keeps its own copy, and the copies must stay bit-identical: both start
from the same broadcast weights, and before every update their two float32 gradients are summed
with one all-reduce between the first and the last stage (Megatron-LM's "embedding group"), so both
ranks take the same step from the same sum. The gradient norm counts the parameter once, on the
first stage.
"""

from minimp.distributed.protocol import Communicator
from minimp.distributed.ring import ring_allreduce


class TiedGradients:
    """Sums the gradients of this rank's copies of tied parameters with the other stage's."""

    def __init__(self, comm: Communicator, indices: list[int], counts_in_norm: bool):
        """comm: this rank and the other stage holding the same parameters (2 ranks); indices:
        the optimizer positions of this rank's copies, in the same order on both ranks;
        counts_in_norm: False on the stage whose copies the norm must not count again."""
        self.comm, self.indices, self.counts_in_norm = comm, indices, counts_in_norm

    def reduce(self, gradients: list) -> None:
        """Replace each tied gradient, in place, by its sum over the two stages (float32)."""
        self.sum_across_stages([gradients[index] for index in self.indices])

    def sum_across_stages(self, arrays: list) -> None:
        """Replace each array, in place, by its sum with the other stage's (the same arrays in
        the same order there: whole gradients, or with ZeRO this rank's chunks of them)."""
        for array in arrays:
            array[...] = ring_allreduce(self.comm, array)

    def uncounted(self) -> set[int]:
        """Optimizer positions the gradient norm leaves out on this rank."""
        return set() if self.counts_in_norm else set(self.indices)


def tied_group(pp_group: Communicator, stage: int, stages: int) -> Communicator | None:
    """The first and the last stage of this replica as one 2-rank group, ranked by stage (the
    first stage is its rank 0), whatever order pp_group numbers them in (every stage of the
    pipeline must call this: it splits pp_group); None on the stages between, and with one stage."""
    ends = stage in (0, stages - 1)
    group = pp_group.split(color=0 if ends else 1, key=stage)
    return group if ends and stages > 1 else None


def tied_indices(names: list[str], tied_names: list[str]) -> list[int]:
    """Positions of the tied parameters in this rank's list of parameter names, in tied order."""
    return [names.index(name) for name in tied_names if name in names]
