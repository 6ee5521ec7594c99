"""Checkers for lesson 7 (pipelines): the step time of a pipeline, 1F1B as compute actions under a
dependency checker, and 1F1B with its messages on minimp's own runner.
Reference solutions: lessons/solutions/lesson07.py."""

from typing import Callable

import numpy as np

from minimp import Tensor
from minimp import functional as F
from minimp.lessons.checking import Report, call, close, expect
from minimp.lessons.lesson05 import _run
from minimp.lessons.timelines import replay
from minimp.parallel import (
    PipelineStage,
    Topology,
    cut_shapes,
    one_f_one_b,
    peak_activations,
    split_stages,
    stage_parameters,
)
from minimp.train import build_model

SHAPES = [(4, 6), (2, 4), (1, 3), (4, 2), (3, 7)]  # (P, M): M < P and P = 1 included

# The configurations lessons/07_model_parallel.ipynb prints; tests/lessons/test_lesson07.py checks
# the same ones.
SCHEDULE_SHAPE = (4, 6)  # P, M of the printed schedules
MEMORY_MICRO_BATCHES = (4, 8, 16)  # M of the activation-memory table, with P = 4
REPLAYED = (4, 8, 1.0, 2.0)  # P, M, t_f, t_b of the replayed step with equal stages
MEASURED = (2, 4)  # P, M of the recorded timelines: two ranks on a 2-core machine
# P, M, t_f and t_b per stage of unequal stages whose first is the slower (t_f + t_b 4 against 3)
SLOW_FIRST = (2, 2, [1.0, 1.0], [3.0, 2.0])


def compute_actions(actions: list) -> list[tuple[str, int]]:
    """(op, micro-batch) of a stage's forward and backward actions, in order."""
    return [(a.op, a.micro_batch) for a in actions if a.op in ("forward", "backward")]


def run_compute(schedule: list, t_forward: float, t_backward: float) -> float:
    """The step time of a schedule whose stages all take t_forward and t_backward per micro-batch
    (messages free; see minimp.lessons.timelines.replay)."""
    return replay(schedule, t_forward, t_backward)[0]


def check_step_time(step_time: Callable[[int, int, float, float], float],
                    quiet: bool = False) -> Report:
    """step_time(P, M, t_forward, t_backward): the time of one GPipe or 1F1B step with P equal
    stages and M micro-batches, communication free."""
    report = Report("step_time", quiet)
    cases = ((4, 8, 1.0, 2.0), (2, 4, 3.0, 3.0), (1, 5, 1.0, 2.0), (8, 3, 0.5, 1.5))
    for P, M, forward, backward in cases:

        @report.case(
            f"P={P}, M={M}, t_forward={forward}, t_backward={backward}: as the simulated step",
            hint="the last stage's first forward starts after P - 1 forwards (the fill); then it "
            "runs M forwards and M backwards without a gap; the first stage's last backward ends "
            "P - 1 backwards after the last stage's (the drain)",
        )
        def _():
            want = run_compute(one_f_one_b(P, M), forward, backward)
            got = float(call(step_time, P, M, forward, backward))
            expect(close(got, want, 1e-9), f"returned {got:g}, the simulated step takes {want:g}")

    return report.finish()


def _structure(schedule: list, P: int, M: int) -> None:
    """Every stage runs F m and B m once for each micro-batch, F before B."""
    expect(len(schedule) == P, f"P={P}, M={M}: {len(schedule)} stage lists, expected {P}")
    for s, actions in enumerate(schedule):
        ops = compute_actions(actions)
        for mb in range(M):
            expect(ops.count(("forward", mb)) == 1 and ops.count(("backward", mb)) == 1,
                   f"P={P}, M={M}: stage {s} runs forward {mb} {ops.count(('forward', mb))} times "
                   f"and backward {mb} {ops.count(('backward', mb))} times")
            expect(ops.index(("forward", mb)) < ops.index(("backward", mb)),
                   f"P={P}, M={M}: stage {s} runs backward {mb} before forward {mb}")
        expect(len(ops) == 2 * M, f"P={P}, M={M}: stage {s} has extra compute actions")


