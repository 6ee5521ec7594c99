"""Expert parallelism: the dispatch's all-to-alls against one process (outputs, every gradient, the
rows each rank sends and receives, its bytes to the formula), the groups, and the trainer's
--ep layouts against one process (routing first, then the weights after 3 steps)."""

import numpy as np
import pytest

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp.models.moe import MoE
from minimp.parallel.expert import ExpertParallelDispatch, dispatch_bytes, local_experts

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
