"""Lesson 12 (cutting every layer): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/12_cutting_every_layer.ipynb became false, or a checker passes a wrong answer."""

import functools
from dataclasses import replace

import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor, nn
from minimp import distributed as dist
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.lessons import cutting
from minimp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minimp.parallel.tensor.mappings import all_reduce
from minimp.plan.inputs import Job
from minimp.plan.presets import DATACENTER, MODELS, NVLINK, selene
from minimp.plan.search import best_plans
from minimp.plan.steptime import step_time

H, B = 8, 3


@functools.cache
def runs():
    with limit_cpu_threads(1):  # the notebook's one BLAS thread: the losses depend on it
        return cutting.measure()


def pair(comm, first, second, x, grad_y):
    column, row = ColumnParallelLinear(first, comm), RowParallelLinear(second, comm)
    x_ = Tensor(x, requires_grad=True)
    hidden = F.relu(column(x_))
    start = comm.bytes_sent
    y = row(hidden)
    forward = comm.bytes_sent - start
    y.backward(grad_y)
    partial = hidden.data @ row.weight.data.T
    return y.data, x_.grad, hidden.shape, forward, comm.bytes_sent - start - forward, partial


def test_the_column_row_pair_equals_one_process_and_sends_192_bytes_each_way():
    rng = np.random.default_rng(0)
    first = nn.Linear(H, 4 * H, rng=rng).to(np.float64)
    second = nn.Linear(4 * H, H, rng=rng).to(np.float64)
    x, grad_y = rng.standard_normal((B, H)), rng.standard_normal((B, H))
    x_ = Tensor(x, requires_grad=True)
    y = second(F.relu(first(x_)))
    y.backward(grad_y)
    results = dist.simulate(2, pair, first, second, x, grad_y)
    assert y.data.nbytes == 192
    for y_r, grad_x, shape, forward, backward, _ in results:
        assert shape == (3, 16) and forward == backward == 192
        assert 0 < np.max(np.abs(y_r - y.data)) < 1e-15
        assert np.max(np.abs(grad_x - x_.grad)) < 1e-15
    partial = [r[5] for r in results]
    assert not np.allclose(partial[0] + second.bias.data, y.data)
    assert np.allclose(partial[0] + partial[1] + second.bias.data, y.data)


