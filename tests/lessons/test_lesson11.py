"""Lesson 11 (who holds what): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/11_who_holds_what.ipynb became false, or a checker passes a wrong answer."""

import json

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import distributed as dist
from minimp import nn, optim
from minimp.lessons import processes
from minimp.lessons.lesson11 import (
    GPT_SHAPE,
    MLP,
    SAME_TRAINING,
    backward_extra,
    block_forwards_in_backward,
    command_line,
    final_weights,
    gpt_forward,
    lesson_gpt,
    mlp_config,
    mlp_units,
    recompute_times,
    simulated,
)
from minimp.models.gpt import block_activation_bytes
from minimp.parallel import (
    DataParallel,
    Unit,
    ZeroLayout,
    zero_data_parallel,
)
from minimp.parallel.zero.formulas import (
    bytes_sent_formula,
    memory_formula,
    paper_per_parameter,
    per_parameter,
    peak_formula,
)
from minimp.precision import NoLossScaler, mixed_precision_step
from minimp.tensor import saved_bytes

# The lesson's own runs: minimp/lessons/lesson11.py's MLP (overlap off; it says why), cached there.
UNITS = mlp_units()
P, U = sum(UNITS), max(UNITS)


def held(n, stage, rank=0):
    return simulated(n, zero=stage)[0]["model_state_by_kind"][rank]


# ----- the seam, the layout -------------------------------------------------------------------
def test_the_all_reduce_is_its_two_halves_bit_for_bit_and_byte_for_byte():
    gradients = np.random.default_rng(0).standard_normal((4, 1003)).astype(np.float32)

    def halves(comm):
        x, start = gradients[comm.rank], comm.bytes_sent
        whole = dist.ring_allreduce(comm, x)
        middle = comm.bytes_sent
        mine = dist.reduce_scatter(comm, x)
        return whole, dist.all_gather(comm, mine, x.size), mine.size, middle - start, (
            comm.bytes_sent - middle)

    results = dist.simulate(4, halves)
    assert [r[2] for r in results] == [251, 251, 251, 250]
    for whole, rebuilt, _, sent_whole, sent_halves in results:
        assert whole.tobytes() == rebuilt.tobytes() and sent_whole == sent_halves


def test_stage_1_sends_the_same_messages_smaller_and_holds_a_quarter_of_the_optimizer():
    def step(comm, zero):
        parameter = nn.Parameter(np.ones(1003, np.float32))
        optimizer = optim.SGD([parameter], lr=0.1)
        parameter.data = parameter.data.astype(np.float16)
        sync = zero_data_parallel(1, optimizer, [], comm) if zero else DataParallel(comm, optimizer)
        parameter.grad = np.ones(1003, np.float16)
        mixed_precision_step(sync.optimizer, NoLossScaler(), sync=sync)

    replicated, sharded = (dist.simulate(4, step, zero).trace for zero in (False, True))
    assert sorted((m.source, m.dest) for m in replicated) == sorted(
        (m.source, m.dest) for m in sharded)  # the threads' order varies, not the messages'
    assert len(sharded) == 4 * 2 * 3
    assert sum(m.nbytes for m in sharded) == 3 / 4 * sum(m.nbytes for m in replicated)
    optimizer = [held(4, stage)["masters"] + held(4, stage)["optimizer_state"] for stage in (0, 1)]
    assert optimizer[1] / optimizer[0] == pytest.approx(1 / 4, rel=1e-5)


def test_the_layout_example_and_the_mlp_s_units():
    layouts = [ZeroLayout([Unit((0, 1), (6, 3))], rank, 2) for rank in range(2)]
    assert [layout.chunk(0) for layout in layouts] == [(0, 5), (5, 9)]
    pieces = [[(p.index, p.start, p.stop) for p in layout.pieces[0]] for layout in layouts]
    assert pieces == [[(0, 0, 5)], [(0, 5, 6), (1, 0, 3)]]
    config = mlp_config()
    assert (config.dataset, config.precision, config.optimizer) == ("digits", "fp16", "adam")
    assert (config.hidden, config.layers, config.overlap) == (256, 8, False) == (
        MLP["hidden"], MLP["layers"], MLP["overlap"])
    assert len(UNITS) == 9 and P == 479_754 and UNITS[-1] == 2570
    assert all(size % 4 == 0 for size in UNITS[:-1])
    assert [b - a for a, b in dist.chunk_bounds(2570, 4)] == [643, 643, 642, 642]


