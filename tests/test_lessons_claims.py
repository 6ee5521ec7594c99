"""Every number a lesson states, as a test (float16 facts the lessons share are in test_casting.py).
Each test names its lesson; a failure here means a sentence in that notebook became false."""

import functools
import math
import warnings

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from minimp import DynamicLossScaler, Tensor, mixed_precision_step, nn, no_grad, optim
from minimp.measure import costmodel
from minimp import distributed as dist
from minimp import functional as F
from minimp.backend import limit_cpu_threads
from minimp.distributed.headers import HEADER_BYTES
from minimp.data import global_batch_indices, load_digits, load_shakespeare, text_batch
from minimp.lessons import timelines
from minimp.lessons.lesson08 import recursive_doubling_time, ring_time
from minimp.models.gpt import GPT, GPTConfig, block_activation_bytes
from minimp.parallel import (
    DataParallel,
    ReplicaMismatchError,
    gpipe,
    one_f_one_b,
    peak_activations,
    shard,
    split_stages,
    stage_parameters,
)
from minimp.parallel.pipeline.schedules import build_schedule
from minimp.precision import SINGLE_PROCESS, NoLossScaler
from minimp.sample import generate
from minimp.tensor import saved_bytes
from minimp.train import TrainConfig, build_model, train

f16 = np.float16


# ----- lesson 1: floating point ----------------------------------------------------------------
def test_lesson1_the_formats_table():
    rows = {name: ml_dtypes.finfo(t) for name, t in
            (("fp32", np.float32), ("fp16", f16), ("bf16", ml_dtypes.bfloat16))}
    assert float(rows["fp16"].max) == 65504 == (2 - 2.0**-10) * 2.0**15
    attributes = ("smallest_normal", "smallest_subnormal", "eps")
    powers = {name: [math.log2(float(getattr(info, a))) for a in attributes]
              for name, info in rows.items()}
    assert powers == {"fp32": [-126, -149, -23], "fp16": [-14, -24, -10], "bf16": [-126, -133, -7]}
    assert [(info.nexp, info.nmant) for info in rows.values()] == [(8, 23), (5, 10), (8, 7)]


def test_lesson1_fp16_spans_12_decades_fp32_and_bf16_more_than_75():
    def decades(t):
        info = ml_dtypes.finfo(t)
        return math.log10(float(info.max) / float(info.smallest_subnormal))

    assert 12 <= decades(f16) < 13
    assert decades(np.float32) > 75 and decades(ml_dtypes.bfloat16) > 75


def test_lesson1_a_loss_of_2_times_2_to_the_16_is_inf_in_fp16():
    with np.errstate(over="ignore"):
        assert np.isinf(f16(2.0 * 2.0**16))


def test_lesson1_underflow_in_units_of_2_to_the_minus_24():
    cases = {2.0**-14: 1024, 2.0**-20: 16, 2.0**-24: 1, float(np.nextafter(2.0**-25, 1.0)): 1,
             2.0**-25: 0, 2.0**-26: 0, 3 * 2.0**-25: 2}
    for value, units in cases.items():
        assert float(f16(value)) == units * 2.0**-24


@given(st.floats(2.0**-25, 2.0**-24, exclude_min=True))
def test_lesson1_and_4_everything_above_2_to_the_minus_25_rounds_up_to_2_to_the_minus_24(value):
    assert float(f16(value)) == 2.0**-24


def test_lesson1_ties_to_even_2049_2051_2053():
    assert [float(f16(v)) for v in (2049, 2051, 2053)] == [2048, 2052, 2052]


def test_lesson1_running_sums_stall_where_numpys_float16_sum_does_not():
    ones = np.ones(3000, f16)
    running = f16(0)
    for one in ones:
        running = f16(running + one)
    assert float(running) == 2048 and float(np.cumsum(ones)[-1]) == 2048
    assert float(np.sum(ones)) == 3000


def test_lesson1_numpys_float16_sum_adds_in_float32_and_rounds_once_it_is_not_pairwise():
    """[2048] + [1] * 7 sums to 2055: a running fp16 sum gives 2048, a pairwise fp16 sum 2054
    ((2048 + 1) + (1 + 1)) + ((1 + 1) + (1 + 1)), the exact sum rounded once 2056."""

    def pairwise(values):
        if len(values) == 1:
            return values[0]
        half = len(values) // 2
        return f16(pairwise(values[:half]) + pairwise(values[half:]))

    eight = np.array([2048] + [1] * 7, f16)
    assert float(pairwise(list(eight))) == 2054
    assert float(np.sum(eight)) == 2056 == float(f16(2055))


def test_lesson1_the_accumulator_is_float32_not_float64():
    """2049 + 2^-20 needs 32 significant bits: float32 drops the 2^-20, and 2049 ties to 2048."""
    assert float(np.float32(2049 + 2.0**-20)) == 2049
    assert float(np.sum(np.array([2048, 1, 2.0**-20], f16))) == 2048
    assert float(f16(2049 + 2.0**-20)) == 2050


# ----- lesson 2: central differences ----------------------------------------------------------
def central_difference_error(h):
    """Lesson 2's f = sum(2x^3 + x) at x = (1, 2, 3): |central difference - 6x^2 - 1|, max."""
    x = np.array([1.0, 2.0, 3.0])

    def f(values):
        return float(np.sum(2 * values**3 + values))

    numerical = np.array([(f(x + h * e) - f(x - h * e)) / (2 * h) for e in np.eye(3)])
    return float(np.abs(numerical - (6 * x**2 + 1)).max()), f(x)


