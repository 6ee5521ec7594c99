"""Checkers for lesson 13 (hiding communication): the interleaved schedule's compute order as data,
under the dependency checker and the simulator; ZB-H1's bubble predicted, then simulated; the
exposed seconds of buckets all-reduced behind backward; DataParallel's bucket plan.
Reference solutions: lessons/solutions/lesson13.py."""

from typing import Callable

from minimp.measure import costmodel
from minimp.lessons.checking import Report, call, close, expect
from minimp.parallel import Action
from minimp.parallel.pipeline.schedules.dependencies import check_schedule, with_messages
from minimp.parallel.pipeline.schedules.interleaved import interleaved
from minimp.parallel.pipeline.schedules import CHOICES
from minimp.parallel.pipeline.schedules.actions import peak_activations
from minimp.parallel.pipeline.simulator import Costs, simulate_schedule
from minimp.parallel.pipeline.schedules.zero_bubble import zb_h1

# (P, M, V): two chunks and more, M = P (one group) and M a few groups
INTERLEAVED_SHAPES = [(2, 4, 2), (4, 8, 2), (2, 2, 3), (3, 6, 2), (4, 4, 2), (2, 8, 4)]
# (P, M, t_forward, t_input, t_weight): M >= P and t_weight <= t_forward, t_input
ZB_CASES = [(4, 8, 1.0, 1.0, 1.0), (4, 8, 1.0, 1.5, 0.5), (2, 4, 1.0, 2.0, 1.0),
            (3, 6, 2.0, 1.0, 1.0), (4, 4, 1.0, 1.0, 1.0), (8, 8, 1.0, 1.0, 0.25),
            (5, 12, 3.0, 2.0, 0.5)]

