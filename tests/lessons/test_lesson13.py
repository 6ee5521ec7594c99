"""Lesson 13 (shrinking the bubble): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/13_shrinking_the_bubble.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import Tensor, nn
from minimp.lessons import timelines
from minimp.lessons.lesson13 import (
    CHUNKS,
    RUN_MICRO_BATCHES,
    RUN_STAGES,
    RUN_STEPS,
    M,
    P,
    computes,
    equal_costs,
    messages,
)
from minimp.parallel import (
    Action,
    format_schedule,
    one_f_one_b,
    peak_activations,
    simulate_schedule,
)
from minimp.parallel.pipeline.schedules import CHOICES, build_schedule
from minimp.split_backward import backward_input, backward_weight


def simulated(name, stages=P, micro_batches=M):
    V = CHUNKS[name]
    return simulate_schedule(build_schedule(name, stages, micro_batches, V), equal_costs(V))


def test_the_lessons_configuration():
    assert (P, M) == (4, 8) and CHUNKS == {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1}
    assert (RUN_STAGES, RUN_MICRO_BATCHES, RUN_STEPS) == (2, 4, 3)


def test_f3c1_names_micro_batch_3_on_chunk_1():
    text = format_schedule(build_schedule("interleaved", P, M, 2))
    assert "F3c1" in text and "B3c1" in text and "W" not in text
    assert "W0" in format_schedule(build_schedule("zb-h1", P, M))


def test_the_bubbles_steps_and_idle_times_at_p4_m8():
    steps = {name: simulated(name) for name in CHUNKS}
    assert steps["gpipe"].span == steps["1f1b"].span == 33
    assert steps["interleaved"].span == 28.5 and steps["zb-h1"].span == 27
    assert round(steps["1f1b"].bubble, 4) == 0.2727
    assert round(steps["interleaved"].bubble, 4) == 0.1579
    assert round(steps["zb-h1"].bubble, 4) == 0.1111
    idle = {name: [step.span - busy for busy in step.busy] for name, step in steps.items()}
    assert idle == {"gpipe": [9.0] * 4, "1f1b": [9.0] * 4, "interleaved": [4.5] * 4,
                    "zb-h1": [3.0] * 4}
    for name, step in steps.items():
        assert step.bubble == pytest.approx(CHOICES[name].bubble(P, M, CHUNKS[name]), abs=1e-12)


def test_the_formulas_agree_to_rounding_at_p_2_4_8_and_m_p_2p_4p():
    for stages in (2, 4, 8):
        for micro_batches in (stages, 2 * stages, 4 * stages):
            for name, V in CHUNKS.items():
                formula = CHOICES[name].bubble(stages, micro_batches, V)
                assert abs(simulated(name, stages, micro_batches).bubble - formula) < 1e-12


def test_interleaving_idles_a_vth_of_the_fill_and_drain():
    t_f, t_b = 1.0, 2.0
    for stages, micro_batches, V in ((4, 8, 2), (2, 4, 2), (4, 8, 4), (3, 6, 3)):
        step = simulate_schedule(build_schedule("interleaved", stages, micro_batches, V),
                                 equal_costs(V))
        idle = [step.span - busy for busy in step.busy]
        assert idle == pytest.approx([(stages - 1) * (t_f + t_b) / V] * stages)


def test_interleaving_sends_2_pv_minus_1_m_messages_of_one_micro_batch():
    counts = {name: messages(build_schedule(name, P, M, V)) for name, V in CHUNKS.items()}
    assert counts == {"gpipe": 48, "1f1b": 48, "interleaved": 112, "zb-h1": 48}
    assert 112 == 2 * (4 * 2 - 1) * 8 and 48 == 2 * (P - 1) * M and 112 / 48 == 7 / 3
    for stages, micro_batches, V in ((2, 4, 2), (4, 8, 3), (3, 6, 4)):
        schedule = build_schedule("interleaved", stages, micro_batches, V)
        assert messages(schedule) == 2 * (stages * V - 1) * micro_batches
        # each message carries one micro-batch's tensor, one (micro-batch, chunk) each way
        sends = [(rank, a.op, a.micro_batch, a.chunk) for rank, actions in enumerate(schedule)
                 for a in actions if a.op.startswith("send")]
        assert len(set(sends)) == len(sends)


def test_the_warm_up_and_the_forwards_before_the_first_backward_are_the_peaks():
    """Megatron-LM's warm-up, 2 (P - r - 1) + (V - 1) P, then one forward before the first
    backward: the peak of stored pairs, at every P, M, V the exercise checks (M = P: all)."""
    for stages, micro_batches, V in ((4, 8, 2), (2, 4, 2), (3, 6, 2), (2, 8, 4), (4, 4, 2)):
        schedule = build_schedule("interleaved", stages, micro_batches, V)
        for rank, actions in enumerate(schedule):
            ops = [a.op for a in actions if a.op in ("forward", "backward")]
            warmup = 2 * (stages - rank - 1) + (V - 1) * stages
            want = micro_batches * V if micro_batches == stages else warmup + 1
            assert ops.index("backward") == want == peak_activations(actions)
    assert [2 * (P - r - 1) + P for r in range(P)] == [10, 8, 6, 4] and 11 / 2 == 5.5


def test_at_p2_m4_interleaving_runs_16_computes_per_rank_and_sends_24_messages():
    counts = {name: computes(build_schedule(name, RUN_STAGES, RUN_MICRO_BATCHES, V))
              for name, V in CHUNKS.items()}
    assert counts == {"gpipe": [8, 8], "1f1b": [8, 8], "interleaved": [16, 16],
                      "zb-h1": [12, 12]}
    sent = {name: messages(build_schedule(name, RUN_STAGES, RUN_MICRO_BATCHES, V))
            for name, V in CHUNKS.items()}
    assert sent == {"gpipe": 8, "1f1b": 8, "interleaved": 24, "zb-h1": 8}


def test_zb_h1_stores_min_p_m_on_every_stage():
    for stages in (2, 3, 4, 5):
        for micro_batches in range(1, 12):
            schedule = build_schedule("zb-h1", stages, micro_batches, 1)
            peaks = [peak_activations(actions) for actions in schedule]
            assert peaks == [min(stages, micro_batches)] * stages


def test_zb_h1_runs_stage_i_s_w_i_micro_batches_late():
    """W(m) on stage i right after B(m + i), or in the drain once no B is left."""
    for stages, micro_batches in ((4, 8), (3, 6), (2, 5)):
        for stage, actions in enumerate(build_schedule("zb-h1", stages, micro_batches)):
            computes_ = [a for a in actions if a.op in ("backward_input", "backward_weight")]
            for k, action in enumerate(computes_):
                if action.op == "backward_weight" and action.micro_batch + stage < micro_batches:
                    assert computes_[k - 1] == Action("backward_input",
                                                      action.micro_batch + stage)


def test_the_peaks_stored():
    peaks = {name: [peak_activations(a) for a in build_schedule(name, P, M, V)]
             for name, V in CHUNKS.items()}
    assert peaks == {"gpipe": [8] * 4, "1f1b": [4, 3, 2, 1], "interleaved": [11, 9, 7, 5],
                     "zb-h1": [4] * 4}
    assert simulated("zb-h1").peak_stored == [min(P, M)] * P == [max(peaks["1f1b"])] * P
    assert simulated("1f1b").peak_stored == [4, 3, 2, 1]


def test_zb_h1_idles_p_minus_1_where_1f1b_idles_3_p_minus_1():
    for name, idle in (("1f1b", 9.0), ("zb-h1", 3.0)):
        step = simulated(name)
        assert [step.span - busy for busy in step.busy] == [idle] * P
    assert 9 == (P - 1) * (1 + 2) and 3 == (P - 1) * 1


def test_b_then_w_gives_the_bits_of_one_backward_in_the_lessons_cell():
    rng = np.random.default_rng(0)
    layer = nn.Linear(4, 3, rng=rng)
    x = Tensor(rng.standard_normal((2, 4)).astype(np.float32), requires_grad=True)
    grad = np.ones((2, 3), np.float32)
    layer(x).backward(grad)
    whole = [x.grad.copy(), layer.weight.grad.copy()]
    x.grad, layer.weight.grad, layer.bias.grad = None, None, None
    pending = backward_input(layer(x), grad, list(layer.parameters()))
    assert x.grad is not None and layer.weight.grad is None
    backward_weight(pending)
    assert all(np.array_equal(a, b) for a, b in zip(whole, [x.grad, layer.weight.grad]))


@pytest.mark.mpi
@pytest.mark.slow  # four mpirun jobs; one real pipeline job stays in the default tier
def test_the_runner_stores_what_the_schedules_data_says_at_p2_m4():
    """The lesson's real runs (mpirun, its configuration: 2 ranks, 4 micro-batches, 3 steps)."""
    for name, V in CHUNKS.items():
        run = timelines.measure(RUN_STAGES, RUN_MICRO_BATCHES, name, steps=RUN_STEPS,
                                virtual_stages=V)
        data = [peak_activations(a) for a in build_schedule(name, RUN_STAGES,
                                                            RUN_MICRO_BATCHES, V)]
        assert run["peak_stored_micro_batches"] == data
        assert run["virtual_stages"] == V
        assert timelines.simulate_parts(run).span > 0
        assert 0 <= timelines.bubble(run) < 1


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def interleaved_gpipe_like(P, M, V):
    """Every forward of every chunk, then every backward: the bubble is right, the memory not."""
    forwards = [Action("forward", m, chunk=c) for c in range(V) for m in range(M)]
    backwards = [Action("backward", m, chunk=c) for c in reversed(range(V)) for m in range(M)]
    return [forwards + backwards for _ in range(P)]