def test_lesson2_at_h_1e_minus_6_the_error_is_rounding_not_truncation():
    error, value = central_difference_error(1e-6)
    eps = np.finfo(np.float64).eps
    assert value == 78
    assert 100 * 2 * 1e-6**2 < error < eps * value / 1e-6  # far above 2h^2, below eps |f| / h


def test_lesson2_truncation_is_exactly_2h_squared_and_the_best_h_is_near_1_6e_minus_5():
    for h in (1e-1, 1e-2, 1e-3):
        assert central_difference_error(h)[0] == pytest.approx(2 * h**2, rel=1e-3)
    steps = np.logspace(-12, -1, 23)
    errors = [central_difference_error(h)[0] for h in steps]
    assert 1e-6 <= steps[int(np.argmin(errors))] <= 1e-4
    assert (3 * np.finfo(np.float64).eps * 78 / 12) ** (1 / 3) == pytest.approx(1.6e-5, rel=0.05)


def test_lesson2_the_gradient_check_tolerance_it_quotes():
    import inspect

    import gradcheck

    source = inspect.getsource(gradcheck)
    assert inspect.signature(gradcheck.numerical_gradient).parameters["epsilon"].default == 1e-6
    assert "rtol=1e-5, atol=1e-7" in source


# ----- lesson 3: mixed precision -----------------------------------------------------------------
def lesson3_mlp(dtype):
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(64, 256, rng=rng), nn.ReLU(), nn.Linear(256, 256, rng=rng),
                         nn.ReLU(), nn.Linear(256, 10, rng=rng)).to(dtype)


def test_lesson3_bytes_kept_for_backward_and_why_not_exactly_half():
    digits = load_digits()
    kept = {}
    for dtype in (np.float32, f16):
        net = lesson3_mlp(dtype)
        loss = F.cross_entropy(net(Tensor(digits.train_images[:128].astype(dtype))),
                               digits.train_labels[:128])
        kept[dtype] = saved_bytes(loss, exclude=[p.data for p in net.parameters()])
    assert (kept[np.float32], kept[f16]) == (301_056, 151_040)
    targets = 128 * np.dtype(digits.train_labels.dtype).itemsize
    assert targets == 1024 and kept[np.float32] - targets == 2 * (kept[f16] - targets)


def test_lesson3_model_to_casts_in_place_so_a_sequential_of_its_layers_is_no_copy():
    model = lesson3_mlp(np.float32)
    nn.Sequential(*[layer for layer in model]).to(f16)
    assert model[0].weight.dtype == f16


def test_lesson3_the_update_of_2_to_the_minus_12_at_1_is_a_tie_to_even():
    assert float(np.spacing(f16(1 - 2.0**-11))) == 2.0**-11  # below 1.0 the gap is 2^-11 ...
    assert float(np.spacing(f16(1))) == 2.0**-10
    assert float(f16(1 - 2.0**-12)) == 1.0  # ... so 1 - 2^-12 is halfway, and goes to 1.0
    assert np.array(1.0, f16).view(np.uint16) & 0x3FF == 0  # 1.0's mantissa: all 0
    assert np.array(1 - 2.0**-11, f16).view(np.uint16) & 0x3FF == 0x3FF  # the other's: all 1


def test_lesson3_the_copy_of_the_master_moves_from_the_second_update():
    master, copies = np.float32(1.0), []
    for _ in range(1000):
        master = np.float32(master - np.float32(2.0**-12))
        copies.append(float(f16(master)))
    assert copies[0] == 1.0 and copies[1] < 1.0
    assert float(master) == 0.755859375 == copies[-1] == 1 - 1000 * 2.0**-12


# ----- lesson 4: loss scaling ----------------------------------------------------------------
def lesson4_mlp():
    rng = np.random.default_rng(0)
    return nn.Sequential(nn.Linear(64, 128, rng=rng), nn.ReLU(), nn.Linear(128, 128, rng=rng),
                         nn.ReLU(), nn.Linear(128, 10, rng=rng))


def activation_gradients(loss_factor):
    digits, model = load_digits(), lesson4_mlp()
    inputs, outputs, h = [], [], Tensor(digits.train_images[:256])
    for layer in model:
        leaf = Tensor(h.data, requires_grad=True)
        h = layer(leaf)
        inputs.append(leaf)
        outputs.append(h)
    (F.cross_entropy(h, digits.train_labels[:256]) * loss_factor).backward()
    for i in range(len(model) - 2, -1, -1):
        outputs[i].backward(inputs[i + 1].grad)
    grads = np.concatenate([leaf.grad.ravel() for leaf in inputs[1:]])
    return np.abs(grads[grads != 0])


def test_lesson4_where_float16_puts_the_activation_gradients():
    plain, tiny = activation_gradients(1.0), activation_gradients(2.0**-16)
    stored = plain.astype(f16)
    assert 0 < np.mean(stored == 0) < 0.0005  # "a few (0.011%)"
    assert np.mean((stored > 0) & (stored < 2**-14)) > 1 / 3  # "more than a third"
    assert plain.max() < 2.0**-10  # "none reaches 2^-10"
    assert np.all(tiny.astype(f16) == 0)  # "every one of them becomes zero"
    scaled = (plain * 2.0**16).astype(f16)
    assert np.all(scaled >= 2**-14) and plain.max() * 2.0**16 < 2.0**6  # normal, room below 65504
    assert np.array_equal(tiny * 2.0**16, plain)  # the divided loss, scaled: the plain one exactly


