"""Lesson 13 (shrinking the bubble): the configurations its cells and its claims test share, and
the checkers of its exercises: the interleaved schedule's compute order as data, under the
dependency checker and the simulator; ZB-H1's bubble predicted, then simulated.
Reference solutions: lessons/solutions/lesson13.py."""

from typing import Callable

from minimp.lessons.checking import Report, call, close, expect
from minimp.parallel import Action
from minimp.parallel.pipeline.schedules import CHOICES
from minimp.parallel.pipeline.schedules.actions import peak_activations
from minimp.parallel.pipeline.schedules.dependencies import check_schedule, with_messages
from minimp.parallel.pipeline.schedules.interleaved import interleaved
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1
from minimp.parallel.pipeline.simulator import Costs, simulate_schedule

# The schedules the lesson prints and simulates: P stages, M micro-batches, V chunks per rank.
P, M = 4, 8
CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved": 2, "zb-h1": 1}
# The real runs (mpirun): 2 stages, 4 micro-batches, 3 steps each (the first left out).
RUN_STAGES, RUN_MICRO_BATCHES, RUN_STEPS = 2, 4, 3


def equal_costs(V: int) -> Costs:
    """A stage's forward takes 1 time unit and its backward 2 (ZB-H1's B and W 1 each), cut into
    V chunks of 1/V each; messages take no time."""
    return Costs(forward=1 / V, backward=2 / V)


def messages(schedule: list) -> int:
    """Messages per step: each send action sends one (paired exchanges included)."""
    return sum(action.op.startswith("send") for actions in schedule for action in actions)


def computes(schedule: list) -> list[int]:
    """Compute actions (forwards, backwards, B's and W's) per rank."""
    ops = ("forward", "backward", "backward_input", "backward_weight")
    return [sum(action.op in ops for action in actions) for actions in schedule]


# (P, M, V): two chunks and more, M = P (one group) and M a few groups
INTERLEAVED_SHAPES = [(2, 4, 2), (4, 8, 2), (2, 2, 3), (3, 6, 2), (4, 4, 2), (2, 8, 4)]
# (P, M, t_forward, t_input, t_weight): M >= P and t_weight <= t_forward, t_input
ZB_CASES = [(4, 8, 1.0, 1.0, 1.0), (4, 8, 1.0, 1.5, 0.5), (2, 4, 1.0, 2.0, 1.0),
            (3, 6, 2.0, 1.0, 1.0), (4, 4, 1.0, 1.0, 1.0), (8, 8, 1.0, 1.0, 0.25),
            (5, 12, 3.0, 2.0, 0.5)]

INTERLEAVED_HINT = (
    "virtual step k of rank r runs micro-batch (k // (P V)) P + k % P on chunk (k // P) % V, "
    "and backward runs the chunks in reverse (chunk V - 1 - that); warm up with "
    "min(2 (P - r - 1) + (V - 1) P, M V) forwards (all M V when M = P), then alternate one "
    "forward and one backward, then drain"
)


def _computes(schedule: list, P: int, M: int, V: int) -> list[list[Action]]:
    """The learner's compute actions, checked for shape and kind (no messages: we add them)."""
    expect(len(schedule) == P, f"P={P}, M={M}, V={V}: {len(schedule)} rank lists, expected {P}")
    for rank, actions in enumerate(schedule):
        for action in actions:
            expect(isinstance(action, Action) and action.op in ("forward", "backward"),
                   f"P={P}, M={M}, V={V}: rank {rank} has {action!r}; write only "
                   "Action('forward', m, chunk=c) and Action('backward', m, chunk=c)")
            expect(0 <= action.chunk < V,
                   f"P={P}, M={M}, V={V}: rank {rank} runs chunk {action.chunk} of {V}")
    return [list(actions) for actions in schedule]