# ----- what each rank holds ------------------------------------------------------------------
@pytest.mark.parametrize("n", [1, 2, 4])
def test_every_rank_every_kind_equals_the_formula_and_nothing_16_bit_is_held(n):
    for stage in range(4):
        expected = [memory_formula(stage, unit_sizes=UNITS, rank=rank, world_size=n,
                                   compute_bytes=2, wire_bytes=4, slots=2) for rank in range(n)]
        kinds = simulated(n, zero=stage)[0]["model_state_by_kind"]
        assert kinds == expected
        assert all(k["gradients"] == 0 and k["gathered"] == 0 for k in kinds)


def test_the_kinds_as_the_lesson_lists_them():
    shard = sum(b - a for a, b in (dist.chunk_bounds(size, 4)[0] for size in UNITS))
    assert shard == 119_939 == P / 4 + 0.5
    for stage in range(4):
        kinds = held(4, stage)
        assert kinds["parameters"] == 2 * (shard if stage == 3 else P)
        assert kinds["accumulators"] == 4 * (shard if stage >= 2 else P)
        assert kinds["masters"] == 4 * (shard if stage >= 1 else P)
        assert kinds["optimizer_state"] == 8 * (shard if stage >= 1 else P)
    buffers = [held(4, stage)["buffers"] for stage in range(4)]
    assert buffers == [8 * P, 10 * U, 10 * U, 8 * U] == [3_838_032, 657_920, 657_920, 526_336]
    assert held(4, 0)["optimizer_state"] == 3_838_032
    assert all(held(1, stage)["buffers"] == 0 for stage in range(4))


def test_the_totals_the_lesson_quotes():
    assert [sum(held(1, stage).values()) for stage in range(4)] == [8_635_572] * 4 == [18 * P] * 4
    assert sum(held(4, 3).values()) == 2_685_238 and sum(held(4, 0).values()) == 12_473_604


def test_the_peak_inside_a_step_on_every_rank():
    assert (2 * P, 2 * U, 4 * U) == (959_508, 131_584, 263_168)
    for n in (1, 2, 4):
        for stage, extra in enumerate((2 * P, 2 * P, 2 * U, 4 * U)):
            assert peak_formula(stage, unit_sizes=UNITS, compute_bytes=2) == extra
            result = simulated(n, zero=stage)[0]
            peaks, kept = result["peak_model_state_bytes"], result["model_state_bytes"]
            assert [top - held for top, held in zip(peaks, kept)] == [extra] * n


@pytest.mark.mpi
def test_two_processes_hold_and_send_what_two_simulated_ranks_do(tmp_path):
    metrics = str(tmp_path / "zero3.jsonl")
    arguments = command_line(zero=3)
    assert "--no-overlap" in arguments and "--zero" in arguments
    processes.run_job(2, [*arguments, "--metrics", metrics])
    rows = [json.loads(line) for line in open(metrics)]
    ranks = simulated(2, zero=3)
    assert rows[-1]["model_state_by_kind"] == ranks[0]["model_state_by_kind"]
    assert rows[-2]["bytes_sent"] == ranks[0]["history"][-1]["bytes_sent"] == 1_919_016