def lesson4_train(dtype, scaler, make_optimizer, loss_factor=2.0**-16, steps=120):
    digits, model = load_digits(), lesson4_mlp()
    optimizer = make_optimizer(model.parameters())
    model.to(dtype)
    images, labels, losses = digits.train_images.astype(dtype), digits.train_labels, []
    with np.errstate(over="ignore"), limit_cpu_threads(1):
        for step in range(steps):
            rows = np.random.default_rng([0, step]).choice(len(labels), 256, replace=False)
            loss = F.cross_entropy(model(Tensor(images[rows])), labels[rows])
            losses.append(loss.item())
            scaler.scale(loss * loss_factor).backward()
            mixed_precision_step(optimizer, scaler)
    return losses[0], float(np.mean(losses[-10:]))


def test_lesson4_adam_three_curves_together_one_flat_and_eps_costs_a_little():
    def adam(parameters):
        return optim.Adam(parameters, lr=1e-3)

    fp32 = lesson4_train(np.float32, NoLossScaler(), adam)[1]
    first, unscaled = lesson4_train(f16, NoLossScaler(), adam)
    assert unscaled > 0.95 * first  # learns nothing
    assert lesson4_train(f16, DynamicLossScaler(), adam)[1] == pytest.approx(fp32, abs=0.01)
    bf16 = lesson4_train(ml_dtypes.bfloat16, NoLossScaler(), adam)[1]
    assert bf16 == pytest.approx(fp32, abs=0.01)
    plain = lesson4_train(np.float32, NoLossScaler(), adam, loss_factor=1.0)[1]
    assert plain < fp32 - 0.05  # "the division is not quite free" (0.168 against 0.256)


def test_lesson4_sgd_needs_lr_times_2_to_the_16_then_the_scaler_matches_fp32():
    def sgd(lr):
        return lambda parameters: optim.SGD(parameters, lr=lr, momentum=0.9)

    first, same_lr = lesson4_train(np.float32, NoLossScaler(), sgd(0.1), steps=60)
    assert same_lr > 0.95 * first  # does not learn at all
    fp32 = lesson4_train(np.float32, NoLossScaler(), sgd(0.1 * 2**16), steps=60)[1]
    assert fp32 < 0.5
    first, unscaled = lesson4_train(f16, NoLossScaler(), sgd(0.1 * 2**16), steps=60)
    assert unscaled > first  # "ends above where it started"
    scaled = lesson4_train(f16, DynamicLossScaler(), sgd(0.1 * 2**16), steps=60)[1]
    assert scaled == pytest.approx(fp32, abs=0.01)


def weight_gradients(dtype, loss_factor):
    digits, model = load_digits(), lesson4_mlp()
    model.to(dtype)
    rows = np.random.default_rng([0, 0]).choice(len(digits.train_labels), 256, replace=False)
    logits = model(Tensor(digits.train_images[rows].astype(dtype)))
    (F.cross_entropy(logits, digits.train_labels[rows]) * loss_factor).backward()
    return np.concatenate([p.grad.ravel() for p in model.parameters()])


def test_lesson4_almost_every_gradient_flushes_and_adams_sqrt_v_comes_near_eps():
    assert np.mean(weight_gradients(f16, 2.0**-16) == 0) > 0.95
    magnitudes = np.abs(weight_gradients(np.float32, 2.0**-16))
    assert np.median(magnitudes[magnitudes > 0]) < 100 * 1e-8  # Adam's eps


def test_lesson4_sgd_with_lr_times_2_to_the_16_on_the_loss_over_2_to_the_16_takes_the_same_steps():
    def run(lr, loss_factor):
        model, digits = lesson4_mlp(), load_digits()
        optimizer, losses = optim.SGD(model.parameters(), lr=lr, momentum=0.9), []
        for step in range(5):
            rows = np.random.default_rng([0, step]).choice(len(digits.train_labels), 256, False)
            logits = model(Tensor(digits.train_images[rows]))
            loss = F.cross_entropy(logits, digits.train_labels[rows])
            losses.append(loss.item())
            (loss * loss_factor).backward()
            mixed_precision_step(optimizer, NoLossScaler())
        return losses

    assert run(0.1, 1.0) == run(0.1 * 2**16, 2.0**-16)


def test_lesson4_the_scaler_trace_an_injected_and_a_real_overflow():
    config = TrainConfig(steps=200, loss_scale_growth_interval=50, inject_overflow="40:0",
                         log_every=1000, threads=1)
    history = train(config, log=lambda line: None)["history"]
    assert [(r["step"], r["loss_scale"]) for r in history if r["skipped"]] == [
        (40, 65536.0), (151, 131072.0)]
    grown = [r["step"] for a, r in zip(history, history[1:]) if r["loss_scale"] > a["loss_scale"]]
    assert grown == [91, 141] and history[41]["loss_scale"] == 32768.0
    assert history[-1]["loss_scale"] == 65536.0


# ----- lesson 5: the ring --------------------------------------------------------------------
def test_lesson5_bytes_per_rank_ring_and_naive():
    big = [np.ones(1_000_000, np.float32) for _ in range(4)]
    expected = {"ring": [6_000_000] * 4, "naive": [12_000_000] + [4_000_000] * 3}
    for algorithm, sent in expected.items():
        def reduce(comm):
            return dist.allreduce(comm, big[comm.rank], algorithm=algorithm)

        trace = dist.simulate(4, reduce).trace
        assert [sum(m.nbytes for m in trace if m.source == r) for r in range(4)] == sent


