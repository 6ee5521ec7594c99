"""Lesson 14 (hiding the all-reduce): the checkers of its exercises: the exposed seconds of
buckets all-reduced behind backward, and DataParallel's bucket plan. The lesson's timed run and
its configuration live in minimp/lessons/overlap_timeline.py.
Reference solutions: lessons/solutions/lesson14.py."""

from typing import Callable

from minimp.lessons.checking import Report, call, close, expect
from minimp.measure import costmodel

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


def _exposed_mistake(got: float, op_seconds: list, bucket_ops: list, ring_seconds: list) -> str:
    """What a wrong answer matches, in words (each we know; '' if none)."""
    backward = sum(op_seconds)
    ready = [sum(op_seconds[: sum(bucket_ops[: b + 1])]) for b in range(len(bucket_ops))]
    at_once = max(0.0, max(r + s for r, s in zip(ready, ring_seconds)) - backward)
    known = [(sum(ring_seconds), "every ring after backward, as with no overlap"),
             (at_once, "rings run at once; they run one at a time, each after the one before"),
             (ring_seconds[-1], "the last ring only: an earlier ring can still run, or delay "
              "the last, when backward ends")]
    matches = [words for value, words in known if abs(got - value) <= 1e-12
               or close(got, value, 1e-9)]
    return f" (that is {'; or '.join(matches)})" if matches else ""


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
                   f"got {got:g}, simulated {want:g}" + _exposed_mistake(got, ops, buckets, rings))

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
                   f"backward {backward:g} s: got {got:g}, cost model {want:g}"
                   + _exposed_mistake(got, ops, [1] * len(nbytes), rings))

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


def _plan(sizes: list, limit: float, itemsize: int) -> list[list[int]]:
    """The rule DataParallel plans by, for the diagnoses of wrong plans."""
    buckets: list[list[int]] = []
    current: list[int] = []
    elements = 0
    for index in reversed(range(len(sizes))):
        if current and (elements + sizes[index]) * itemsize > limit:
            buckets.append(current)
            current, elements = [], 0
        current.append(index)
        elements += sizes[index]
    return buckets + [current] if current else buckets


def _plan_mistake(got: list, sizes: list, limit: float, itemsize: int) -> str:
    """What a wrong plan shows, in words ('' if nothing we know)."""
    if any(not bucket for bucket in got):
        return " (an empty bucket: a parameter larger than a bucket fills one alone)"
    if got and got[0] and got[0][0] == 0 and len(sizes) > 1:
        return (" (the first bucket starts at parameter 0: backward completes the last "
                "parameter first)")
    right = data_parallel_plan(sizes, limit, itemsize)
    if got != right and [sorted(bucket) for bucket in got] == [sorted(b) for b in right]:
        return (" (the right buckets, each listed ascending: list each in the order backward "
                "completes it, last parameter first)")
    if got == _plan(sizes, limit, 1) != right:
        return " (that counts elements: a bucket holds elements x itemsize bytes)"
    if got == _plan(sizes, limit - 0.5, itemsize) != right:  # closed when exactly full
        return " (a bucket exactly full, bucket_bytes to the byte, stays one bucket)"
    return ""


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
            expect(got == want, f"got {got}, DataParallel plans {want}"
                   + _plan_mistake(got, sizes, limit, itemsize))

    return report.finish()


EXERCISES = [
    ("exposed_seconds", check_exposed_seconds),
    ("plan_buckets", check_bucket_plan),
]
