"""Expert parallelism: the dispatch's all-to-alls against one process (outputs, every gradient, the
rows each rank sends and receives, its bytes to the formula), the groups, and the trainer's
--ep layouts against one process (routing first, then the weights after 3 steps)."""

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.models.moe import MoE
from minimp.parallel.expert import (DispatchCounts, ExpertParallelDispatch, dispatch_bytes,
                                    local_experts)
from minimp.parallel.topology import Topology, TopologyError

WIDTH, EXPERTS, BATCH, TOKENS = 4, 4, 4, 6


def mixture(capacity_factor: float = 0.0) -> MoE:
    """The same float64 mixture on every rank (one seed)."""
    rng = np.random.default_rng(3)
    moe = MoE(WIDTH, EXPERTS, 2, capacity_factor, 8, True, nn.Dropout(0.0), rng)
    return moe.to(np.float64)


def one_and_ep(size: int, capacity_factor: float = 0.0):
    """(one process's output, input gradient and parameter gradients; every rank's, its share of
    the batch through the ep dispatch over `size` ranks)."""
    rng = np.random.default_rng(4)
    x, weights = rng.standard_normal((2, BATCH, TOKENS, WIDTH))

    def run(moe, x, weights):
        tensor = Tensor(x, requires_grad=True)
        y = moe(tensor)
        # the aux loss is a mean over the groups: a rank's share of one process's is len(x) / B
        ((y * Tensor(weights)).sum() + moe.aux_loss * (len(x) / BATCH)).backward()
        grads = {n: p.grad.copy() for n, p in moe.named_parameters() if p.grad is not None}
        return y.data, tensor.grad, grads, moe.routing

    one = run(mixture(capacity_factor), x, weights)

    def rank(comm):
        moe, share = mixture(capacity_factor), BATCH // comm.size
        moe.dispatch = dispatch = ExpertParallelDispatch(comm)
        rows = slice(comm.rank * share, (comm.rank + 1) * share)
        return (*run(moe, x[rows], weights[rows]), dispatch, comm.bytes_sent)

    return one, dist.simulate(size, rank)


@pytest.mark.parametrize("size", [2, 4])
def test_the_dispatch_routes_computes_and_differentiates_as_one_process(size):
    one, ranks = one_and_ep(size, capacity_factor=1.0)
    share = BATCH // size
    for r, (y, grad, grads, routing, _, _) in enumerate(ranks):
        rows = slice(r * share, (r + 1) * share)
        np.testing.assert_array_equal(routing.experts, one[3].experts[rows])  # routing first
        np.testing.assert_array_equal(routing.kept, one[3].kept[rows])
        np.testing.assert_allclose(y, one[0][rows], rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(grad, one[1][rows], rtol=1e-12, atol=1e-14)
    assert not one[3].kept.all()  # capacity 1.0 dropped pairs, the same ones
    # The router's gradient is the ranks' sum; an expert's is whole on the rank holding it.
    router = sum(ranks[r][2]["router.weight"] for r in range(size))
    np.testing.assert_allclose(router, one[2]["router.weight"], rtol=1e-12, atol=1e-14)
    for r in range(size):
        for expert in local_experts(EXPERTS, size, r):
            for name in ("c_fc.weight", "c_fc.bias", "c_proj.weight", "c_proj.bias"):
                key = f"experts.{expert}.{name}"
                np.testing.assert_allclose(ranks[r][2][key], one[2][key], rtol=1e-12,
                                           atol=1e-14, err_msg=key)


@pytest.mark.parametrize("size", [2, 4])
def test_the_rows_and_bytes_each_rank_sends_equal_the_formula_from_the_routing(size):
    """S: the admitted pairs of a rank's samples whose expert another rank holds; R: the other
    ranks' admitted pairs for this rank's experts (from one process's routing); the bytes the
    transport counted == counts (N - 1) E/N 8 + 2 (S + R) C x 8 (float64 rows)."""
    one, ranks = one_and_ep(size, capacity_factor=1.0)
    routing, share = one[3], BATCH // size
    holder = (routing.experts // (EXPERTS // size))[routing.kept]  # the rank of each admitted pair
    source = np.repeat(np.arange(BATCH) // share, TOKENS * 2).reshape(routing.kept.shape)
    source = source[routing.kept]
    for r, (*_, dispatch, sent) in enumerate(ranks):
        rows_sent = int(((source == r) & (holder != r)).sum())
        rows_received = int(((source != r) & (holder == r)).sum())
        counts = dispatch.with_graph
        assert (counts.calls, counts.rows_sent, counts.rows_received) == (
            1, rows_sent, rows_received)
        assert dispatch.without_graph == DispatchCounts()
        assert sent == dispatch_bytes(1, rows_sent, rows_received, EXPERTS, size, WIDTH * 8)
        assert sent == (size - 1) * (EXPERTS // size) * 8 + 2 * (rows_sent + rows_received) * 32


def test_the_ep_groups_are_adjacent_replicas_and_the_expert_groups_stride_across_them():
    """--dp 4 --ep 2: ranks {0, 1} and {2, 3} each hold all experts between them (rank 0 experts
    0-1 of 4, rank 1 experts 2-3); {0, 2} and {1, 3} hold the same experts."""
    def groups(comm):
        grid = Topology(comm, dp=4, ep=2)
        return (grid.ep_rank, [grid.ep_group.size, grid.expert_dp_group.size],
                list(local_experts(4, grid.ep, grid.ep_rank)),
                grid.ep_group.allreduce_scalars([float(comm.rank)], op="sum")[0],
                grid.expert_dp_group.allreduce_scalars([float(comm.rank)], op="sum")[0],
                grid.describe())

    result = dist.simulate(4, groups)
    assert "--ep 2: each 2 adjacent replicas hold the experts once" in result[0][-1]
    result = [values[:-1] for values in result]
    assert [ep_rank for ep_rank, *_ in result] == [0, 1, 0, 1]
    assert all(sizes == [2, 2] for _, sizes, *_ in result)
    assert [mine for _, _, mine, *_ in result] == [[0, 1], [2, 3], [0, 1], [2, 3]]
    assert [ep for *_, ep, _ in result] == [1, 1, 5, 5]  # 0 + 1, 2 + 3
    assert [expert for *_, expert in result] == [2, 4, 2, 4]  # 0 + 2, 1 + 3


def test_bad_splits_are_refused_in_one_line():
    with pytest.raises(TopologyError, match="--ep 3 does not divide --dp 4"):
        dist.simulate(4, lambda comm: Topology(comm, dp=4, ep=3))
    with pytest.raises(ValueError, match="6 experts do not split over 4"):
        local_experts(6, 4, 0)
