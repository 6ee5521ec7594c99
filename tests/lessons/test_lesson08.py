"""Lesson 8 (scale): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/08_scale.ipynb became false, or a checker passes a wrong answer."""

import math

import numpy as np
import pytest
from exercising import Wrong, exercise_tests, solutions

from minimp import distributed as dist
from minimp.distributed.headers import HEADER_BYTES
from minimp.lessons.lesson08 import recursive_doubling_time, ring_time
from minimp.measure import costmodel

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


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def ring_time_without_gamma(nbytes, p, alpha, beta, gamma):
    return solutions(8).ring_allreduce_time(nbytes, p, alpha, beta, 0.0)


def predict_in_absolute_error(sizes, seconds, nbytes):
    beta, alpha = np.polyfit(sizes, seconds, 1)
    return alpha + beta * nbytes


def crossover_without_gamma(p, alpha, beta, gamma):
    return solutions(8).crossover_bytes(p, alpha, beta, 0.0)


WRONG = {
    "check_ring_allreduce_time": [
        Wrong(ring_time_without_gamma, ""),
    ],
    "check_predict_time": [
        Wrong(predict_in_absolute_error, ""),
    ],
    "check_crossover_bytes": [
        Wrong(crossover_without_gamma, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(8, WRONG)