COMPUTE_HINT = ("stage s: warm-up of min(P - s - 1, M) forwards, then alternate one forward and "
                "one backward, then the remaining backwards; Action('forward', m) and "
                "Action('backward', m) from minimp.parallel")


def check_one_f_one_b_compute(one_f_one_b_compute: Callable[[int, int], list],
                              quiet: bool = False) -> Report:
    """one_f_one_b_compute(P, M): each stage's forward and backward Actions in 1F1B order
    (messages left out)."""
    report = Report("one_f_one_b_compute", quiet)

    @report.case("every stage runs each micro-batch's forward and backward once, in that order",
                 hint=COMPUTE_HINT)
    def _():
        for P, M in SHAPES:
            _structure(call(one_f_one_b_compute, P, M), P, M)

    @report.case("the dependencies can be met: no stage waits forever", hint=COMPUTE_HINT)
    def _():
        for P, M in SHAPES:
            run_compute(call(one_f_one_b_compute, P, M), 1.0, 2.0)

    @report.case(
        "1F1B's memory: stage s holds at most P - s micro-batches' activations",
        hint="GPipe holds all M; start the backwards as soon as the warm-up is done",
    )
    def _():
        for P, M in SHAPES:
            peaks = [peak_activations(a) for a in call(one_f_one_b_compute, P, M)]
            expect(all(peak <= P - s for s, peak in enumerate(peaks)),
                   f"P={P}, M={M}: peaks per stage {peaks}, 1F1B promises at most "
                   f"{[P - s for s in range(P)]}")

    @report.case(
        "no time lost: the step takes (M + P - 1)(t_f + t_b), with t_b = 2 t_f",
        hint="a stage that runs a backward too late holds up every stage before it",
    )
    def _():
        for P, M in SHAPES:
            got = run_compute(call(one_f_one_b_compute, P, M), 1.0, 2.0)
            expect(got == 3.0 * (M + P - 1), f"P={P}, M={M}: the step takes {got:g}, "
                   f"the ideal is {3.0 * (M + P - 1):g}")

    return report.finish()


def _messages(schedule: list, P: int, M: int) -> None:
    """Each activation and gradient that has to move is sent and received once, in time."""
    for s, actions in enumerate(schedule):
        events: list[tuple[str, int]] = []
        for a in actions:
            if a.op == "send_forward_recv_backward":
                events += [("send_forward", a.micro_batch), ("recv_backward", a.received)]
            elif a.op == "send_backward_recv_forward":
                events += [("send_backward", a.micro_batch), ("recv_forward", a.received)]
            else:
                events.append((a.op, a.micro_batch))
        # (what comes first, what comes after, whether this stage does it at all)
        wanted = [("recv_forward", "forward", s > 0), ("forward", "send_forward", s < P - 1),
                  ("recv_backward", "backward", s < P - 1), ("backward", "send_backward", s > 0)]
        for before, after, needed in wanted:
            message = before if after in ("forward", "backward") else after
            for mb in range(M):
                count = events.count((message, mb))
                expect(count == (1 if needed else 0), f"P={P}, M={M}: stage {s} has {count} "
                       f"{message} {mb}, expected {1 if needed else 0}")
                if needed:
                    expect(events.index((before, mb)) < events.index((after, mb)),
                           f"P={P}, M={M}: stage {s} runs {after} {mb} before {before} {mb}")


