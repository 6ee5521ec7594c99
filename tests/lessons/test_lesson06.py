"""Lesson 6 (data parallelism): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/06_data_parallel.ipynb became false, or a checker passes a wrong answer."""

import warnings
import zlib

import numpy as np
from exercising import Wrong, exercise_tests

from minimp import distributed as dist
from minimp.lessons.lesson06 import (
    EQUIVALENCE,
    GRADIENT,
    ONE_DECISION,
    REPLICAS,
    average_on_float16_wire,
    largest_relative_difference,
    one_bit_off,
    trained_weights,
)
from minimp.train import train

f16 = np.float16


def test_lesson6_replicas_train_what_one_process_trains_up_to_float32_rounding():
    assert EQUIVALENCE.batch_size % REPLICAS == 0  # equal shards: the mean of means is the mean
    one = trained_weights(1)
    for world_size in (2, REPLICAS):
        worst = largest_relative_difference(one, trained_weights(world_size))
        assert 0 < worst < 1e-6  # "between 0 and 1e-6"


def test_lesson6_dividing_after_the_sum_overflows_float16_and_before_does_not():
    assert REPLICAS * GRADIENT > 65504 and GRADIENT < 65504
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # each rank silences its own expected overflow
        after = dist.simulate(REPLICAS, average_on_float16_wire, "after")
        before = dist.simulate(REPLICAS, average_on_float16_wire, "before")
    assert all(np.all(np.isinf(r)) for r in after)
    assert all(np.all(r == GRADIENT) for r in before)


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
    said = dist.simulate(REPLICAS, one_bit_off)
    assert all("[2]" in line and "differ" in line for line in said)
    results = dist.simulate(REPLICAS, lambda comm: train(ONE_DECISION, log=lambda line: None,
                                                         comm=comm))
    assert ONE_DECISION.check_replicas == 1  # "after every step"
    for result in results:
        assert len(result["history"]) == ONE_DECISION.steps
        assert [r["step"] for r in result["history"] if r["skipped"]] == [5]
        assert [r["loss_scale"] for r in result["history"]] == [65536.0] * 5 + [32768.0] * 3


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def average_after_the_sum(comm, grad):
    return dist.ring_allreduce(comm, grad.astype(np.float16)).astype(np.float32) / comm.size


def average_on_a_float32_wire(comm, grad):
    return dist.ring_allreduce(comm, grad / np.float32(comm.size))


def mean_of_means(comm, local_mean, count):
    return dist.ring_allreduce(comm, local_mean / comm.size)


def drift_by_value(comm, weights):
    table = np.zeros(comm.size)
    table[comm.rank] = float(np.sum(weights.astype(np.float64)))
    table = comm.allreduce_scalars(table, "sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


def average_returned_in_float16(comm, grad):
    return dist.ring_allreduce(comm, (grad / np.float32(comm.size)).astype(np.float16))


def average_by_the_naive_algorithm(comm, grad):
    wire = (grad / np.float32(comm.size)).astype(np.float16)
    return dist.allreduce(comm, wire, algorithm="naive").astype(np.float32)


def sum_over_samples(comm, local_mean, count):
    return dist.ring_allreduce(comm, local_mean * count)


def drift_by_byte_sum(comm, weights):
    table = np.zeros(comm.size)
    table[comm.rank] = float(np.frombuffer(weights.tobytes(), np.uint8).sum())
    table = comm.allreduce_scalars(table, "sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


def drift_by_sending_rank_0s_weights(comm, weights):
    theirs = dist.ring_allreduce(comm, weights if comm.rank == 0 else np.zeros_like(weights))
    differs = comm.allreduce_scalars(
        [float(r == comm.rank and theirs.tobytes() != weights.tobytes())
         for r in range(comm.size)], "sum")
    return [rank for rank in range(comm.size) if differs[rank]]


def drift_by_crc_of_each_rank_in_one_slot(comm, weights):
    """Everyone adds its checksum into one slot: a sum cannot say whose differs."""
    total = comm.allreduce_scalars([zlib.crc32(weights.tobytes())], "sum")[0]
    mine = zlib.crc32(weights.tobytes())
    return [] if total == comm.size * mine else [comm.rank]


def average_over_four_ranks(comm, grad):
    """The notebook runs 4 replicas: a fixed 4 instead of comm.size."""
    return dist.ring_allreduce(comm, (grad / np.float32(4)).astype(np.float16)).astype(np.float32)


def global_mean_in_float32(comm, local_mean, count):
    total = comm.allreduce_scalars([count], "sum")[0]
    return dist.ring_allreduce(comm, (local_mean * (count / total)).astype(np.float32))


def drift_by_crc_with_nan_to_num(comm, weights):
    """NaN made 0 before the checksum, so that NaN equals NaN: it also equals 0.0."""
    table = np.zeros(comm.size)
    table[comm.rank] = zlib.crc32(np.nan_to_num(weights).tobytes())
    table = comm.allreduce_scalars(table, "sum")
    return [rank for rank in range(comm.size) if table[rank] != table[0]]


WRONG = {
    "check_average_gradients": [
        Wrong(average_after_the_sum, "before the sum"),
        Wrong(average_on_a_float32_wire, "float16 wire"),
        Wrong(average_returned_in_float16, "float32"),
        Wrong(average_by_the_naive_algorithm, "ring"),
        Wrong(average_over_four_ranks, "comm.size"),
    ],
    "check_global_mean_gradient": [
        Wrong(mean_of_means, "weigh each by its count"),
        Wrong(sum_over_samples, "divide it by the total count"),
        Wrong(global_mean_in_float32, "float64"),
    ],
    "check_drifted_replicas": [
        Wrong(drift_by_value, "bits"),
        Wrong(drift_by_byte_sum, "swapped"),
        Wrong(drift_by_sending_rank_0s_weights, "checksum"),
        Wrong(drift_by_crc_of_each_rank_in_one_slot, "same list on every rank"),
        Wrong(drift_by_crc_with_nan_to_num, "nan_to_num"),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(6, WRONG)