# ----- per parameter, and 7.5 billion of them ---------------------------------------------------
def test_per_parameter_measured_minimp_and_the_paper():
    for stage, (ours, paper) in enumerate(((18, 16), (9, 7), (6, 5.5), (4.5, 4))):
        kinds = held(4, stage)
        assert round((sum(kinds.values()) - kinds["buffers"]) / P, 4) == ours
        assert per_parameter(stage, 4) == ours and paper_per_parameter(stage, 4) == paper
    for n in (1, 2, 3, 8, 64):
        assert [per_parameter(s, n) for s in range(4)] == [18, 6 + 12 / n, 2 + 16 / n, 18 / n]
        assert [paper_per_parameter(s, n) for s in range(4)] == [16, 4 + 12 / n, 2 + 14 / n,
                                                                  16 / n]
        differences = [per_parameter(s, n) - paper_per_parameter(s, n) for s in range(4)]
        assert differences == pytest.approx([2, 2, 2 / n, 2 / n])


def test_the_7_5_billion_parameter_model_of_docs_zero_md():
    def gigabytes(formula, n):
        return [f"{formula(stage, n) * 7.5:.1f}" for stage in range(4)]

    assert gigabytes(paper_per_parameter, 64) == ["120.0", "31.4", "16.6", "1.9"]
    assert gigabytes(per_parameter, 64) == ["135.0", "46.4", "16.9", "2.1"]
    assert gigabytes(paper_per_parameter, 1024) == ["120.0", "30.1", "15.1", "0.1"]
    assert gigabytes(per_parameter, 1024) == ["135.0", "45.1", "15.1", "0.1"]
    assert gigabytes(paper_per_parameter, 8) == ["120.0", "41.2", "28.1", "15.0"]
    assert gigabytes(per_parameter, 8) == ["135.0", "56.2", "30.0", "16.9"]


# ----- the price in bytes sent -------------------------------------------------------------------
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("m", [1, 2])
def test_bytes_sent_in_units_of_n_minus_1_over_n_p(n, m):
    unit = (n - 1) / n * P
    expected_bytes = [8, 6, 4 * m + 2, 8 * m]
    expected_elements = [2, 2, m + 1, 3 * m]
    for stage in range(4):
        ranks = simulated(n, zero=stage, micro_batches=m)
        rows = [r["history"][-1] for r in ranks]
        sent = [row["bytes_sent"] for row in rows]
        sizes = [P] if stage == 0 else UNITS
        assert sent == [sum(bytes_sent_formula(stage, sizes=sizes, rank=rank, world_size=n,
                                               micro_batches=m, compute_bytes=2,
                                               wire_bytes=4).values()) for rank in range(n)]
        assert np.mean(sent) == expected_bytes[stage] * unit  # exact, averaged over the ranks
        by = [row["bytes_by_collective"] for row in rows]
        elements = [b.get("all_reduce", 0) / 4 + b.get("reduce_scatter", 0) / 4
                    + b.get("all_gather", 0) / 2 for b in by]
        assert np.mean(elements) == expected_elements[stage] * unit
        assert all(s == sum(b.values()) for s, b in zip(sent, by))  # no scalar in the bytes
        assert all(row["scalar_allreduces"] > 0 for row in rows)


def test_stage_3_sends_stage_0_s_bytes_rank_by_rank():
    sent = [[r["history"][-1]["bytes_sent"] for r in simulated(4, zero=stage)] for stage in (0, 3)]
    assert sent[0] == sent[1] == [2_878_520, 2_878_524, 2_878_528, 2_878_524]


# ----- the same training ---------------------------------------------------------------------
def test_two_replicas_end_on_zero_0_s_bits_four_differ_by_less_than_a_millionth():
    assert (SAME_TRAINING["hidden"], SAME_TRAINING["layers"], SAME_TRAINING["steps"]) == (32, 2, 10)
    assert SAME_TRAINING["precision"] == "fp32"
    for n, m in ((2, 1), (4, 2)):
        replicated = final_weights(n, micro_batches=m)
        for stage in (1, 2, 3):
            sharded = final_weights(n, micro_batches=m, zero=stage)
            same = all(sharded[k].tobytes() == replicated[k].tobytes() for k in sharded)
            worst = max(np.max(np.abs(sharded[k] - replicated[k])) / np.max(np.abs(replicated[k]))
                        for k in sharded)
            assert same if n == 2 else (not same and 0 < worst < 1e-6)