def pipeline_gradients(schedule: list, P: int, M: int) -> tuple[dict, list]:
    """Run a schedule on minimp's PipelineStage on P simulated ranks (every message past the
    eager limit, so a send waits for its receive); returns (gradients by name, peaks)."""
    rng = np.random.default_rng(9)
    x, y = rng.standard_normal((4 * M, 8)).astype(np.float32), rng.integers(0, 4, 4 * M)

    def rank(comm):
        topology = Topology(comm, dp=1, pp=P)
        model = build_model(8, 4, 16, P, np.random.default_rng(0))
        start, stop = split_stages(model.layers, P)[topology.stage]
        shapes = cut_shapes(model.layers, x[:4])
        stage = PipelineStage(model.layers[start:stop], topology, input_shape=shapes[start],
                              output_shape=shapes[stop], dtype=np.float32, loss_fn=F.cross_entropy)
        stage.run(schedule[topology.stage], inputs=np.split(x, M), targets=np.split(y, M),
                  scale_loss=lambda loss: loss * (1.0 / M), after_backward=lambda: None)
        return {n: p.grad for n, p in stage_parameters(model, (start, stop))}, stage.peak_stored

    results = _run(P, rank, eager_limit=64)
    gradients = {name: g for grads, _ in results for name, g in grads.items()}
    return gradients, [peak for _, peak in results]


def check_one_f_one_b(one_f_one_b_full: Callable[[int, int], list], quiet: bool = False) -> Report:
    """one_f_one_b(P, M): each stage's Actions, messages included, that minimp's runner executes
    on P ranks where every send waits for its receive."""
    report = Report("one_f_one_b", quiet)

    @report.case("the compute actions are 1F1B's (as in the exercise before)", hint=COMPUTE_HINT)
    def _():
        for P, M in SHAPES:
            schedule = call(one_f_one_b_full, P, M)
            _structure(schedule, P, M)
            run_compute(schedule, 1.0, 2.0)
            peaks = [peak_activations(actions) for actions in schedule]
            expect(all(peak <= P - s for s, peak in enumerate(peaks)),
                   f"P={P}, M={M}: peaks per stage {peaks}, 1F1B promises at most "
                   f"{[P - s for s in range(P)]}")

    @report.case(
        "every activation is received before its forward and sent after it; gradients alike",
        hint="stage s > 0 receives (recv_forward) before each forward; stage s < P - 1 sends "
        "(send_forward) after it; backwards mirror this with recv_backward / send_backward",
    )
    def _():
        for P, M in SHAPES:
            _messages(call(one_f_one_b_full, P, M), P, M)

    peaks: dict[tuple[int, int], list] = {}

    @report.case(
        "minimp's runner executes it on P simulated ranks: gradients equal one process's",
        hint="in the steady state stage s sends forward while stage s + 1 sends backward: a send "
        "that waits for its receive blocks both. Pair them: Action('send_forward_recv_backward', "
        "m, received=k) on one side, Action('send_backward_recv_forward', k, received=m + 1)",
    )
    def _():
        for P, M in SHAPES:
            gradients, peaks[P, M] = pipeline_gradients(call(one_f_one_b_full, P, M), P, M)
            model = build_model(8, 4, 16, P, np.random.default_rng(0))
            rng = np.random.default_rng(9)
            x, y = rng.standard_normal((4 * M, 8)).astype(np.float32), rng.integers(0, 4, 4 * M)
            F.cross_entropy(model(Tensor(x)), y).backward()
            for name, parameter in model.named_parameters():
                expect(np.allclose(gradients[name], parameter.grad, rtol=1e-4, atol=1e-6),
                       f"P={P}, M={M}: the gradient of {name} differs from one process's")

    @report.case(
        "on the runner, stage s stores at most P - s micro-batches",
        hint="a backward frees its micro-batch: start them right after the warm-up's forwards",
    )
    def _():
        expect(len(peaks) == len(SHAPES), "the schedule did not run (see above)")
        for (P, M), stored in peaks.items():
            expect(all(peak <= P - s for s, peak in enumerate(stored)),
                   f"P={P}, M={M}: stored micro-batches per stage {stored}, at most "
                   f"{[P - s for s in range(P)]} in 1F1B")

    return report.finish()


EXERCISES = [
    ("step_time", check_step_time),
    ("one_f_one_b_compute", check_one_f_one_b_compute),
    ("one_f_one_b", check_one_f_one_b),
]