def test_lesson5_send_then_receive_works_eagerly_and_deadlocks_past_the_eager_limit():
    def naive_ring(comm, length):
        outgoing, incoming = np.ones(length, np.float32), np.empty(length, np.float32)
        comm.send(outgoing, (comm.rank + 1) % comm.size)
        comm.recv(incoming, (comm.rank - 1) % comm.size)
        return incoming

    assert dist.simulate(4, naive_ring, 100)[0][0] == 1
    with pytest.raises(dist.DeadlockError):
        dist.simulate(4, naive_ring, 100_000)


# ----- lesson 6: data parallelism ------------------------------------------------------------
def test_lesson6_replicas_train_what_one_process_trains_up_to_float32_rounding():
    def run(world_size):
        config = TrainConfig(hidden=32, layers=2, batch_size=32, steps=20, precision="fp32",
                             log_every=1000)
        def rank(comm):
            return train(config, log=lambda line: None, comm=comm)

        return dist.simulate(world_size, rank)[0]["master_weights"]

    one = run(1)
    for world_size in (2, 4):
        many = run(world_size)
        worst = max(np.abs(many[k] - one[k]).max() / np.abs(one[k]).max() for k in one)
        assert 0 < worst < 1e-6


def test_lesson6_numpy_errstate_is_per_thread_so_each_rank_sets_its_own():
    def overflow(comm):
        return np.float32(1e5).astype(f16)

    def overflow_quietly(comm):
        with np.errstate(over="ignore"):
            return overflow(comm)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with np.errstate(over="ignore"):  # the caller's thread only
            dist.simulate(2, overflow)
        loud = len(caught)
        dist.simulate(2, overflow_quietly)
        assert loud > 0 and len(caught) == loud


def test_lesson6_the_check_catches_one_bit_and_a_skip_is_one_decision():
    def one_bit_off(comm):
        replicas = DataParallel(comm, optim.SGD([nn.Parameter(np.ones(4, np.float32))], lr=0.1))
        if comm.rank == 2:
            master = replicas.optimizer.master_weights[0]
            master[0] = np.nextafter(master[0], np.float32(2))
        with pytest.raises(ReplicaMismatchError, match=r"\[2\]"):
            replicas.check_replicas()

    dist.simulate(4, one_bit_off)
    config = TrainConfig(hidden=32, layers=2, batch_size=32, steps=8, inject_overflow="5:2",
                         check_replicas=1, log_every=1000)
    results = dist.simulate(4, lambda comm: train(config, log=lambda line: None, comm=comm))
    for result in results:
        assert [r["step"] for r in result["history"] if r["skipped"]] == [5]
        assert [r["loss_scale"] for r in result["history"]] == [65536.0] * 5 + [32768.0] * 3


# ----- lesson 7: pipelines -------------------------------------------------------------------
@pytest.mark.parametrize("name", ["1f1b", "gpipe"])
def test_lesson7_the_step_takes_m_plus_p_minus_1_slots_for_both_schedules(name):
    for P in range(1, 7):
        for M in range(1, 9):
            for forward, backward in ((1.0, 2.0), (1.0, 1.0), (2.0, 1.0)):
                step, busy = timelines.replay(build_schedule(name, P, M), forward, backward)
                assert step == pytest.approx((M + P - 1) * (forward + backward))
                assert all(b == pytest.approx(M * (forward + backward)) for b in busy)


def test_lesson7_peak_activations_gpipe_m_1f1b_p_minus_stage():
    for M in (4, 8, 16):
        assert [peak_activations(a) for a in gpipe(4, M)] == [M] * 4
        assert [peak_activations(a) for a in one_f_one_b(4, M)] == [4, 3, 2, 1]


@given(st.lists(st.floats(0.1, 10.0), min_size=4, max_size=4), st.integers(1, 8))
def test_lesson7_two_stages_the_last_slower_both_ways_only_add_to_the_bubble(times, M):
    """(Not for any unequal stages: a slower first stage can shrink the bubble.)"""
    forward, backward = sorted(times[:2]), sorted(times[2:])
    formula = costmodel.pipeline_bubble_fraction(2, M)
    for schedule in (gpipe(2, M), one_f_one_b(2, M)):
        assert timelines.replayed_bubble(schedule, forward, backward) >= formula - 1e-12


def test_lesson7_a_slower_first_stage_can_shrink_the_bubble():
    bubble = timelines.replayed_bubble(one_f_one_b(2, 2), [1.0, 1.0], [3.0, 2.0])
    assert bubble < costmodel.pipeline_bubble_fraction(2, 2)


def test_lesson7_the_split_of_the_timeline_model():
    model = build_model(64, 10, 512, 8, np.random.default_rng(0))
    stages = split_stages(model.layers, 2)
    shapes = [[tuple(p.shape) for layer in model.layers[a:b] for p in layer.parameters()
               if p.ndim == 2] for a, b in stages]
    assert shapes == [[(512, 64)] + [(512, 512)] * 3, [(512, 512)] * 4 + [(10, 512)]]


@pytest.mark.mpi
def test_lesson7_the_measured_bubble_is_larger_than_the_formula():
    timeline = timelines.measure(2, 4, "gpipe")
    forward, backward = timelines.compute_times(timeline)
    formula = costmodel.pipeline_bubble_fraction(2, 4)
    assert timelines.replayed_bubble(gpipe(2, 4), forward, backward) >= formula
    assert timelines.bubble(timeline) > formula


# ----- lesson 8: the cost model's formulas, as derived ----------------------------------------
NETWORK = costmodel.Network(alpha=15e-6, beta=1 / 8.7e9, gamma=1 / 12.9e9)