# ----- recomputation -----------------------------------------------------------------------------
def test_recomputation_keeps_each_block_s_input_and_gives_the_same_gradient_bits():
    s, b, h, a, layers = (GPT_SHAPE[key] for key in ("s", "b", "h", "a", "layers"))
    assert (s, b, h, a, layers) == (64, 8, 64, 4, 4)
    gpt, ids, targets = lesson_gpt()
    weights = [p.data for p in gpt.parameters()]
    block = block_activation_bytes(s, b, h, a, np.float16, dropout=True)
    assert 2 * s * b * h == 65_536
    assert block == 34 * s * b * h + 5 * a * s * s * b + 16 * s * b == 1_777_664
    kept, grads = {}, {}
    for recompute in (False, True):
        loss, _ = gpt_forward(gpt, ids, targets, recompute)
        kept[recompute] = saved_bytes(loss, exclude=weights)
        loss.backward()
        grads[recompute] = [p.grad.copy() for p in gpt.parameters()]
        for parameter in gpt.parameters():
            parameter.grad = None
    assert (kept[False], kept[True]) == (7_353_856, 505_344)
    assert kept[True] == kept[False] - layers * (block - 2 * s * b * h)
    assert kept[True] < kept[False] / 14 and f"{kept[False] / kept[True]:.1f}" == "14.6"
    assert all(x.tobytes() == y.tobytes() for x, y in zip(grads[False], grads[True]))


def test_backward_reruns_each_block_s_forward_once():
    gpt, ids, targets = lesson_gpt()
    assert [block_forwards_in_backward(gpt, ids, targets, r) for r in (False, True)] == [0, 4]


def test_recomputation_costs_about_one_forward_of_the_blocks():
    """The lesson's own measurement: the fastest of 7 alternated rounds, in CPU time."""
    assert 0.7 < backward_extra(recompute_times(*lesson_gpt())) < 1.5


def test_the_mlp_keeps_the_same_bytes_with_and_without_recomputation():
    peaks = [simulated(1, recompute=r)[0]["history"][-1]["peak_activation_bytes"]
             for r in (False, True)]
    assert peaks[0] == peaks[1] == 204_096


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def held_with_fp16_gradients(stage, unit_sizes, rank, world_size):
    """The paper's count: 2-byte gradients where minimp keeps float32 accumulators."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    return {**held, "accumulators": held["accumulators"] // 2}


def held_with_even_chunks(stage, unit_sizes, rank, world_size):
    """P // N elements on every rank, where the ring's cut gives some ranks one more."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    exact = sum(solutions(11).chunk(size, rank, world_size) for size in unit_sizes)
    even = sum(unit_sizes) // world_size
    first_sharded = {"masters": 1, "optimizer_state": 1, "accumulators": 2, "parameters": 3}
    per_element = {"masters": 4, "optimizer_state": 8, "accumulators": 4, "parameters": 2}
    for kind, first in first_sharded.items():
        if stage >= first:
            held[kind] += per_element[kind] * (even - exact)
    return held


def held_with_a_gather_buffer_in_stage_3(stage, unit_sizes, rank, world_size):
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    if stage == 3 and world_size > 1:
        held["buffers"] += 2 * max(unit_sizes)
    return held


