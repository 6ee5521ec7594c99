"""Lesson 6 (data parallelism): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/06_data_parallel.ipynb became false, or a checker passes a wrong answer."""

import warnings

import numpy as np
import pytest
from exercising import Wrong, exercise_tests

from minimp import distributed as dist
from minimp import nn, optim
from minimp.parallel import (
    DataParallel,
    ReplicaMismatchError,
)
from minimp.train import TrainConfig, train

f16 = np.float16


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


WRONG = {
    "check_average_gradients": [
        Wrong(average_after_the_sum, ""),
        Wrong(average_on_a_float32_wire, ""),
    ],
    "check_global_mean_gradient": [
        Wrong(mean_of_means, ""),
    ],
    "check_drifted_replicas": [
        Wrong(drift_by_value, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(6, WRONG)