@pytest.mark.parametrize("p", [2, 3, 4, 6, 8, 64, 1000, 1024])
def test_lesson8_derives_the_formulas_minimp_costmodel_uses(p):
    """If costmodel changes a formula, lesson 8's derivation must change with it."""
    a, b, g, n = NETWORK.alpha, NETWORK.beta, NETWORK.gamma, 2.0**20
    rounds, floor_rounds = math.ceil(math.log2(p)), math.floor(math.log2(p))
    fold = 0.0 if p & (p - 1) == 0 else 2 * (a + n * b) + n * g
    derived = {
        "ring": ring_time(n, p, a, b, g),
        "naive": 2 * (p - 1) * (a + n * b) + (p - 1) * n * g,
        "binomial_tree": 2 * rounds * (a + n * b) + rounds * n * g,
        "recursive_doubling": floor_rounds * (a + n * b + n * g) + fold,
        "rabenseifner": 2 * math.log2(p) * a + 2 * (p - 1) / p * n * b + (p - 1) / p * n * g,
    }
    for name, value in derived.items():
        assert costmodel.allreduce_time(name, n, p, NETWORK) == pytest.approx(value), name
    if fold == 0:
        doubling = recursive_doubling_time(n, p, a, b, g)
        assert doubling == pytest.approx(derived["recursive_doubling"])


def test_lesson8_nine_times_p_minus_1_micro_batches_for_a_10_percent_bubble():
    for P in (2, 4, 8, 16, 64):
        assert costmodel.pipeline_bubble_fraction(P, 9 * (P - 1)) == pytest.approx(0.1)
        assert costmodel.pipeline_bubble_fraction(P, 9 * (P - 1) - 1) > 0.1


def test_lesson8_the_trace_holds_what_the_formulas_count():
    array = np.ones(8 * 1024, np.float32)
    for algorithm, messages, arrays in (("ring", 14, 1.75), ("recursive_doubling", 3, 3.0)):
        trace = dist.simulate(8, lambda c: dist.allreduce(c, array, algorithm=algorithm)).trace
        sent = [m for m in trace if m.source == 0]
        # checked recursive doubling's messages each begin with the sender's layout (headers.py)
        headers = HEADER_BYTES * messages if algorithm == "recursive_doubling" else 0
        assert len(sent) == messages
        assert (sum(m.nbytes for m in sent) - headers) / array.nbytes == arrays


# ----- lesson 9: myths -------------------------------------------------------------------------
def test_lesson9_significant_bits_11_against_24():
    assert np.finfo(f16).nmant + 1 == 11 and np.finfo(np.float32).nmant + 1 == 24


def one_step(comm):
    """Lesson 9's measured step: bytes held by kind, and bytes sent, on this rank."""
    digits = load_digits()
    model = build_model(64, 10, 128, 4, np.random.default_rng(0))
    optimizer = optim.Adam(model.parameters())
    model.to(f16)
    replicas = DataParallel(comm, optimizer) if comm.size > 1 else None
    if replicas:
        replicas.broadcast_parameters()
    before = comm.bytes_sent
    rows = shard(global_batch_indices(0, 1, 256, len(digits.train_labels)), comm.rank, comm.size)
    scaler = DynamicLossScaler()
    logits = model(Tensor(digits.train_images[rows].astype(f16)))
    scaler.scale(F.cross_entropy(logits, digits.train_labels[rows])).backward()
    mixed_precision_step(optimizer, scaler, sync=replicas or SINGLE_PROCESS)
    held = [sum(p.data.nbytes for p in model.parameters()),
            sum(m.nbytes for m in optimizer.master_weights),
            sum(s.nbytes for slot in optimizer.slots for s in slot.values()),
            sum(a.nbytes + b.nbytes for a, b in replicas.buffers) if replicas else 0]
    return held, comm.bytes_sent - before


def test_lesson9_a_replica_holds_what_one_process_holds_plus_its_buffers_and_sends_1_5_gradients():
    parameters = 59_146
    (single, sent_alone), = dist.simulate(1, one_step)
    assert single == [2 * parameters, 4 * parameters, 8 * parameters, 0] and sent_alone == 0
    assert 8 * parameters / (2 * parameters) == 4 and (4 + 8) / 2 == 6  # the optimizer: 6x
    for held, sent in dist.simulate(4, one_step):
        assert held == single[:3] + [2 * 4 * parameters]
        assert abs(sent - 1.5 * 4 * parameters) <= 4 * 4  # ranks differ by a chunk's element


def test_lesson9_what_dp_and_pp_send_and_hold():
    model = build_model(64, 10, 128, 4, np.random.default_rng(0))
    bounds = split_stages(model.layers, 4)
    per_stage = [sum(p.size for _, p in stage_parameters(model, b)) for b in bounds]
    assert per_stage == [8320, 16512, 16512, 17802] and sum(per_stage) == 59_146

    def sent(**flags):
        config = TrainConfig(steps=2, log_every=1000, **flags)
        results = dist.simulate(4, lambda comm: train(config, log=lambda line: None, comm=comm))
        return [r["history"][-1]["bytes_sent"] for r in results]

    assert np.mean(sent(dp=4)) == 1.5 * 4 * 59_146
    cut = 64 * 128 * 2  # the batch's activations, float16, one way across one cut
    assert sent(pp=4) == [cut, 2 * cut, 2 * cut, cut]


# ----- lesson 10: mixed precision meets attention ---------------------------------------------
LESSON10 = GPTConfig(vocab_size=65, context=32, layers=2, heads=4, width=64)
CAUSAL = np.tri(32, dtype=bool)


def lesson10_loss(model, ids, targets):
    logits = model(Tensor(ids))
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