def held_with_buffers_on_one_rank(stage, unit_sizes, rank, world_size):
    """Wire buffers where there is no wire."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    if world_size == 1:
        held["buffers"] = 2 * 4 * (sum(unit_sizes) if stage == 0 else max(unit_sizes))
    return held


def held_without_the_gather_buffer(stage, unit_sizes, rank, world_size):
    """Stages 1-2 with send and receive buffers only: the fp16 buffer the all-gather fills is
    forgotten."""
    held = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    if stage in (1, 2) and world_size > 1:
        held["buffers"] -= 2 * max(unit_sizes)
    return held


def held_sharding_one_stage_early(stage, unit_sizes, rank, world_size):
    """Stage 1 sharding the accumulators too (stage 2's), stage 2 the compute copy (stage 3's)."""
    right = solutions(11).bytes_held(stage, unit_sizes, rank, world_size)
    later = solutions(11).bytes_held(min(stage + 1, 3), unit_sizes, rank, world_size)
    return {**later, "buffers": right["buffers"]}


def zero1_dividing_in_float64(comm, weights, master, grad, lr):
    """The mean of a float64 array: 8 bytes an element on the wire, and other bits at N = 3."""
    mean = dist.reduce_scatter(comm, grad.astype(np.float64) / comm.size)
    master -= lr * mean
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_gathering_without_the_length(comm, weights, master, grad, lr):
    """all_gather's length left to its default, p * chunk.size: wrong where chunks are uneven."""
    master -= lr * dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    return dist.all_gather(comm, master.astype(weights.dtype))


def zero1_by_all_reduce(comm, weights, master, grad, lr):
    """The right bits, but the whole mean arrives everywhere before the update."""
    mean = dist.ring_allreduce(comm, grad * np.float32(1 / comm.size))
    start, stop = dist.chunk_bounds(weights.size, comm.size)[comm.rank]
    master -= lr * mean[start:stop]
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_dividing_after(comm, weights, master, grad, lr):
    mean = dist.reduce_scatter(comm, grad) / np.float32(comm.size)
    master -= lr * mean
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_not_in_place(comm, weights, master, grad, lr):
    mean = dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    master = master - lr * mean  # a new array: the caller's master never moves
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_gathering_float32(comm, weights, master, grad, lr):
    master -= lr * dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    return dist.all_gather(comm, master, weights.size).astype(weights.dtype)


def sent_on_average(stage, unit_sizes, rank, world_size, micro_batches):
    """The formula averaged over the ranks: not any rank's own bytes where chunks are uneven."""
    per_element = [8, 6, 4 * micro_batches + 2, 8 * micro_batches][stage]
    return per_element * (world_size - 1) / world_size * sum(unit_sizes)


def sent_gathering_all_but_its_own(stage, unit_sizes, rank, world_size, micro_batches):
    """An all-gather that sends every chunk but the rank's own (the ring sends its own first)."""
    if world_size == 1:
        return 0
    sizes = [sum(unit_sizes)] if stage == 0 else unit_sizes
    own = sum(size - solutions(11).chunk(size, rank, world_size) for size in sizes)
    factor = [(4, 4), (4, 2), (4 * micro_batches, 2), (4 * micro_batches, 4 * micro_batches)]
    return factor[stage][0] * own + factor[stage][1] * own


def sent_reducing_stage_2_once(stage, unit_sizes, rank, world_size, micro_batches):
    return solutions(11).bytes_sent(stage, unit_sizes, rank, world_size,
                                    1 if stage == 2 else micro_batches)


def sent_gathering_stage_3_once(stage, unit_sizes, rank, world_size, micro_batches):
    """Stage 3 without the gather before backward."""
    if stage < 3:
        return solutions(11).bytes_sent(stage, unit_sizes, rank, world_size, micro_batches)
    once = solutions(11).bytes_sent(1, unit_sizes, rank, world_size, 1)
    return micro_batches * once



def sent_gathering_float32_weights(stage, unit_sizes, rank, world_size, micro_batches):
    """Stages 1-2 all-gathering 4-byte weights (the float32 masters) instead of the fp16 copy."""
    sent = solutions(11).bytes_sent(stage, unit_sizes, rank, world_size, micro_batches)
    if stage in (1, 2) and world_size > 1:
        right = (rank + 1) % world_size
        sent += 2 * sum(size - solutions(11).chunk(size, right, world_size) for size in unit_sizes)
    return sent