def check_interleaved_compute(interleaved_compute: Callable[[int, int, int], list],
                              quiet: bool = False) -> Report:
    """interleaved_compute(P, M, V): each rank's forward and backward Actions (with their chunk)
    in an interleaved 1F1B order; the checker adds the messages (with_messages)."""
    report = Report("interleaved_compute", quiet)

    def learners(P: int, M: int, V: int) -> list:
        return _computes(call(interleaved_compute, P, M, V), P, M, V)

    def schedule(P: int, M: int, V: int) -> list:
        return with_messages(learners(P, M, V), P, V)

    @report.case("every rank runs each micro-batch's forward and backward once on each of its "
                 "V chunks", hint="a rank holds V chunks: its M forwards and M backwards run on "
                 "each of its V chunks, 2 M V computes in all")
    def _():
        for P, M, V in INTERLEAVED_SHAPES:
            want = sorted((op, m, c) for op in ("backward", "forward") for m in range(M)
                          for c in range(V))
            for rank, actions in enumerate(learners(P, M, V)):
                got = sorted((a.op, a.micro_batch, a.chunk) for a in actions)
                expect(got == want, f"P={P}, M={M}, V={V}: rank {rank} runs {len(got)} computes "
                       f"on chunks {sorted({c for _, _, c in got})}, expected each of the "
                       f"{2 * M} on each of the V chunks")

    @report.case("the dependency checker finds nothing wrong (sends buffered, as in the trainer)",
                 hint=INTERLEAVED_HINT)
    def _():
        for P, M, V in INTERLEAVED_SHAPES:
            problems = check_schedule(schedule(P, M, V), M, V, rendezvous=False)
            if problems:
                more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
                expect(False, f"P={P}, M={M}, V={V}: {problems[0]}{more}")

    @report.case(
        "the simulated bubble is (P - 1)/(V M + P - 1): forward 1/V, backward 2/V per chunk",
        hint="the warm-up fills the pipe once for all V chunks; a backward too late or a chunk "
        "run out of turn leaves a rank waiting",
    )
    def _():
        for P, M, V in INTERLEAVED_SHAPES:
            got = simulate_schedule(schedule(P, M, V), equal_costs(V))
            want = CHOICES["interleaved"].bubble(P, M, V)
            expect(close(got.bubble, want, 1e-9),
                   f"P={P}, M={M}, V={V}: simulated bubble {got.bubble:.4f}, formula {want:.4f}")

    @report.case(
        "each rank holds no more (micro-batch, chunk) pairs than Megatron-LM's order does",
        hint="all forwards before any backward fills the bubble too, but holds all M V pairs; "
        "start the backwards after the warm-up, and a warm-up longer than min(2 (P - r - 1) + "
        "(V - 1) P, M V) forwards holds pairs the pipe does not need",
    )
    def _():
        for P, M, V in INTERLEAVED_SHAPES:
            got = [peak_activations(actions) for actions in schedule(P, M, V)]
            bound = [peak_activations(actions) for actions in interleaved(P, M, V)]
            expect(all(g <= b for g, b in zip(got, bound)),
                   f"P={P}, M={M}, V={V}: peaks per rank {got}, Megatron-LM's {bound}")

    return report.finish()


def simulated_zb_h1(P: int, M: int, t_forward: float, t_input: float, t_weight: float) -> float:
    """The bubble of ZB-H1 in the simulator with these costs (B = t_input, W = t_weight)."""
    costs = Costs(forward=t_forward, backward=t_input + t_weight, backward_input=t_input,
                  backward_weight=t_weight)
    return simulate_schedule(zb_h1(P, M), costs).bubble


def _zb_mistake(got: float, P: int, M: int, F: float, B: float, W: float) -> str:
    """What a wrong prediction matches, in words ('' if nothing we know)."""
    idle, compute = (P - 1) * (F + B - W), M * (F + B + W)
    known = [((P - 1) / (3 * M + P - 1), "the bubble of F = B = W: weigh each part by its time"),
             ((P - 1) / (M + P - 1), "1F1B's bubble: ZB-H1's W's fill the drain"),
             ((P - 1) * (F + B) / (compute + (P - 1) * (F + B)),
              "the idle time of 1F1B with B and W apart: the W's in the drain are not idle"),
             (idle / compute, "the idle time over the compute time, not over the step"),
             (P * idle / (compute + idle), "all P stages' idle time over one step: divide by "
              "P x step"),
             (100 * idle / (compute + idle), "a percentage: the bubble is a share, 0 to 1")]
    return next((f" (that is {words})" for value, words in known if close(got, value, 1e-9)), "")


def check_zb_h1_bubble(zb_h1_bubble: Callable[[int, int, float, float, float], float],
                       quiet: bool = False) -> Report:
    """zb_h1_bubble(P, M, t_forward, t_input, t_weight): ZB-H1's bubble (idle time of all
    stages / (P x step)), messages free, for M >= P and t_weight <= t_forward, t_input."""
    report = Report("zb_h1_bubble", quiet)
    for P, M, forward, input_, weight in ZB_CASES:
        equal = forward == input_ == weight

        @report.case(
            f"P={P}, M={M}, F={forward:g}, B={input_:g}, W={weight:g}: as the simulator's"
            + (" (all equal)" if equal else ""),
            hint="each stage computes M (F + B + W); a W can fill a wait, so a stage idles "
            "(P - 1)(F + B - W) (Qi et al. 2023, section 3); the step is the sum of the two",
        )
        def _():
            want = simulated_zb_h1(P, M, forward, input_, weight)
            got = float(call(zb_h1_bubble, P, M, forward, input_, weight))
            expect(close(got, want, 1e-9), f"predicted {got:.4f}, simulated {want:.4f}"
                   + _zb_mistake(got, P, M, forward, input_, weight))

    return report.finish()


EXERCISES = [
    ("interleaved_compute", check_interleaved_compute),
    ("zb_h1_bubble", check_zb_h1_bubble),
]