@functools.cache
def lesson10_training():
    """Lesson 10's 200 float32 steps: (the trained weights, the losses, the two samples)."""
    data = load_shakespeare()
    model = GPT(LESSON10, np.random.default_rng(0))
    optimizer, losses, samples = optim.AdamW(model.parameters(), lr=3e-3), [], []
    with limit_cpu_threads(1):
        for step in range(1, 201):
            if step == 1:
                samples.append(data.decode(generate(model.eval(), data.encode("ROMEO:"), 160,
                                                    0.8, 0, 0)))
                model.train()
            ids, targets = text_batch(data.train, seed=0, step=step, batch_size=16, context=32)
            loss = lesson10_loss(model, ids, targets)
            loss.backward()
            mixed_precision_step(optimizer, NoLossScaler())
            losses.append(loss.item())
        samples.append(data.decode(generate(model.eval(), data.encode("ROMEO:"), 160, 0.8, 0, 0)))
    return model.state_dict(), losses, samples


def lesson10_model(dtype=np.float32):
    model = GPT(LESSON10, np.random.default_rng(0))
    model.load_state_dict(lesson10_training()[0])
    return model.to(dtype)


def lesson10_batch():
    return text_batch(load_shakespeare().validation, seed=1, step=1, batch_size=64, context=32)


def lesson10_records(model, ids):
    """The notebook's recorded forward: the logits and, per block, its named intermediate
    Tensors (input, ln_1's output, q.k unscaled, the softmax, the MLP's hidden layer)."""
    x, records = model[0](ids), []
    for block in model.layers[1:-1]:
        attn, record = block.attn, {"residual stream": x}
        h = record["ln_1 output"] = block.ln_1(x)
        q, k, v = F.split(attn.c_attn(h), 64, axis=2)
        q, k, v = (t.reshape(-1, 32, 4, 16).transpose(0, 2, 1, 3) for t in (q, k, v))
        scores = record["q.k"] = q @ k.transpose(0, 1, 3, 2)
        record["softmax"] = F.scaled_masked_softmax(scores, 1 / 4)
        y = (record["softmax"] @ v).transpose(0, 2, 1, 3).reshape(-1, 32, 64)
        x = x + attn.c_proj(y)
        hidden = record["mlp hidden"] = block.mlp.c_fc(block.ln_2(x))
        x = x + block.mlp.c_proj(block.mlp.gelu(hidden))
        records.append(record)
    return model[-1](x), records


def flat(array):
    return (array[..., CAUSAL] if array.ndim == 4 else array).ravel()


def float16_shares(array):
    """(zero, subnormal) shares of the non-zero values once stored in float16."""
    stored = np.abs(array[array != 0]).astype(f16)
    return np.mean(stored == 0), np.mean((stored > 0) & (stored < 2**-14))


def test_lesson10_the_loss_falls_from_ln_65_to_about_2_5_below_the_unigram_3_31():
    _, losses, _ = lesson10_training()
    assert abs(losses[0] - math.log(65)) < 0.05 and round(math.log(65), 2) == 4.17
    assert 2.4 < np.mean(losses[-20:]) < 2.6
    frequencies = np.bincount(load_shakespeare().train, minlength=65) / 1_003_854
    assert round(-np.sum(frequencies * np.log(frequencies)), 2) == 3.31


def test_lesson10_the_text_before_is_noise_after_it_has_lines_spaces_and_a_few_words():
    before, after = lesson10_training()[2]
    train = load_shakespeare().train
    space = np.mean(train == load_shakespeare().vocabulary.index(" "))
    assert before.count(" ") / len(before) < 0.05
    assert abs(after.count(" ") / len(after) - space) < 0.06 and after.count("\n") >= 3
    words = {"the", "and", "he", "are", "art", "my", "to", "of", "a", "i", "me", "is"}
    assert len(words & set(after.lower().split())) >= 3
    assert not words & set(before.lower().split())


def test_lesson10_the_recorded_forward_is_the_models_and_where_the_activations_lie():
    model, (ids, _) = lesson10_model(), lesson10_batch()
    logits, records = lesson10_records(model, ids)
    with no_grad():
        assert np.array_equal(logits.data, model(Tensor(ids)).data)
    largest = [{name: float(np.abs(flat(t.data)).max()) for name, t in r.items()} for r in records]
    assert round(largest[0]["residual stream"], 2) == 0.34
    assert round(largest[1]["residual stream"], 1) == 5.5
    assert round(largest[1]["q.k"]) == 68 and 9.5 < math.log2(65504 / largest[1]["q.k"]) < 10
    logit = float(np.max(flat(records[1]["q.k"].data)) / 4)
    assert round(logit) == 17 and logit > math.log(65504) and round(math.log(65504), 2) == 11.09
    assert all(float(np.max(flat(r["q.k"].data))) / 4 < math.log(65504) for r in records[:1])
    assert 0.015 < float16_shares(flat(records[1]["softmax"].data))[0] < 0.025
    assert all(np.isfinite(t.data.astype(f16)).all() for r in records for t in r.values())


def lesson10_unfused(scores, scale, keep, shift):
    dtype = scores.dtype.type
    logits = np.where(keep, scores * dtype(scale), dtype(-np.inf))
    if shift:
        logits = logits - logits.max(axis=-1, keepdims=True)
    exps = np.exp(logits)
    return exps / exps.sum(axis=-1, keepdims=True), exps


def lesson10_scores16():
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    return records[1]["q.k"].data.astype(f16)


def row_ulps(probabilities, exact):
    gaps = np.spacing(np.abs(exact).astype(f16)).astype(np.float64)
    return np.max(np.abs(probabilities.astype(np.float64) - exact) / gaps, axis=-1)