def zero1_dividing_before(comm, weights, master, grad, lr):
    """The other mean the spec allows: grad / N (x / 3 and x * float32(1/3) differ in some bits)."""
    master -= lr * dist.reduce_scatter(comm, grad / comm.size)
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_scaling_by_a_python_float(comm, weights, master, grad, lr):
    master -= lr * dist.reduce_scatter(comm, grad * (1 / comm.size))  # a float32 product
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_reducing_float16(comm, weights, master, grad, lr):
    """Half the bytes on the wire: the scaled gradient rounded to float16 before the ring."""
    scaled = (grad * np.float32(1 / comm.size)).astype(np.float16)
    master -= lr * dist.reduce_scatter(comm, scaled)
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_updating_the_fp16_copy(comm, weights, master, grad, lr):
    """The update applied to this rank's slice of the fp16 compute copy: the master never moves."""
    start, stop = dist.chunk_bounds(weights.size, comm.size)[comm.rank]
    mean = dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    return dist.all_gather(comm, (weights[start:stop] - lr * mean).astype(np.float16), weights.size)


def zero1_updating_in_float64(comm, weights, master, grad, lr):
    """lr as a NumPy float64: the product lr * chunk is float64, rounded once more by -=."""
    master -= np.float64(lr) * dist.reduce_scatter(comm, grad * np.float32(1 / comm.size))
    return dist.all_gather(comm, master.astype(weights.dtype), weights.size)


def zero1_returning_in_place(comm, weights, master, grad, lr):
    """Right: another spelling, the caller's arrays filled in place and returned."""
    np.subtract(master, dist.reduce_scatter(comm, grad / np.float32(comm.size)) * lr, out=master)
    weights[:] = dist.all_gather(comm, master.astype(np.float16), weights.size)
    return weights


@pytest.mark.parametrize("zero1_step", [zero1_returning_in_place, zero1_dividing_before,
                                        zero1_scaling_by_a_python_float])
def test_zero1_step_accepts_each_mean_the_spec_allows(zero1_step):
    from minimp.lessons.lesson11 import check_zero1_step

    assert check_zero1_step(zero1_step, quiet=True).passed


def test_the_two_means_differ_at_n_3_so_the_checker_tells_them_apart():
    grad = np.random.default_rng(4).standard_normal(1001).astype(np.float32)
    assert np.any(grad / 3 != grad * np.float32(1 / 3))


WRONG = {
    "check_bytes_held": [
        Wrong(held_with_fp16_gradients, "fp32 accumulators"),
        Wrong(held_with_even_chunks, "P // N"),
        Wrong(held_with_a_gather_buffer_in_stage_3, "no all-gather buffer"),
        Wrong(held_with_buffers_on_one_rank, "none on one rank"),
        Wrong(held_without_the_gather_buffer, "fp16 all-gather buffer"),
        Wrong(held_sharding_one_stage_early, "the accumulators from stage 2"),
    ],
    "check_zero1_step": [
        Wrong(zero1_by_all_reduce, "all-reduce"),
        Wrong(zero1_dividing_after, "before the reduce-scatter"),
        Wrong(zero1_not_in_place, "in place"),
        Wrong(zero1_gathering_float32, "float16 weights"),
        Wrong(zero1_dividing_in_float64, "float32 gradient"),
        Wrong(zero1_gathering_without_the_length, "pass the length"),
        Wrong(zero1_reducing_float16, "float32 reduce-scatter"),
        Wrong(zero1_updating_the_fp16_copy, "master -="),
        Wrong(zero1_updating_in_float64, "float32 product"),
    ],
    "check_bytes_sent": [
        Wrong(sent_on_average, "not the average"),
        Wrong(sent_gathering_all_but_its_own, "right neighbour"),
        Wrong(sent_reducing_stage_2_once, "every micro-batch"),
        Wrong(sent_gathering_stage_3_once, "again before its backward"),
        Wrong(sent_gathering_float32_weights, "fp16"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(11, WRONG)
