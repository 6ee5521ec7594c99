"""Lesson 8 (scale): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/08_scale.ipynb became false, or a checker passes a wrong answer."""

import json
import math

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import distributed as dist
from minimp.distributed.headers import HEADER_BYTES
from minimp.lessons import lesson08, processes
from minimp.lessons.lesson08 import recursive_doubling_time, ring_time
from minimp.measure import costmodel
from minimp.measure.machinemodel import SHIPPED_PATH, MachineModel

f16 = np.float16

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


def test_lesson8_the_data_centre_network_and_the_scale_figures():
    network = costmodel.DATACENTER
    assert (network.alpha, 1 / network.beta, 1 / network.gamma) == (5e-6, 25e9, 1e12)
    small, large = lesson08.SCALE_BYTES
    assert [lesson08.best_algorithm(n, 1024) for n in (small, large)] == ["rabenseifner"] * 2
    assert round(lesson08.ring_over_best(small, 1024), 2) == 55.80
    assert round(lesson08.ring_over_best(large, 1024), 2) == 1.12
    for nbytes, first in ((small, 4), (large, 1024)):  # "from p = ...": slower at every p after
        slower = [p for p in lesson08.SCALE_RANKS if lesson08.ring_over_best(nbytes, p) > 1.1]
        assert slower == [p for p in lesson08.SCALE_RANKS if p >= first]


def test_lesson8_the_shipped_band_the_notebook_prints():
    with open(SHIPPED_PATH) as file:
        shipped = json.load(file)
    band = shipped["held_out"]["2"]["ring"]
    assert (shipped["runs"]["2"], shipped["evaluated_runs"]["2"]) == (10, 5)
    assert [round(x, 2) for x in band["median"] + band["worst"]] == [0.04, 0.10, 0.15, 0.29]


@pytest.mark.mpi
def test_lesson8_the_notebooks_benchmark_runs_and_its_model_predicts_every_size():
    """What the notebook runs: 4 KiB to 4 MiB at p = 2; its figures vary (masked), only finite."""
    report = processes.run_json(2, "mpirun_examples/allreduce_bench.py", "--json",
                                *lesson08.BENCH_FLAGS)
    model = MachineModel.from_dict(report["model"])
    sizes = [row["bytes"] for row in report["rows"]]
    assert sizes == [2.0**k for k in range(12, 23)]
    assert all(0 < model.ring_allreduce(n) < 1 for n in sizes)


def test_lesson8_the_trace_holds_what_the_formulas_count():
    array = np.ones(8 * 1024, np.float32)
    assert HEADER_BYTES == 48
    for algorithm, messages, arrays in (("ring", 14, 1.75), ("recursive_doubling", 3, 3.0)):
        trace = dist.simulate(8, lambda c: dist.allreduce(c, array, algorithm=algorithm)).trace
        sent = [m for m in trace if m.source == 0]
        # checked recursive doubling's messages each begin with the sender's layout (headers.py)
        headers = HEADER_BYTES * messages if algorithm == "recursive_doubling" else 0
        assert len(sent) == messages
        assert (sum(m.nbytes for m in sent) - headers) / array.nbytes == arrays
        if algorithm == "recursive_doubling":
            assert sum(m.nbytes for m in sent) == 98_448 == 3 * 32_768 + 3 * 48


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def ring_time_without_gamma(nbytes, p, alpha, beta, gamma):
    return solutions(8).ring_allreduce_time(nbytes, p, alpha, beta, 0.0)


def ring_time_adding_in_both_halves(nbytes, p, alpha, beta, gamma):
    if p == 1:
        return 0.0
    return 2 * (p - 1) * (alpha + nbytes / p * (beta + gamma))


def ring_time_of_whole_arrays(nbytes, p, alpha, beta, gamma):
    return 2 * (p - 1) * (alpha + nbytes * beta) + (p - 1) * nbytes * gamma


def predict_in_absolute_error(sizes, seconds, nbytes):
    beta, alpha = np.polyfit(sizes, seconds, 1)
    return alpha + beta * nbytes


def predict_through_the_smallest_and_largest(sizes, seconds, nbytes):
    beta = (seconds[-1] - seconds[0]) / (sizes[-1] - sizes[0])
    return seconds[0] + beta * (nbytes - sizes[0])


def predict_weighing_by_one_over_seconds_squared(sizes, seconds, nbytes):
    """np.polyfit's w multiplies the residuals: 1/seconds**2 weighs them in relative error
    squared."""
    seconds = np.asarray(seconds)
    beta, alpha = np.polyfit(sizes, seconds, 1, w=1 / seconds**2)
    return alpha + beta * nbytes


def crossover_without_gamma(p, alpha, beta, gamma):
    return solutions(8).crossover_bytes(p, alpha, beta, 0.0)


def crossover_without_the_never_case(p, alpha, beta, gamma):
    rounds = math.log2(p)
    latency = alpha * (2 * (p - 1) - rounds)
    per_byte = beta * (rounds - 2 * (p - 1) / p) + gamma * (rounds - (p - 1) / p)
    return latency / per_byte


def crossover_with_p_minus_1_ring_messages(p, alpha, beta, gamma):
    """The ring's reduce-scatter only: p - 1 messages of n/p bytes."""
    rounds = math.log2(p)
    latency = alpha * ((p - 1) - rounds)
    per_byte = beta * (rounds - (p - 1) / p) + gamma * (rounds - (p - 1) / p)
    return math.inf if per_byte <= 0 else latency / per_byte


def ring_time_rounding_p_minus_1_over_p_to_1(nbytes, p, alpha, beta, gamma):
    """The large-p shortcut: 2n bytes sent and n added, whatever p."""
    return 0.0 if p == 1 else 2 * (p - 1) * alpha + 2 * nbytes * beta + nbytes * gamma


def crossover_with_doubling_adding_nothing(p, alpha, beta, gamma):
    """Recursive doubling's time without its additions, the ring's with them."""
    rounds = math.log2(p)
    latency = alpha * (2 * (p - 1) - rounds)
    per_byte = beta * (rounds - 2 * (p - 1) / p) - gamma * (p - 1) / p
    return math.inf if per_byte <= 0 else latency / per_byte


WRONG = {
    "check_ring_allreduce_time": [
        Wrong(ring_time_without_gamma, "additions"),
        Wrong(ring_time_adding_in_both_halves, "reduce-scatter only"),
        Wrong(ring_time_of_whole_arrays, "n/p bytes"),
        Wrong(ring_time_rounding_p_minus_1_over_p_to_1, "n/p bytes"),
    ],
    "check_predict_time": [
        Wrong(predict_in_absolute_error, "relative error"),
        Wrong(predict_through_the_smallest_and_largest, "all three"),
        Wrong(predict_weighing_by_one_over_seconds_squared, "w = 1/seconds"),
    ],
    "check_crossover_bytes": [
        Wrong(crossover_without_gamma, "gamma"),
        Wrong(crossover_without_the_never_case, "never"),
        Wrong(crossover_with_p_minus_1_ring_messages, "2(p - 1) alpha"),
        Wrong(crossover_with_doubling_adding_nothing, "n gamma"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(8, WRONG)