def test_lesson10_the_textbook_float16_softmax_breaks_2_percent_of_rows_two_ways():
    from minimp.lessons.lesson10 import exact_softmax

    scores16 = lesson10_scores16()
    exact = exact_softmax(scores16, 1 / 4)
    row_max = np.max(np.where(CAUSAL, scores16.astype(np.float32) / 4, -np.inf), axis=-1)
    with np.errstate(over="ignore", invalid="ignore"):
        textbook, exps = lesson10_unfused(scores16, 1 / 4, CAUSAL, shift=False)
        shifted, _ = lesson10_unfused(scores16, 1 / 4, CAUSAL, shift=True)
    nan_rows, zero_rows = np.isnan(textbook).any(axis=-1), (textbook == 0).all(axis=-1)
    assert nan_rows.sum() > 0 and zero_rows.sum() > 0
    assert 0.015 < np.mean(nan_rows | zero_rows) < 0.03  # "about 2%"
    assert np.all(np.isinf(exps).any(axis=-1) == nan_rows)  # NaN: an exp overflowed
    with np.errstate(over="ignore"):
        sums = exps.sum(axis=-1)
    assert not np.isinf(exps[zero_rows]).any() and np.isinf(sums[zero_rows]).all()
    errors = np.where(nan_rows | zero_rows, -1, row_ulps(textbook, exact))
    worst = np.unravel_index(np.argmax(errors), errors.shape)
    assert row_max[worst] < math.log(2.0**-14) and round(math.log(2.0**-14), 2) == -9.70
    assert float(np.exp(np.float32(math.log(2.0**-14) - 0.01)).astype(f16)) < 2**-14
    assert not np.isnan(shifted).any() and 3 < row_ulps(shifted, exact).max() < 20  # "several"
    assert shifted.shape[-1] == 32  # "the sum at most 32"
    fused = F.scaled_masked_softmax(Tensor(scores16), 1 / 4).data
    assert 0.5 <= row_ulps(fused, exact).max() < 0.50025  # "within 0.5002 ulps"


def test_lesson10_a_padded_row_is_nan_unfused_in_fp16_and_bf16_and_zero_fused():
    scores16, padding = lesson10_scores16(), np.arange(32) >= 4
    with np.errstate(over="ignore", invalid="ignore"):
        assert np.isneginf(f16(-1e9))
        unfused, _ = lesson10_unfused(scores16, 1 / 4, CAUSAL & padding, shift=True)
        for dtype in (f16, ml_dtypes.bfloat16):
            assert np.isnan(np.float32(dtype(-np.inf) - dtype(-np.inf)))
    assert np.isnan(unfused).any(axis=-1).sum() == 1024 == 64 * 4 * 4
    scores = Tensor(scores16, requires_grad=True)
    fused = F.scaled_masked_softmax(scores, 1 / 4, mask=padding)
    assert not np.isnan(fused.data).any() and np.all(fused.data[..., :4, :] == 0)
    fused.backward(np.ones_like(scores16))
    assert np.all(scores.grad[..., :4, :] == 0)


def test_lesson10_a_power_of_two_scale_rounds_nothing_above_the_subnormals_1_over_sqrt_48_does():
    scores16 = lesson10_scores16()
    quarter = (scores16 * f16(0.25)).astype(np.float64)
    exact = scores16.astype(np.float64) / 4
    normal = np.abs(exact) >= 2**-14
    assert np.array_equal(quarter[normal], exact[normal])
    with np.errstate(under="ignore"):
        scale = 1 / math.sqrt(48)
        twice = (scores16 * f16(scale)).astype(np.float64)
        once = (scores16.astype(np.float64) * scale).astype(f16).astype(np.float64)
    assert not np.array_equal(twice, once)


def lesson10_layer_norm_float16(x):
    width = f16(x.shape[-1])
    mean = np.cumsum(x, axis=-1, dtype=f16)[..., -1:] / width
    centered = x - mean
    variance = np.cumsum(centered * centered, axis=-1, dtype=f16)[..., -1:] / width
    return centered / np.sqrt(variance + f16(1e-5)), variance


def test_lesson10_float16_layer_norm_statistics_six_times_the_error_then_overflow_at_16x():
    with np.errstate(over="ignore"):
        assert np.isfinite(f16(255.875) * f16(255.875)) and np.isinf(f16(256) * f16(256))
    assert 65504 / 64 == 1023.5 and round(math.sqrt(1023.5)) == 32
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    residual = records[1]["residual stream"].data
    plain = nn.LayerNorm(64).to(f16)
    results = {}
    for k in (0, 2, 4, 5):
        x16 = (residual * 2.0**k).astype(f16)
        x64 = x16.astype(np.float64)
        centered = x64 - x64.mean(axis=-1, keepdims=True)
        exact = centered / np.sqrt((centered**2).mean(axis=-1, keepdims=True) + 1e-5)
        with np.errstate(over="ignore", invalid="ignore"):
            naive, variance = lesson10_layer_norm_float16(x16)
        with no_grad():
            ours = plain(Tensor(x16)).data
        overflowed = np.isinf(variance[..., 0])
        assert np.all(naive[overflowed] == 0)  # x / inf: the whole row zero
        results[k] = (np.mean(overflowed), np.abs(naive - exact).max(), np.abs(ours - exact).max())
    assert results[0][0] == results[2][0] == 0 and 5.5 < results[0][1] / results[0][2] < 6.5
    assert all(2**-10 - 1e-6 < ours <= 2**-10 * 1.001 for _, _, ours in results.values())
    assert float(np.spacing(f16(2))) == 2**-9 and round(2**-10, 4) == 0.0010
    assert 0.04 < results[4][0] < 0.08 and results[5][0] > 0.95