def interleaved_backward_in_forward_order(P, M, V):
    """The chunks not reversed backward: chunk 0's backward waits for a gradient never sent."""
    return [[action._replace(chunk=V - 1 - action.chunk) if action.op == "backward" else action
             for action in actions] for actions in solutions(13).interleaved_compute(P, M, V)]


def interleaved_on_chunk_0(P, M, V):
    """1F1B's order with the chunks left out."""
    computes_ = ("forward", "backward")
    return [[a for a in actions if a.op in computes_] for actions in one_f_one_b(P, M)]


def zb_bubble_with_equal_costs(P, M, t_forward, t_input, t_weight):
    return (P - 1) / (3 * M + P - 1)


def zb_bubble_of_1f1b(P, M, t_forward, t_input, t_weight):
    return (P - 1) / (M + P - 1)


def zb_bubble_of_the_ideal_time(P, M, t_forward, t_input, t_weight):
    """The idle time over the compute time, not over the step."""
    return (P - 1) * (t_forward + t_input - t_weight) / (M * (t_forward + t_input + t_weight))


def zb_bubble_with_the_w_s_idle(P, M, t_forward, t_input, t_weight):
    """1F1B's fill and drain with the W's in it: (P - 1)(F + B), forgetting W fills the drain."""
    idle = (P - 1) * (t_forward + t_input)
    return idle / (M * (t_forward + t_input + t_weight) + idle)