INTERLEAVED_HINT = (
    "virtual step k of rank r runs micro-batch (k // (P V)) P + k % P on chunk (k // P) % V "
    "(backward: chunk V - 1 - that); warm up with min(2 (P - r - 1) + (V - 1) P, M V) forwards "
    "(all M V when M = P), then alternate one forward and one backward, then drain"
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

    def schedule(P: int, M: int, V: int) -> list:
        return with_messages(_computes(call(interleaved_compute, P, M, V), P, M, V), P, V)

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
            got = simulate_schedule(schedule(P, M, V), Costs(forward=1 / V, backward=2 / V))
            want = CHOICES["interleaved"].bubble(P, M, V)
            expect(close(got.bubble, want, 1e-9),
                   f"P={P}, M={M}, V={V}: simulated bubble {got.bubble:.4f}, formula {want:.4f}")

    @report.case(
        "each rank holds no more (micro-batch, chunk) pairs than Megatron-LM's order does",
        hint="all forwards before any backward fills the bubble too, but holds all M V pairs; "
        "start the backwards after the warm-up",
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
            expect(close(got, want, 1e-9), f"predicted {got:.4f}, simulated {want:.4f}")

    return report.finish()


# (op_seconds, bucket_ops, ring_seconds): rings hidden but the last, rings that queue, a backward
# of no length, one bucket, a ring longer than all of backward
EXPOSED_CASES = [
    ([1.0, 1.0, 1.0, 1.0], [2, 1, 1], [0.5, 0.5, 0.5]),
    ([1.0, 0.5, 0.5, 2.0, 1.0], [1, 2, 2], [2.0, 3.0, 0.5]),
    ([0.0, 0.0, 0.0], [1, 1, 1], [1.0, 2.0, 3.0]),
    ([3.0, 1.0], [2], [0.25]),
    ([0.5, 0.5, 0.5, 0.5], [1, 3], [5.0, 0.1]),
    ([1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [1, 1, 1, 1, 1, 1], [1.5, 2.5, 0.5, 4.0, 1.0, 0.5]),
]
# (elements of each parameter in model order, bucket bytes, itemsize)
PLAN_CASES = [
    ([32768, 512, 262144, 512, 262144, 512, 262144, 512, 5120, 10], 2**20, 4),
    ([10, 20, 30, 40], 200, 4), ([10, 20, 30, 40], 120, 4), ([10, 20, 30, 40], 119, 4),
    ([1000, 1, 1, 1000], 64, 2), ([5, 5, 5], 10**6, 4), ([7], 1, 4),
]


def simulated_exposed(op_seconds: list, bucket_ops: list, ring_seconds: list) -> float:
    """Play the rings beside backward: bucket b is ready when its last op ends; its ring starts
    when it is ready and the ring before it has ended."""
    ends = [sum(op_seconds[: k + 1]) for k in range(len(op_seconds))]
    ring_end, last_op = 0.0, -1
    for ops, seconds in zip(bucket_ops, ring_seconds):
        last_op += ops
        ring_end = max(ring_end, ends[last_op]) + seconds
    return max(0.0, ring_end - (ends[-1] if ends else 0.0))


def check_exposed_seconds(exposed_seconds: Callable[[list, list, list], float],
                          quiet: bool = False) -> Report:
    """exposed_seconds(op_seconds, bucket_ops, ring_seconds): how long the last bucket's ring
    runs past backward's end, rings beside the compute, one at a time in bucket order."""
    report = Report("exposed_seconds", quiet)
    hint = ("a bucket is ready when its last op ends; its ring starts at the later of that and "
            "the previous ring's end; exposed = last ring's end - backward's end, at least 0")
    for ops, buckets, rings in EXPOSED_CASES:

        @report.case(f"ops {ops}, buckets of {buckets} ops, rings {rings}: as simulated",
                     hint=hint)
        def _():
            want = simulated_exposed(ops, buckets, rings)
            got = float(call(exposed_seconds, list(ops), list(buckets), list(rings)))
            expect(abs(got - want) <= 1e-12 or close(got, want, 1e-9),
                   f"got {got:g}, simulated {want:g}")

    @report.case("as costmodel.overlapped_exposed_time when each op's time is its bytes' share",
                 hint="the cost model makes a bucket ready once backward has done its share of "
                 "the bytes: one op per bucket, each as long as its share")
    def _():
        net, nbytes = costmodel.DATACENTER, [4e6, 1e6, 8e6, 2e6]
        for backward in (0.0, 1e-4, 1e-3, 1e-2):
            ops = [backward * n / sum(nbytes) for n in nbytes]
            rings = [costmodel.ring_allreduce_time(n, 2, net) for n in nbytes]
            want = costmodel.overlapped_exposed_time(nbytes, backward, 2, net)
            got = float(call(exposed_seconds, ops, [1] * len(nbytes), rings))
            expect(abs(got - want) <= 1e-12 or close(got, want, 1e-9),
                   f"backward {backward:g} s: got {got:g}, cost model {want:g}")

    return report.finish()


def data_parallel_plan(sizes: list[int], bucket_bytes: float, itemsize: int) -> list[list[int]]:
    """DataParallel's own plan for parameters of these sizes, on a world of one."""
    import numpy as np

    from minimp import optim
    from minimp.distributed import simulate
    from minimp.parallel.data.data_parallel import DataParallel
    from minimp.tensor import Tensor

    def plan(comm):
        params = [Tensor(np.zeros(n, np.float32), requires_grad=True) for n in sizes]
        sync = DataParallel(comm, optim.SGD(params, lr=0.1), bucket_mb=bucket_bytes / 2**20,
                            comm_dtype=np.dtype(f"f{itemsize}"))
        return [indices for indices, _ in sync.buckets]

    return simulate(1, plan)[0]


def check_bucket_plan(plan_buckets: Callable[[list, float, int], list],
                      quiet: bool = False) -> Report:
    """plan_buckets(sizes, bucket_bytes, itemsize): DataParallel's buckets as lists of parameter
    indices, last parameter first."""
    report = Report("plan_buckets", quiet)
    for sizes, limit, itemsize in PLAN_CASES:

        @report.case(f"sizes {sizes}, {limit:,} bytes, itemsize {itemsize}: DataParallel's plan",
                     hint="walk the parameters from the last to the first; close the bucket "
                     "when the next one would take it over bucket_bytes (exactly full is fine), "
                     "and never leave a bucket empty")
        def _():
            want = data_parallel_plan(sizes, limit, itemsize)
            got = [list(bucket) for bucket in call(plan_buckets, list(sizes), limit, itemsize)]
            expect(got == want, f"got {got}, DataParallel plans {want}")

    return report.finish()


EXERCISES = [
    ("interleaved_compute", check_interleaved_compute),
    ("zb_h1_bubble", check_zb_h1_bubble),
    ("exposed_seconds", check_exposed_seconds),
    ("plan_buckets", check_bucket_plan),
]
