"""Lesson 12 (cutting every layer): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/12_cutting_every_layer.ipynb became false, or a checker passes a wrong answer."""

import functools
from dataclasses import replace

import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor
from minimp import distributed as dist
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.lessons import cutting
from minimp.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear
from minimp.plan import cli as planner
from minimp.plan.search import best_plans
from minimp.plan.steptime import step_time


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
    first, second, x, grad_y = cutting.mlp_pair()
    assert (cutting.PAIR_WIDTH, cutting.PAIR_ROWS) == (8, 3)
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


def test_gathering_the_hidden_activation_sends_twice_the_bytes_of_summing_y_for_every_t():
    """The notebook's 384 against 192 with t = 2, and the same ratio with 4 and 8 ranks."""
    h, n = cutting.PAIR_WIDTH, cutting.PAIR_ROWS

    def sent(comm):
        hidden = np.ones((n, 4 * h // comm.size))  # this rank's slice of the n x 4h activation
        dist.all_gather(comm, hidden.ravel())
        gathered = comm.bytes_sent
        dist.ring_allreduce(comm, np.ones((n, h)))
        return gathered, comm.bytes_sent - gathered

    for ranks in (2, 4, 8):
        for gathered, summed in dist.simulate(ranks, sent):
            assert gathered == 2 * summed
    assert dist.simulate(2, sent)[0] == (384, 192)


def test_relu_of_a_sum_differs_from_the_sum_of_relus_exactly_where_signs_differ():
    p = np.array([[1.0, -1.0, 2.0, -2.0, 0.0], [-0.5, 0.5, 3.0, -3.0, 1.0]])
    relu = np.maximum
    differs = relu(p[0], 0) + relu(p[1], 0) != relu(p[0] + p[1], 0)
    assert list(differs) == list(p[0] * p[1] < 0)


def test_the_gpt_blocks_cut():
    def describe(comm):
        model = cutting.GPT(cutting.CONFIG, np.random.default_rng(0))
        cutting.parallelize_module(model, comm)
        return repr(model.layers[1])

    text = dist.simulate(2, describe)[0]
    assert "ColumnParallelLinear(64, 96 of 192" in text
    assert "ColumnParallelLinear(64, 128 of 256" in text
    assert cutting.BATCH_SIZE == 8 and cutting.CONFIG.dropout == 0.1


def test_the_losses():
    """What cell 9 prints: tp agrees with itself and with one process to 4 decimals, not to the
    bit (another BLAS kernel moves later digits, not these facts); pp's last stage is one process
    to the bit; the replicas' mean is to 4 decimals."""
    measured = runs()
    one = measured["one process"][0]["loss"]
    assert f"{one:.4f}" == "4.2051"
    tp = [r["loss"] for layout in ("tp 2", "tp 2 + sp") for r in measured[layout]]
    assert len(set(tp)) == 1 and tp[0] != one and f"{tp[0]:.4f}" == f"{one:.4f}"
    assert measured["pp 2"][0]["loss"] is None
    assert measured["pp 2"][1]["loss"] == one
    dp = [r["loss"] for r in measured["dp 2"]]
    # to 4 decimals: its last bits differ under Haswell, not under SandyBridge
    assert f"{np.mean(dp):.4f}" == f"{one:.4f}"


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
        assert 2 * r["kept_blocks"] == one[0]["kept_blocks"]
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
    senders = [sum(r["sent"].values()) for r in (dp[0], tp[0], sp[0], pp[0])]
    assert max(senders) == senders[0] and min(senders) == senders[-1]
    config = cutting.CONFIG
    assert cutting.BATCH_SIZE * config.context * config.width * 2 == 32_768


@functools.cache
def planned():
    model, cluster, job = cutting.planned()
    return model, cluster, job, best_plans(model, cluster, job)


def test_the_planner_prints_what_best_plans_finds(capsys):
    model, cluster, job, plans = planned()
    assert planner.main(cutting.PLANNER_ARGUMENTS) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[3:]]
    assert [row[12] for row in rows] == [f"{p.time.total:.2f}" for p in plans[:5]]
    assert [row[9] for row in rows] == [f"{p.memory.total / 2**30:.2f}" for p in plans[:5]]
    assert [int(row[2]) for row in rows] == [p.layout.tp for p in plans[:5]]
    assert (cluster.gpus, cluster.gpus_per_node, cluster.memory_bytes) == (1024, 8, 80 * 2**30)


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
    assert round(1e-9 / cluster.intra.network.beta) == 300
    assert round(1e-9 / cluster.inter.network.beta) == 25
    best = {tp: next(p for p in plans if p.layout.tp == tp) for tp in (1, 2, 4, 8)}
    lowest = {tp: min(p.layout.zero for p in plans if p.layout.tp == tp) for tp in (1, 2, 4, 8)}
    assert [f"{best[tp].time.total:.2f}" for tp in (1, 2, 4, 8)] == [
        "50.83", "40.70", "12.03", "11.77"]
    assert lowest == {1: 2, 2: 2, 4: 1, 8: 0}
    assert [f"{best[tp].time.zero_in_step:.2f}" for tp in (1, 2)] == ["22.19", "21.90"]
    for tp in (1, 2):
        assert best[tp].layout.zero == 2 and best[tp].layout.recompute
        assert cluster.gpus_per_node < best[tp].layout.tp * best[tp].layout.dp  # between nodes
    for tp in (4, 8):
        assert best[tp].layout.zero == 1 and not best[tp].layout.recompute
    assert cluster.memory_bytes == 80 * 2**30


def test_tensor_parallelism_over_infiniband():
    model, cluster, job, plans = planned()
    top = plans[0]
    layout = top.layout
    assert cluster.gpus_per_node == layout.tp == 8  # a group of 16 would span two nodes
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

    reference = solutions(12).RowParallel

    class RowParallelWithoutTheSum(Function):
        """Each rank keeps its partial output: g forgotten."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            return x @ weight.T

        backward = reference.backward

    class RowParallelAveraging(Function):
        """The partial sums averaged over the ranks, as data parallelism averages gradients."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            return reference.forward(ctx, x, weight, comm) / comm.size

        backward = reference.backward

    class RowParallelSummingBackward(Function):
        """An all-reduce in backward too: dL/dx_r belongs to this rank alone."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.comm = comm
            return reference.forward(ctx, x, weight, comm)

        @staticmethod
        def backward(ctx, grad_output):
            grad_x, grad_weight = reference.backward(ctx, grad_output)
            return all_reduce(ctx.comm, grad_x), grad_weight

    class RowParallelWithTheWeightGradientOfOneRow(Function):
        """dL/dW_r from the last sample only: the leading axes not summed."""

        forward = reference.forward

        @staticmethod
        def backward(ctx, grad_output):
            x, weight = ctx.saved_arrays
            return grad_output @ weight, grad_output[-1, -1][:, None] * x[-1, -1][None, :]

    class RowParallelWithTheTransposedWeightGradient(Function):
        """dL/dW_r as x_r^T grad_output: (in/t, out), the weight's transpose."""

        forward = reference.forward

        @staticmethod
        def backward(ctx, grad_output):
            x, weight = ctx.saved_arrays
            out, features = weight.shape
            grad_weight = x.reshape(-1, features).T @ grad_output.reshape(-1, out)
            return grad_output @ weight, grad_weight

    class RowParallelGatheringTheInput(Function):
        """The right numbers, but every rank's x_r travels too (a gather's bytes)."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            ctx.save_for_backward(x, weight)
            whole = all_reduce(comm, np.zeros((comm.size, *x.shape)))  # bytes of a gather
            return all_reduce(comm, x @ weight.T) + 0 * whole.sum()

        backward = reference.backward

    class RowParallelGatheringThePartialSums(Function):
        """Every rank gathers every partial sum and adds them itself: the right y, but an
        all-gather of t partial sums sends (t - 1) N, the ring all-reduce 2 (t - 1)/t N."""

        @staticmethod
        def forward(ctx, x, weight, comm):
            from minimp import distributed as dist

            ctx.save_for_backward(x, weight)
            partial = x @ weight.T
            every = dist.all_gather(comm, partial.ravel()).reshape(comm.size, *partial.shape)
            return every.sum(axis=0)

        backward = reference.backward

    return [RowParallelWithoutTheSum, RowParallelSummingBackward,
            RowParallelWithTheWeightGradientOfOneRow, RowParallelWithTheTransposedWeightGradient,
            RowParallelGatheringTheInput, RowParallelAveraging, RowParallelGatheringThePartialSums]


def reference_bytes(*args):
    return solutions(12).tp_bytes_sent(*args)


def tp_bytes_all_reduce_as_twice_the_array(blocks, b, s, h, tp, micro_batches, d, sp):
    """An all-reduce counted as 2 N, not 2 (t - 1)/t N: the reference's t = 2 bytes, doubled."""
    if tp == 1:
        return 0
    return 2 * reference_bytes(blocks, b, s, h, 2, micro_batches, d, sp)


def tp_bytes_forward_only(blocks, b, s, h, tp, micro_batches, d, sp):
    """Only g's two all-reduces a block: f's backward ones forgotten."""
    return reference_bytes(blocks, b, s, h, tp, micro_batches, d, sp) / 2


def tp_bytes_sequence_parallel_as_plain(blocks, b, s, h, tp, micro_batches, d, sp):
    """Sequence parallelism's blocks only: the head's gather and the partial gradients left out."""
    return reference_bytes(blocks, b, s, h, tp, micro_batches, d, False)


def tp_bytes_partial_gradients_in_compute_bytes(blocks, b, s, h, tp, micro_batches, d, sp):
    """The partial gradients all-reduced in d bytes an element, not float32's 4."""
    fraction, activation = (tp - 1) / tp, b * s * h * d
    halves = micro_batches * blocks * 8 * activation
    if sp:
        halves += micro_batches * 2 * activation + blocks * 6 * h * d * 2
    return halves * fraction


def tp_bytes_gathers_once_a_step(blocks, b, s, h, tp, micro_batches, d, sp):
    """The head's and the embeddings' gathers once a step, not once per micro-batch."""
    fraction, activation = (tp - 1) / tp, b * s * h * d
    halves = micro_batches * blocks * 8 * activation
    if sp:
        halves += 2 * activation + blocks * 6 * h * 4 * 2
    return halves * fraction


def tp_bytes_partial_gradients_every_micro_batch(blocks, b, s, h, tp, micro_batches, d, sp):
    """The partial gradients all-reduced in every micro-batch, not once a step."""
    fraction, activation = (tp - 1) / tp, b * s * h * d
    halves = micro_batches * blocks * 8 * activation
    if sp:
        halves += micro_batches * (2 * activation + blocks * 6 * h * 4 * 2)
    return halves * fraction


def tp_bytes_rows_as_positions(blocks, b, s, h, tp, micro_batches, d, sp):
    """micro_batch_size read as the rows b s of cell 2's n: the context counted twice."""
    return reference_bytes(blocks, b * s, s, h, tp, micro_batches, d, sp)


def tp_bytes_partial_gradients_of_the_layer_norms_only(blocks, b, s, h, tp, micro_batches, d,
                                                       sp):
    """Sequence parallelism's partial gradients of the 4 LayerNorm vectors a block, the 2
    row-parallel biases forgotten."""
    sent = reference_bytes(blocks, b, s, h, tp, micro_batches, d, sp)
    return sent - (blocks * 2 * h * 4 * 2 * (tp - 1) / tp if sp else 0)


def tp_bytes_sequence_gathers_as_all_reduces(blocks, b, s, h, tp, micro_batches, d, sp):
    """The head's gather and the embeddings' mirror each counted as an all-reduce, 2 (t - 1)/t
    of the activation, not (t - 1)/t."""
    sent = reference_bytes(blocks, b, s, h, tp, micro_batches, d, sp)
    return sent + (micro_batches * 2 * b * s * h * d * (tp - 1) / tp if sp else 0)


def tp_bytes_piece_by_piece(blocks, b, s, h, tp, micro_batches, d, sp):
    """Right: the same bytes added collective by collective, unrounded."""
    fraction, activation = (tp - 1) / tp, b * s * h * d
    sent = micro_batches * blocks * 4 * (2 * fraction * activation)
    if sp:
        sent += micro_batches * 2 * fraction * activation + 2 * fraction * blocks * 6 * h * 4
    return sent


def test_tp_bytes_sent_accepts_an_unrounded_sum_collective_by_collective():
    from minimp.lessons.lesson12 import check_tp_bytes_sent

    assert check_tp_bytes_sent(tp_bytes_piece_by_piece, quiet=True).passed


WRONG = {
    "check_row_parallel": [
        Wrong(lambda: row_parallel_functions()[0], "partial sum", factory=True),
        Wrong(lambda: row_parallel_functions()[1], "identity", factory=True),
        Wrong(lambda: row_parallel_functions()[2], "leading axis", factory=True),
        Wrong(lambda: row_parallel_functions()[3], "transpose", factory=True),
        Wrong(lambda: row_parallel_functions()[4], "one all-reduce of y", factory=True),
        Wrong(lambda: row_parallel_functions()[5], "not the mean", factory=True),
        Wrong(lambda: row_parallel_functions()[6], "ring all-reduce sends", factory=True),
    ],
    "check_tp_bytes_sent": [
        Wrong(tp_bytes_all_reduce_as_twice_the_array, "(t - 1)/t"),
        Wrong(tp_bytes_forward_only, "backward"),
        Wrong(tp_bytes_sequence_parallel_as_plain, "before the head"),
        Wrong(tp_bytes_partial_gradients_in_compute_bytes, "float32"),
        Wrong(tp_bytes_gathers_once_a_step, "per micro-batch"),
        Wrong(tp_bytes_partial_gradients_every_micro_batch, "once a step"),
        Wrong(tp_bytes_rows_as_positions, "b sequences of s positions"),
        Wrong(tp_bytes_partial_gradients_of_the_layer_norms_only, "6 h-vectors"),
        Wrong(tp_bytes_sequence_gathers_as_all_reduces, "(t - 1)/t b s h d each"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(12, WRONG)