def test_summing_y_sends_half_the_bytes_of_gathering_the_hidden_activation():
    def sent(comm):
        hidden = np.ones((B, 4 * H // 2))  # this rank's half of the b x 4h activation
        dist.all_gather(comm, hidden.ravel(), hidden.size * 2)
        gathered = comm.bytes_sent
        all_reduce(comm, np.ones((B, H)))
        return gathered, comm.bytes_sent - gathered

    for gathered, summed in dist.simulate(2, sent):
        assert summed * 2 == gathered


def test_the_gpt_blocks_cut():
    def describe(comm):
        model = cutting.GPT(cutting.CONFIG, np.random.default_rng(0))
        cutting.parallelize_module(model, comm)
        return repr(model.layers[1])

    text = dist.simulate(2, describe)[0]
    assert "ColumnParallelLinear(64, 96 of 192" in text
    assert "ColumnParallelLinear(64, 128 of 256" in text


def test_the_losses():
    measured = runs()
    assert f"{measured['one process'][0]['loss']:.6f}" == "4.205114"
    for layout in ("tp 2", "tp 2 + sp"):
        assert [f"{r['loss']:.6f}" for r in measured[layout]] == ["4.205112"] * 2
    assert measured["pp 2"][0]["loss"] is None
    dp = [r["loss"] for r in measured["dp 2"]]
    assert np.isclose(np.mean(dp), measured["one process"][0]["loss"], rtol=1e-3)


def test_the_side_by_side_numbers():
    m = runs()
    one, dp, tp, sp, pp = (m[k] for k in cutting.LAYOUTS)
    parameters = sum(p.data.size for p in cutting.GPT(cutting.CONFIG,
                                                      np.random.default_rng(0)).parameters())
    assert parameters == 206_272 and 2 * parameters == one[0]["parameters"] == 412_544
    assert one[0]["kept_blocks"] == 2_899_968
    for r in dp:
        assert r["parameters"] == 412_544 and r["kept_blocks"] == 1_449_984
        assert r["sent"] == {"data_parallel": 825_088} == {"data_parallel": 4 * parameters}
    for r in tp:
        assert r["parameters"] == 214_144 and r["kept_blocks"] == 1_785_856
        assert r["sent"] == {"tensor_parallel": 524_288} == {"tensor_parallel": 16 * 32_768}
        assert r["kept_blocks"] > one[0]["kept_blocks"] / 2
    for r in sp:
        assert r["kept_blocks"] == 1_581_056 and r["sent"] == {"tensor_parallel": 563_200}
    assert [r["parameters"] for r in pp] == [212_352, 208_512]
    for r in pp:
        assert r["kept_blocks"] == 1_449_984
        assert r["sent"] == {"pipeline": 32_768, "tied": 16_640}
    assert cutting.ROWS * cutting.CONFIG.context * cutting.CONFIG.width * 2 == 32_768


@functools.cache
def planned():
    model, cluster, job = MODELS["76.1B"], selene(1024), Job(1792)
    return model, cluster, job, best_plans(model, cluster, job)


def test_the_planner_at_1024_gpus():
    model, cluster, job, plans = planned()
    assert (model.layers, model.hidden, model.heads, model.context) == (60, 10240, 80, 2048)
    assert model.vocab == 51_200 and job.vocabulary_parallel
    assert all(p.layout.tp == 8 for p in plans[:4]) and plans[4].layout.tp == 4
    top, twin = plans[0], plans[1]
    assert top.layout.sequence_parallel and not twin.layout.sequence_parallel
    assert replace(twin.layout, sequence_parallel=True) == top.layout
    assert top.time.total == twin.time.total
    assert (f"{top.memory.total / 2**30:.2f}", f"{twin.memory.total / 2**30:.2f}") == (
        "37.26", "47.58")
    assert round(1 / NVLINK.beta / 1e9) == 300 and round(1 / DATACENTER.beta / 1e9) == 25
    assert cluster.gpus_per_node == 8
    best = {tp: next(p for p in plans if p.layout.tp == tp) for tp in (1, 2, 4, 8)}
    assert [f"{best[tp].time.total:.2f}" for tp in (1, 2, 4, 8)] == [
        "50.83", "40.70", "12.03", "11.77"]
    for tp in (1, 2):
        layout, plan = best[tp].layout, best[tp]
        assert layout.zero == 2 and layout.recompute and layout.tp * layout.pp == 4
        assert round(plan.memory.by_kind["parameters"] / 2**30) == 36
        assert round(plan.time.zero_in_step) == 22
    for tp in (4, 8):
        assert best[tp].layout.zero == 1 and not best[tp].layout.recompute


def test_tensor_parallelism_over_infiniband():
    model, cluster, job, plans = planned()
    top = plans[0]
    layout = top.layout
    assert (layout.pp, layout.micro_batches, model.layers // layout.pp) == (4, 56, 15)
    assert 4 * 15 * 56 == 3_360
    assert layout.micro_batch_size * model.context * model.hidden * job.compute_bytes == 41_943_040
    moved = step_time(model, replace(cluster, intra=cluster.inter), job, layout)
    assert (f"{top.time.tensor_parallel:.2f}", f"{moved.tensor_parallel:.2f}") == ("1.18", "10.22")
    assert f"{moved.total:.2f}" == "21.30"
    tp4 = next(p for p in plans if p.layout.tp == 4)
    assert moved.total > tp4.time.total


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def row_parallel_functions():
    """Row-parallel Linears, each wrong in one way."""
    from minimp.function import Function
    from minimp.parallel.tensor.mappings import all_reduce

    class RowParallelWithoutTheSum(Function):
        """Each rank keeps its partial output: g forgotten."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            return x @ weight.T

        backward = solutions(12).RowParallel.backward

    class RowParallelSummingBackward(Function):
        """An all-reduce in backward too: dL/dx_r belongs to this rank alone."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.comm = comm
            return solutions(12).RowParallel.forward(ctx, x, weight, comm)

        @staticmethod
        def backward(ctx, grad_output):
            grad_x, grad_weight = solutions(12).RowParallel.backward(ctx, grad_output)
            return all_reduce(ctx.comm, grad_x), grad_weight

    class RowParallelWithTheWeightGradientOfOneRow(Function):
        """dL/dW_r from the last sample only: the leading axes not summed."""

        forward = solutions(12).RowParallel.forward

        @staticmethod
        def backward(ctx, grad_output):
            x, weight = ctx.saved_arrays
            return grad_output @ weight, grad_output[-1, -1][:, None] * x[-1, -1][None, :]

    class RowParallelGatheringTheInput(Function):
        """The right numbers by gathering: every rank's x_r and W_r travel instead of y."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            whole = all_reduce(comm, np.zeros((comm.size, *x.shape)))  # bytes of a gather
            return all_reduce(comm, x @ weight.T) + 0 * whole.sum()

        backward = solutions(12).RowParallel.backward

    return [RowParallelWithoutTheSum, RowParallelSummingBackward,
            RowParallelWithTheWeightGradientOfOneRow, RowParallelGatheringTheInput]


def tp_bytes_all_reduce_as_twice_the_array(blocks, rows, context, width, tp, micro_batches,
                                           compute_bytes, sequence_parallel):
    """An all-reduce counted as 2 n, not 2 (t - 1)/t n."""
    if tp == 1:
        return 0
    fraction = solutions(12).tp_bytes_sent(blocks, rows, context, width, 2, micro_batches,
                                           compute_bytes, sequence_parallel)
    return 2 * fraction


def tp_bytes_forward_only(blocks, rows, context, width, tp, micro_batches, compute_bytes,
                          sequence_parallel):
    return solutions(12).tp_bytes_sent(blocks, rows, context, width, tp, micro_batches,
                                       compute_bytes, sequence_parallel) / 2


def tp_bytes_sequence_parallel_as_plain(blocks, rows, context, width, tp, micro_batches,
                                        compute_bytes, sequence_parallel):
    """Sequence parallelism's blocks only: the head's gather and the partial gradients left out."""
    return solutions(12).tp_bytes_sent(blocks, rows, context, width, tp, micro_batches,
                                       compute_bytes, False)


WRONG = {
    "check_row_parallel": [
        Wrong(lambda: row_parallel_functions()[0], "", factory=True),
        Wrong(lambda: row_parallel_functions()[1], "", factory=True),
        Wrong(lambda: row_parallel_functions()[2], "", factory=True),
        Wrong(lambda: row_parallel_functions()[3], "", factory=True),
    ],
    "check_tp_bytes_sent": [
        Wrong(tp_bytes_all_reduce_as_twice_the_array, ""),
        Wrong(tp_bytes_forward_only, ""),
        Wrong(tp_bytes_sequence_parallel_as_plain, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(12, WRONG)