def interleaved_warming_up_once_more(P, M, V):
    """An off-by-one warm-up: one forward more than Megatron-LM's on every rank."""
    return [_interleaved_with_warm_up(P, M, V, rank, 2 * (P - rank - 1) + (V - 1) * P + 1)
            for rank in range(P)]


def interleaved_warming_up_as_1f1b(P, M, V):
    """1F1B's warm-up count of 2 (P - r - 1) kept without the (V - 1) P of the other chunks."""
    return [_interleaved_with_warm_up(P, M, V, rank, 2 * (P - rank - 1)) for rank in range(P)]


def interleaved_chunks_round_robin(P, M, V):
    """Chunk k % V at virtual step k, micro-batch k // V: the chunks alternate every step
    instead of every P micro-batches."""
    order = []
    for rank in range(P):
        steps = solutions(13).interleaved_compute(P, M, V)[rank]
        forward, backward = iter(range(M * V)), iter(range(M * V))
        order.append([Action(a.op, k // V, chunk=(k % V if a.op == "forward" else V - 1 - k % V))
                      for a in steps
                      for k in [next(forward) if a.op == "forward" else next(backward)]])
    return order


def _interleaved_with_warm_up(P, M, V, rank, warmup):
    """Megatron-LM's virtual steps on `rank` with another warm-up count."""
    def action(op, k):
        group, position = divmod(k, P * V)
        chunk = position // P if op == "forward" else V - 1 - position // P
        return Action(op, group * P + k % P, chunk=chunk)

    total = M * V
    warmup = min(warmup, total)
    order = [action("forward", k) for k in range(warmup)]
    for k in range(total - warmup):
        order += [action("forward", warmup + k), action("backward", k)]
    return order + [action("backward", k) for k in range(total - warmup, total)]


def interleaved_warming_up_less(P, M, V):
    """Right: a warm-up of (P - r - 1) + (V - 1) P, shorter than Megatron-LM's, keeps the
    bubble of the formula with these costs and holds fewer pairs."""
    return [_interleaved_with_warm_up(P, M, V, rank, (P - rank - 1) + (V - 1) * P)
            for rank in range(P)]


def test_another_interleaved_order_with_the_formula_s_bubble_passes():
    from minimp.lessons.lesson13 import check_interleaved_compute

    assert check_interleaved_compute(interleaved_warming_up_less, quiet=True).passed


def zb_bubble_as_a_percentage(P, M, t_forward, t_input, t_weight):
    return 100 * solutions(13).zb_h1_bubble(P, M, t_forward, t_input, t_weight)


def zb_bubble_of_all_stages_over_one_step(P, M, t_forward, t_input, t_weight):
    """Every stage's idle time summed, divided by one step (not P steps)."""
    return P * solutions(13).zb_h1_bubble(P, M, t_forward, t_input, t_weight)


def zb_bubble_computing_without_w(P, M, t_forward, t_input, t_weight):
    """The compute time M (F + B), the W's left out of what a stage computes."""
    idle = (P - 1) * (t_forward + t_input - t_weight)
    return idle / (M * (t_forward + t_input) + idle)


def zb_bubble_one_minus_the_busy_share(P, M, t_forward, t_input, t_weight):
    """Right: 1 - compute / step, the same share another way."""
    compute = M * (t_forward + t_input + t_weight)
    return 1 - compute / (compute + (P - 1) * (t_forward + t_input - t_weight))


def test_the_bubble_as_one_less_the_busy_share_passes():
    from minimp.lessons.lesson13 import check_zb_h1_bubble

    assert check_zb_h1_bubble(zb_bubble_one_minus_the_busy_share, quiet=True).passed


WRONG = {
    "check_interleaved_compute": [
        Wrong(interleaved_gpipe_like, "all M V pairs"),
        Wrong(interleaved_backward_in_forward_order, "in reverse"),
        Wrong(interleaved_on_chunk_0, "each of its V chunks"),
        Wrong(interleaved_warming_up_once_more, "longer than"),
        Wrong(interleaved_warming_up_as_1f1b, "(V - 1) P"),
        Wrong(interleaved_chunks_round_robin, "(k // P) % V"),
    ],
    "check_zb_h1_bubble": [
        Wrong(zb_bubble_with_equal_costs, "F = B = W"),
        Wrong(zb_bubble_of_1f1b, "1F1B's bubble"),
        Wrong(zb_bubble_of_the_ideal_time, "not over the step"),
        Wrong(zb_bubble_with_the_w_s_idle, "W's in the drain"),
        Wrong(zb_bubble_as_a_percentage, "percentage"),
        Wrong(zb_bubble_of_all_stages_over_one_step, "P x step"),
        Wrong(zb_bubble_computing_without_w, "M (F + B + W)"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(13, WRONG)
