"""The dp x pp grid: which pipeline stage and which data-parallel replica each rank is.

World rank = dp_rank * pp + stage, so the P stages of one replica are neighbouring ranks (on a real
cluster: activations, sent every micro-batch, stay inside a node; gradients, all-reduced once a
step, cross nodes). A Topology is passed as an argument; nothing about it is global.
"""

from minimp.distributed.protocol import Communicator


class TopologyError(ValueError):
    """The grid does not fit the number of ranks."""


class Topology:
    """Coordinates of this rank plus the two sub-communicators it talks through."""

    def __init__(self, comm: Communicator, dp: int, pp: int = 1):
        if dp < 1 or pp < 1 or dp * pp != comm.size:
            raise TopologyError(
                f"--dp {dp} x --pp {pp} = {dp * pp} ranks, but the job has {comm.size} "
                f"(choose --dp and --pp whose product is {comm.size})"
            )
        self.world, self.dp, self.pp = comm, dp, pp
        self.stage = comm.rank % pp
        self.dp_rank = comm.rank // pp
        # Replicas of the same stage, which all-reduce their gradients together.
        self.dp_group = comm.split(color=self.stage, key=self.dp_rank)
        # The stages of this replica, which pass activations forward and gradients back.
        self.pp_group = comm.split(color=self.dp_rank, key=self.stage)

    @property
    def is_first_stage(self) -> bool:
        """True on the stage that reads the data."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that computes the loss."""
        return self.stage == self.pp - 1

    @property
    def previous_stage(self) -> int | None:
        """pp_group rank of the stage before this one, or None on the first stage."""
        return None if self.is_first_stage else self.stage - 1

    @property
    def next_stage(self) -> int | None:
        """pp_group rank of the stage after this one, or None on the last stage."""
        return None if self.is_last_stage else self.stage + 1

    def __repr__(self) -> str:
        return (
            f"Topology(rank {self.world.rank}: stage {self.stage}/{self.pp}, "
            f"replica {self.dp_rank}/{self.dp})"
        )
