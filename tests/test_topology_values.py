"""How a rank names its place in the grid, where the grid has no parts: one rank is the whole
model (the name a one-rank run's trace and layout give rank 0)."""

from minimp import distributed as dist
from minimp.parallel.topology import Topology


def test_a_rank_of_a_one_rank_grid_is_the_whole_model():
    def names(comm):
        topology = Topology(comm, dp=1)
        return topology.describe_rank(0), topology.describe().splitlines()[1:]

    [(name, rank_lines)] = dist.simulate(1, names)
    assert name == "the whole model"
    assert rank_lines == ["  rank 0: the whole model"]