def lesson10_gradients():
    model, (ids, targets) = lesson10_model(), lesson10_batch()
    logits, records = lesson10_records(model, ids)
    gradients = [{} for _ in records]
    for record, store in zip(records, gradients):
        for name, tensor in record.items():
            tensor.register_hook(lambda grad, store=store, name=name: store.update({name: grad}))
    F.cross_entropy(logits.reshape(-1, 65), targets.reshape(-1)).backward()
    return gradients


def test_lesson10_the_activation_gradients_against_float16_and_bf16():
    gradients = lesson10_gradients()
    every = np.concatenate([flat(g) for store in gradients for g in store.values()])
    zero, subnormal = float16_shares(every)
    assert 0.04 < zero < 0.06 and 0.8 < subnormal < 0.9  # "most", "about 5%"
    assert 0.35 < float16_shares(flat(gradients[1]["q.k"]))[0] < 0.45  # "about 40%"
    assert every.size == 2 * (64 * 32 * (64 + 64 + 256) + 64 * 4 * 528 * 2)  # what was hooked
    zero, subnormal = float16_shares(every * 2.0**16)
    assert DynamicLossScaler().loss_scale == 2**16
    assert 0.005 < zero + subnormal < 0.02 and round(np.abs(every).max() * 2**16) == 313
    nonzero = every[every != 0]

    def median_error(values, dtype):
        stored = values.astype(dtype).astype(np.float64)
        return np.median(np.abs(stored - values) / np.abs(values))

    assert np.all(nonzero.astype(ml_dtypes.bfloat16) != 0)
    assert median_error(nonzero, ml_dtypes.bfloat16) < median_error(nonzero, f16)
    scaled = median_error(nonzero * 2.0**16, f16)
    assert 6 < median_error(nonzero, ml_dtypes.bfloat16) / scaled < 10  # "about eight times"


def test_lesson10_bf16_scores_lose_precision_not_range_and_the_three_losses():
    _, records = lesson10_records(lesson10_model(), lesson10_batch()[0])
    scores32 = records[1]["q.k"].data
    truth = F.scaled_masked_softmax(Tensor(scores32), 1 / 4).data
    errors, broken = {}, {}
    with np.errstate(over="ignore", invalid="ignore"):
        for dtype in (f16, ml_dtypes.bfloat16):
            rounded = scores32.astype(dtype)
            fused = F.scaled_masked_softmax(Tensor(rounded), 1 / 4).data.astype(np.float32)
            errors[dtype] = np.abs(fused - truth).max()
            unfused, _ = lesson10_unfused(rounded, 1 / 4, CAUSAL, shift=False)
            broken[dtype] = np.mean(np.isnan(unfused).any(axis=-1) | (unfused == 0).all(axis=-1))
    assert broken[ml_dtypes.bfloat16] == 0 and broken[f16] > 0
    assert 4 < errors[ml_dtypes.bfloat16] / errors[f16] < 7  # "about five times"
    assert round(math.log(float(ml_dtypes.finfo(ml_dtypes.bfloat16).max)), 1) == 88.7
    ids, targets = lesson10_batch()
    with no_grad(), limit_cpu_threads(1):  # the notebook's one BLAS thread
        losses = {d: lesson10_loss(lesson10_model(d).eval(), ids, targets).item()
                  for d in (np.float32, f16, ml_dtypes.bfloat16)}
    moved = {d: abs(losses[d] - losses[np.float32]) for d in (f16, ml_dtypes.bfloat16)}
    assert all(1e-5 < m < 1e-4 for m in moved.values())  # "both ... in the fifth decimal"
    assert moved[f16] < moved[ml_dtypes.bfloat16]  # "bf16 the more"


def test_lesson10_one_block_keeps_what_the_formula_says_korthikanti_plus_16sb():
    s, b, h, a = 32, 16, 64, 4
    measured = {}
    for dropout in (0.0, 0.1):
        for dtype in (np.float32, f16):
            config = GPTConfig(vocab_size=65, context=s, layers=1, heads=a, width=h,
                               dropout=dropout)
            model = GPT(config, np.random.default_rng(0)).to(dtype)
            model.set_dropout_state(seed=0, step=1, sample_indices=np.arange(b))
            x = Tensor(np.random.default_rng(1).standard_normal((b, s, h)).astype(dtype),
                       requires_grad=True)
            kept = saved_bytes(model[1](x), exclude=[p.data for p in model.parameters()])
            assert kept == block_activation_bytes(s, b, h, a, dtype, dropout > 0)
            measured[dtype, dropout] = kept
    assert measured[f16, 0.1] == 34 * s * b * h + 5 * a * s * s * b + 16 * s * b
    assert 16 * s * b == 8192 and measured[np.float32, 0.1] < 2 * measured[f16, 0.1]
    ratios = [5 * a * s / h for s, h, a in ((32, 64, 4), (256, 384, 6), (1024, 768, 12))]
    assert ratios == [10, 20, 80]


def test_lesson10_a_samples_keep_mask_is_the_same_on_a_shard():
    from minimp.ops.dropout import keep_mask

    whole = keep_mask((8, 32, 64), 0.1, seed=0, step=1, layer=2, sample_indices=range(8))
    shard = keep_mask((4, 32, 64), 0.1, seed=0, step=1, layer=2, sample_indices=range(4, 8))
    assert np.array_equal(whole[4:], shard) and abs(whole.mean() - 0.9) < 0.01
