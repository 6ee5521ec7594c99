"""tied_group's values on the simulated world: who is in the group, in which order, and when
there is none."""

import numpy as np
import pytest

from minimp.distributed.simulated import simulate
from minimp.parallel.pipeline.tied import TiedGradients, tied_group


def stage_of(rank: int, stages: int, reversed_order: bool) -> int:
    """The stage a pp_group rank holds: the rank itself, or the stages numbered backwards."""
    return stages - 1 - rank if reversed_order else rank


@pytest.mark.parametrize("reversed_order", [False, True], ids=["ranks_by_stage", "reversed"])
@pytest.mark.parametrize("stages", [2, 3, 4])
def test_the_first_and_last_stage_form_one_group_ranked_by_stage(stages, reversed_order):
    # Whatever order pp_group numbers its ranks in, the tied group holds the first and the last
    # stage, and ranks them by stage: the first stage is its rank 0 (MPI_Comm_split's key).
    def body(comm):
        stage = stage_of(comm.rank, stages, reversed_order)
        group = tied_group(comm, stage, stages)
        return None if group is None else (group.rank, group.size, group.members)

    results = simulate(stages, body)
    world_rank = {stage_of(r, stages, reversed_order): r for r in range(stages)}
    ends = [world_rank[0], world_rank[stages - 1]]  # pp_group ranks, first stage first
    for rank, result in enumerate(results):
        stage = stage_of(rank, stages, reversed_order)
        if stage in (0, stages - 1):
            assert result == (0 if stage == 0 else 1, 2, ends)
        else:
            assert result is None, f"stage {stage} of {stages} is not an end"


def test_with_one_stage_there_is_no_tied_group():
    # the one stage is both the first and the last: nothing to share with another rank
    assert list(simulate(1, lambda comm: tied_group(comm, 0, 1))) == [None]


def test_the_tied_group_sums_the_two_ends_gradients():
    stages = 3
    gradients = {stage: np.arange(5, dtype=np.float32) * (stage + 1) for stage in range(stages)}

    def body(comm):
        stage = stage_of(comm.rank, stages, reversed_order=True)
        group = tied_group(comm, stage, stages)
        if group is None:
            return None
        gradient = gradients[stage].copy()
        TiedGradients(group, [0], counts_in_norm=stage == 0).reduce([gradient])
        return gradient

    results = simulate(stages, body)
    expected = gradients[0] + gradients[stages - 1]
    for rank, result in enumerate(results):
        if stage_of(rank, stages, reversed_order=True) == 1:
            assert result is None
        else:
            np.testing.assert_array_equal(result, expected)
