"""What Topology.__init__ builds: it refuses a grid that does not fit the job, every
sub-communicator holds exactly the ranks the module docstring's numbering puts in it (in the
documented order), and the colors it hands to split are what MPI_Comm_split accepts
(non-negative ints)."""

import numpy as np
import pytest

from minimp import distributed as dist
from minimp.parallel.topology import Topology, TopologyError


def test_a_grid_whose_product_is_not_the_job_size_is_refused_with_the_sizes():
    """--dp 2 on a one-rank job: every size is >= 1, only the product is wrong, and that alone
    must be refused (a check that only looked at the product when tp < 1 would accept it)."""

    def build(comm):
        with pytest.raises(TopologyError) as error:
            Topology(comm, dp=2)
        return str(error.value)

    [message] = dist.simulate(1, build)
    assert message == (
        "--dp 2 x --tp 1 x --pp 1 = 2 ranks, but the job has 1 "
        "(choose --dp, --tp and --pp whose product is 1)"
    )


def test_a_context_grid_that_does_not_fit_names_every_dimension():
    def build(comm):
        with pytest.raises(TopologyError) as error:
            Topology(comm, dp=1, cp=2)
        return str(error.value)

    [message] = dist.simulate(1, build)
    assert message == (
        "--dp 1 x --cp 2 x --tp 1 x --pp 1 = 2 ranks, but the job has 1 "
        "(choose --dp, --cp, --tp and --pp whose product is 1)"
    )


def _world_ranks_in_group_order(group, world_rank):
    """The world ranks of a group's members, indexed by their rank in the group (one all-reduce)."""
    slots = np.zeros(group.size)
    slots[group.rank] = world_rank
    return [int(rank) for rank in group.allreduce_scalars(slots, op="sum")]


def _expected_groups(rank, dp, pp, tp, cp=1):
    """Each group's members by the docstring's numbering,
    rank = stage * dp * cp * tp + dp_rank * cp * tp + cp_rank * tp + tp_rank."""
    stage, dp_rank = rank // (dp * cp * tp), rank // (cp * tp) % dp
    cp_rank, tp_rank = rank // tp % cp, rank % tp

    def world(s, d, c, t):
        return s * dp * cp * tp + d * cp * tp + c * tp + t

    return {
        "tp_group": [world(stage, dp_rank, cp_rank, t) for t in range(tp)],
        "cp_group": [world(stage, dp_rank, c, tp_rank) for c in range(cp)],
        "dp_group": [world(stage, d, cp_rank, tp_rank) for d in range(dp)],
        "dp_cp_group": [world(stage, d, c, tp_rank) for d in range(dp) for c in range(cp)],
        "pp_group": [world(s, dp_rank, cp_rank, tp_rank) for s in range(pp)],
        "mp_group": [world(s, dp_rank, cp_rank, t) for s in range(pp) for t in range(tp)],
        "stage_group": [world(stage, d, c, t) for d in range(dp) for c in range(cp)
                        for t in range(tp)],
    }


GROUPS = ("tp_group", "cp_group", "dp_group", "dp_cp_group", "pp_group", "mp_group", "stage_group")


@pytest.mark.parametrize(
    "dp, pp, tp, cp",
    [
        (2, 3, 1, 1),  # more stages than replicas: stage 2 of replica 0 vs stage 0 of replica 1
        (1, 3, 2, 1),  # more stages than shards: stage 2 shard 0 vs stage 0 shard 1
        (3, 1, 2, 1),  # more replicas than shards: replica 2 shard 0 vs replica 0 shard 1
        (2, 2, 2, 1),
        (3, 1, 1, 2),  # more replicas than context shards
        (1, 1, 2, 3),  # more context shards than tensor shards: cp between tp and dp
        (2, 2, 2, 2),  # every dimension: 16 ranks
    ],
)
def test_every_group_holds_the_documented_ranks_in_the_documented_order(dp, pp, tp, cp):
    """Grids where a color formula that divided instead of multiplying would put two groups under
    one color, and where ordering a stage's ranks by anything but (dp_rank * cp + cp_rank) * tp
    + tp_rank would renumber them: each group's members, by group rank, must be exactly the
    docstring's."""

    def groups(comm):
        topology = Topology(comm, dp=dp, pp=pp, tp=tp, cp=cp)
        return {
            name: _world_ranks_in_group_order(getattr(topology, name), comm.rank)
            for name in GROUPS
        }

    got = dist.simulate(dp * pp * tp * cp, groups)
    for rank, groups_of_rank in enumerate(got):
        assert groups_of_rank == _expected_groups(rank, dp, pp, tp, cp), f"rank {rank}"


class _RecordingCommunicator:
    """A simulated communicator that notes the (color, key) of every split it is asked for."""

    def __init__(self, comm):
        self.comm, self.rank, self.size, self.splits = comm, comm.rank, comm.size, []

    def split(self, color, key=0):
        self.splits.append((color, key))
        return self.comm.split(color, key)


def test_split_colors_and_keys_are_what_mpi_comm_split_accepts():
    """MPI_Comm_split takes an int color >= 0 (a negative one other than MPI_UNDEFINED is an
    error) and an int key; mpi4py refuses a float. The simulated world would accept any color, so
    the arguments are checked here: stage * dp - dp_rank would give -1 on replica 1 of stage 0,
    stage / dp a float."""

    def splits(comm):
        recorder = _RecordingCommunicator(comm)
        Topology(recorder, dp=2, pp=2, tp=2, cp=2)
        return recorder.splits

    for rank, calls in enumerate(dist.simulate(16, splits)):
        assert len(calls) == len(GROUPS), f"rank {rank}"
        for color, key in calls:
            assert type(color) is int and color >= 0, f"rank {rank}: color {color!r}"
            assert type(key) is int, f"rank {rank}: key {key!r}"
