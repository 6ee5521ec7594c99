"""Lesson 11 (who holds what): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/11_who_holds_what.ipynb became false, or a checker passes a wrong answer."""

import functools
import json
import time

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor, nn, optim
from minimp import distributed as dist
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.data import load_shakespeare, text_batch
from minimp.lessons import processes
from minimp.models.gpt import GPT, GPTConfig, block_activation_bytes
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
)
from minimp.precision import NoLossScaler, mixed_precision_step
from minimp.tensor import saved_bytes
from minimp.train import TrainConfig, train
from minimp.train.sizes import zero_unit_sizes

# Stage 0 without overlap, as the lesson counts it (minimp/lessons/lesson11.py says why).
MLP = dict(hidden=256, layers=8, batch_size=64, steps=2, log_every=1000, threads=1, overlap=False)
UNITS = zero_unit_sizes(TrainConfig(**MLP))[0]
P, U = sum(UNITS), max(UNITS)


@functools.cache
def simulated(n, **flags):
    """Every rank's result of the lesson's 2-step run (cached: several tests read one run)."""
    config = TrainConfig(**{**MLP, **flags})
    return dist.simulate(n, lambda comm: train(config, log=lambda line: None, comm=comm))


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
    config = TrainConfig(**MLP)
    assert (config.dataset, config.precision, config.optimizer) == ("digits", "fp16", "adam")
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


def test_the_peak_inside_a_step():
    assert (2 * P, 2 * U, 4 * U) == (959_508, 131_584, 263_168)
    for n in (1, 2, 4):
        for stage, extra in enumerate((2 * P, 2 * P, 2 * U, 4 * U)):
            result = simulated(n, zero=stage)[0]
            assert result["peak_model_state_bytes"][0] - result["model_state_bytes"][0] == extra


@pytest.mark.mpi
def test_two_processes_hold_and_send_what_two_simulated_ranks_do(tmp_path):
    metrics = str(tmp_path / "zero3.jsonl")
    processes.run_job(2, ["-m", "minimp.train", "--hidden", "256", "--layers", "8",
                          "--batch-size", "64", "--steps", "2", "--log-every", "1000",
                          "--threads", "1", "--zero", "3", "--metrics", metrics])
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


def test_the_7_5_billion_parameter_model():
    def gigabytes(formula, n):
        return [f"{formula(stage, n) * 7.5:.1f}" for stage in range(4)]

    assert gigabytes(paper_per_parameter, 64) == ["120.0", "31.4", "16.6", "1.9"]
    assert gigabytes(per_parameter, 64) == ["135.0", "46.4", "16.9", "2.1"]
    assert gigabytes(paper_per_parameter, 1024)[2] == gigabytes(per_parameter, 1024)[2] == "15.1"
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
    small = dict(hidden=32, layers=2, batch_size=32, steps=10, log_every=1000, threads=1,
                 precision="fp32")

    def weights(n, **flags):
        config = TrainConfig(**small, **flags)
        runs = dist.simulate(n, lambda comm: train(config, log=lambda line: None, comm=comm))
        return runs[0]["master_weights"]

    for n, m in ((2, 1), (4, 2)):
        replicated = weights(n, micro_batches=m)
        for stage in (1, 2, 3):
            sharded = weights(n, micro_batches=m, zero=stage)
            same = all(sharded[k].tobytes() == replicated[k].tobytes() for k in sharded)
            worst = max(np.max(np.abs(sharded[k] - replicated[k])) / np.max(np.abs(replicated[k]))
                        for k in sharded)
            assert same if n == 2 else (not same and 0 < worst < 1e-6)


# ----- recomputation -----------------------------------------------------------------------------
S, B, H, A, LAYERS = 64, 8, 64, 4, 4


@functools.cache
def lesson_gpt():
    gpt = GPT(GPTConfig(vocab_size=65, context=S, layers=LAYERS, heads=A, width=H, dropout=0.1),
              np.random.default_rng(0)).to(np.float16)
    ids, targets = text_batch(load_shakespeare().train, seed=0, step=1, batch_size=B, context=S)
    gpt.set_dropout_state(seed=0, step=1, sample_indices=np.arange(B))
    return gpt, ids, targets


def gpt_forward(recompute):
    gpt, ids, targets = lesson_gpt()
    x = gpt[0](Tensor(ids))
    start = time.perf_counter()
    for block in gpt.layers[1:-1]:
        x = nn.recompute([block], x) if recompute else block(x)
    blocks = time.perf_counter() - start
    logits = gpt[-1](x)
    return F.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1)), blocks


def clear_gradients():
    for parameter in lesson_gpt()[0].parameters():
        parameter.grad = None


def gradients_after_backward(loss):
    loss.backward()
    grads = [p.grad.copy() for p in lesson_gpt()[0].parameters()]
    clear_gradients()
    return grads


def test_recomputation_keeps_each_block_s_input_and_gives_the_same_gradient_bits():
    weights = [p.data for p in lesson_gpt()[0].parameters()]
    block = block_activation_bytes(S, B, H, A, np.float16, dropout=True)
    assert 2 * S * B * H == 65_536
    assert block == 34 * S * B * H + 5 * A * S * S * B + 16 * S * B == 1_777_664
    kept, grads = {}, {}
    for recompute in (False, True):
        loss, _ = gpt_forward(recompute)
        kept[recompute] = saved_bytes(loss, exclude=weights)
        grads[recompute] = gradients_after_backward(loss)
    assert (kept[False], kept[True]) == (7_353_856, 505_344)
    assert kept[True] == kept[False] - LAYERS * (block - 2 * S * B * H)
    assert kept[True] < kept[False] / 14
    assert all(x.tobytes() == y.tobytes() for x, y in zip(grads[False], grads[True]))


def test_recomputation_costs_about_one_forward_of_the_blocks():
    """The fastest of 7 alternated rounds (another process slows whichever runs while it does)."""
    with limit_cpu_threads(1):
        times = {False: [], True: []}
        for _ in range(7):
            for recompute in (False, True):
                loss, blocks = gpt_forward(recompute)
                start = time.perf_counter()
                loss.backward()
                times[recompute].append((blocks, time.perf_counter() - start))
                clear_gradients()
    plain, again = np.min(times[False], axis=0), np.min(times[True], axis=0)
    assert 0.5 < (again[1] - plain[1]) / plain[0] < 1.6


def test_the_mlp_keeps_the_same_bytes_with_and_without_recomputation():
    peaks = [simulated(1, recompute=r)[0]["history"][-1]["peak_activation_bytes"]
             for r in (False, True)]
    assert peaks[0] == peaks[1] == 272_128


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


WRONG = {
    "check_bytes_held": [
        Wrong(held_with_fp16_gradients, ""),
        Wrong(held_with_even_chunks, ""),
        Wrong(held_with_a_gather_buffer_in_stage_3, ""),
        Wrong(held_with_buffers_on_one_rank, ""),
    ],
    "check_zero1_step": [
        Wrong(zero1_by_all_reduce, ""),
        Wrong(zero1_dividing_after, ""),
        Wrong(zero1_not_in_place, ""),
        Wrong(zero1_gathering_float32, ""),
    ],
    "check_bytes_sent": [
        Wrong(sent_on_average, ""),
        Wrong(sent_gathering_all_but_its_own, ""),
        Wrong(sent_reducing_stage_2_once, ""),
        Wrong(sent_gathering_stage_3_once, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(11, WRONG)
