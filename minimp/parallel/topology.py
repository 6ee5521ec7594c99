"""The dp x tp x pp grid: which pipeline stage, data-parallel replica and tensor shard each rank is.

Megatron-LM's order: tensor-parallel ranks are neighbours, then data-parallel replicas, then
pipeline stages,

    world rank = stage * (dp * tp) + dp_rank * tp + tp_rank

because tensor parallelism talks most (every layer, every micro-batch, activations the size of the
residual stream), so its ranks belong inside one node; the replicas all-reduce once a step; the
stages pass one activation per micro-batch to one neighbour and tolerate the slowest links. (Before
tensor parallelism, minimp numbered stages first: rank = dp_rank * pp + stage; see CHANGELOG.md.)
A Topology is passed as an argument; nothing about it is global.
"""

from minimp.distributed.protocol import Communicator


class TopologyError(ValueError):
    """The grid does not fit the number of ranks."""


class Topology:
    """Coordinates of this rank in a dp x pp x tp grid of comm's ranks (dp * pp * tp ==
    comm.size), plus the sub-communicators it talks through:

    tp_group     the tensor-parallel shards of this stage of this replica (activations, every layer)
    dp_group     the replicas of this shard of this stage (gradients, once a step)
    pp_group     the stages of this replica's shard (activations between stages)
    mp_group     every rank of this replica, tp x pp (the model's gradient norm adds up over them)
    stage_group  every rank of this stage, dp x tp (fp8's amaxes: they hold the same tensors)
    """

    def __init__(self, comm: Communicator, dp: int, pp: int = 1, tp: int = 1):
        if dp < 1 or pp < 1 or tp < 1 or dp * tp * pp != comm.size:
            raise TopologyError(f"--dp {dp} x --tp {tp} x --pp {pp} = {dp * tp * pp} ranks, but "
                                f"the job has {comm.size} (choose --dp, --tp and --pp whose "
                                f"product is {comm.size})")
        self.world, self.dp, self.pp, self.tp = comm, dp, pp, tp
        self.stage, self.dp_rank, self.tp_rank = self.coordinates(comm.rank)
        stage, dp_rank, tp_rank = self.stage, self.dp_rank, self.tp_rank
        self.tp_group = comm.split(color=stage * dp + dp_rank, key=tp_rank)
        self.dp_group = comm.split(color=stage * tp + tp_rank, key=dp_rank)
        self.pp_group = comm.split(color=dp_rank * tp + tp_rank, key=stage)
        self.mp_group = comm.split(color=dp_rank, key=stage * tp + tp_rank)
        self.stage_group = comm.split(color=stage, key=dp_rank * tp + tp_rank)

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        """(stage, dp_rank, tp_rank) of any world rank."""
        return rank // (self.dp * self.tp), rank // self.tp % self.dp, rank % self.tp

    def describe_rank(self, rank: int) -> str:
        """'stage 1, replica 0, shard 1' (the parts that exist: pp, dp, tp > 1)."""
        stage, dp_rank, tp_rank = self.coordinates(rank)
        parts = [f"stage {stage}", f"replica {dp_rank}", f"shard {tp_rank}"]
        kept = [part for part, size in zip(parts, (self.pp, self.dp, self.tp)) if size > 1]
        return ", ".join(kept) or "the whole model"

    def describe(self) -> str:
        """The grid and every rank's place in it, as rank 0 prints it once at start."""
        lines = [f"layout: --dp {self.dp} x --tp {self.tp} x --pp {self.pp} = {self.world.size} "
                 "ranks (tensor-parallel ranks adjacent, then replicas, then stages)"]
        lines += [f"  rank {r}: {self.describe_rank(r)}" for r in range(self.world.size)]
        return "\n".join(lines)

    @property
    def is_first_stage(self) -> bool:
        """True on the stage that reads the data."""
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        """True on the stage that computes the loss."""
        return self.stage == self.pp - 1

    def __repr__(self) -> str:
        return (f"Topology(rank {self.world.rank}: stage {self.stage}/{self.pp}, "
                f"replica {self.dp_rank}/{self.dp}, shard {self.tp_rank}/{self.tp})")
