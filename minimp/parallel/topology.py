"""The dp x cp x tp x pp grid: which pipeline stage, data-parallel replica, context shard and tensor
shard each rank is.

Megatron-Core's order: tensor-parallel ranks are neighbours, then context-parallel ranks, then
data-parallel replicas, then pipeline stages,

    world rank = stage * (dp * cp * tp) + dp_rank * (cp * tp) + cp_rank * tp + tp_rank

because tensor parallelism talks most (every layer, every micro-batch, activations the size of the
residual stream), so its ranks belong inside one node; context parallelism next (every attention
passes key/value blocks around its ring); the replicas all-reduce once a step; the stages pass one
activation per micro-batch to one neighbour and tolerate the slowest links. (Before tensor
parallelism, minimp numbered stages first: rank = dp_rank * pp + stage; see CHANGELOG.md.)
A Topology is passed as an argument; nothing about it is global.
"""

from minimp.distributed.protocol import Communicator


class TopologyError(ValueError):
    """The grid does not fit the number of ranks."""


class Topology:
    """Coordinates of this rank in a dp x cp x pp x tp grid of comm's ranks (dp * cp * pp * tp ==
    comm.size), plus the sub-communicators it talks through:

    tp_group     the tensor-parallel shards of this context shard (activations, every layer)
    cp_group     the context-parallel shards of this tensor shard: the ring attention's ranks, each
                 holding other positions of the same samples
    dp_group     the replicas of this context and tensor shard of this stage
    dp_cp_group  dp_group x cp_group: the ranks whose gradients of the same weights are reduced
                 (the replicas see other samples, the context shards other tokens of them)
    pp_group     the stages of this replica's shard (activations between stages)
    mp_group     every rank of this replica's context shard, tp x pp (the model's gradient norm
                 adds up over them)
    stage_group  every rank of this stage, dp x cp x tp (fp8's amaxes: they hold the same tensors)
    ep_group     with --ep (None without), the ep adjacent replicas (dp_rank // ep alike) whose
                 experts together are the E of a mixture: tokens travel between them
                 (Megatron-Core's expert model parallel group); ep_rank = dp_rank % ep holds
                 experts ep_rank E/ep, ...
    expert_dp_group  with --ep, the dp/ep replicas holding the same experts (ep_rank alike): their
                 expert gradients are reduced over it (Megatron-Core's expert data parallel group)
    """

    def __init__(self, comm: Communicator, dp: int, pp: int = 1, tp: int = 1, cp: int = 1,
                 ep: int = 1):
        if ep < 1 or dp % ep:
            raise TopologyError(f"--ep {ep} does not divide --dp {dp} (expert-parallel ranks are "
                                "data-parallel ranks: choose an --ep that divides --dp)")
        if min(dp, pp, tp, cp) < 1 or dp * cp * tp * pp != comm.size:
            sizes, names = f"--dp {dp} x --tp {tp} x --pp {pp}", "--dp, --tp and --pp"
            if cp != 1:
                sizes = f"--dp {dp} x --cp {cp} x --tp {tp} x --pp {pp}"
                names = "--dp, --cp, --tp and --pp"
            raise TopologyError(f"{sizes} = {dp * cp * tp * pp} ranks, but the job has "
                                f"{comm.size} (choose {names} whose product is {comm.size})")
        self.world, self.dp, self.pp, self.tp, self.cp = comm, dp, pp, tp, cp
        self.stage, self.dp_rank, self.cp_rank, self.tp_rank = self.coordinates(comm.rank)
        stage, dp_rank, cp_rank, tp_rank = self.stage, self.dp_rank, self.cp_rank, self.tp_rank
        self.tp_group = comm.split(color=(stage * dp + dp_rank) * cp + cp_rank, key=tp_rank)
        self.cp_group = comm.split(color=(stage * dp + dp_rank) * tp + tp_rank, key=cp_rank)
        self.dp_group = comm.split(color=(stage * cp + cp_rank) * tp + tp_rank, key=dp_rank)
        self.dp_cp_group = comm.split(color=stage * tp + tp_rank, key=dp_rank * cp + cp_rank)
        self.pp_group = comm.split(color=(dp_rank * cp + cp_rank) * tp + tp_rank, key=stage)
        self.mp_group = comm.split(color=dp_rank * cp + cp_rank, key=stage * tp + tp_rank)
        self.stage_group = comm.split(color=stage, key=(dp_rank * cp + cp_rank) * tp + tp_rank)
        self.ep, self.ep_rank = ep, dp_rank % ep
        self.ep_group: Communicator | None = None
        self.expert_dp_group: Communicator | None = None
        if ep > 1:  # (no split without --ep: every split is a collective of the job)
            shard = (stage * cp + cp_rank) * tp + tp_rank  # the replicas' place outside dp
            self.ep_group = comm.split(color=shard * (dp // ep) + dp_rank // ep, key=self.ep_rank)
            self.expert_dp_group = comm.split(color=shard * ep + self.ep_rank, key=dp_rank // ep)

    def coordinates(self, rank: int) -> tuple[int, int, int, int]:
        """(stage, dp_rank, cp_rank, tp_rank) of any world rank."""
        dp, cp, tp = self.dp, self.cp, self.tp
        return rank // (dp * cp * tp), rank // (cp * tp) % dp, rank // tp % cp, rank % tp

    def describe_rank(self, rank: int) -> str:
        """'stage 1, replica 0, context 1, shard 1' (the parts that exist: pp, dp, cp, tp > 1)."""
        stage, dp_rank, cp_rank, tp_rank = self.coordinates(rank)
        parts = [f"stage {stage}", f"replica {dp_rank}", f"context {cp_rank}", f"shard {tp_rank}"]
        sizes = (self.pp, self.dp, self.cp, self.tp)
        kept = [part for part, size in zip(parts, sizes) if size > 1]
        return ", ".join(kept) or "the whole model"

    def describe(self) -> str:
        """The grid and every rank's place in it, as rank 0 prints it once at start (the context
        dimension named where there is one, the experts' split with --ep)."""
        if self.cp == 1:
            head = (f"layout: --dp {self.dp} x --tp {self.tp} x --pp {self.pp} = {self.world.size} "
                    "ranks (tensor-parallel ranks adjacent, then replicas, then stages)")
        else:
            head = (f"layout: --dp {self.dp} x --cp {self.cp} x --tp {self.tp} x --pp {self.pp} = "
                    f"{self.world.size} ranks (tensor-parallel ranks adjacent, then "
                    "context-parallel ranks, then replicas, then stages)")
        lines = [head] + [f"  rank {r}: {self.describe_rank(r)}" for r in range(self.world.size)]
        if self.ep > 1:
            ep = self.ep
            lines.append(f"  --ep {ep}: each {ep} adjacent replicas hold the experts once between "
                         f"them, replica r share r mod {ep} (E/{ep} of each mixture)")
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
                f"replica {self.dp_rank}/{self.dp}, context {self.cp_rank}/{self.cp}, "
                f"shard {self.tp_rank}/{self.tp})")
