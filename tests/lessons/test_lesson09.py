"""Lesson 9 (myths): every number its prose states, as a test, and its exercises'
checkers against the reference solutions and wrong ones. A failure here means a sentence in
lessons/09_myths.ipynb became false, or a checker passes a wrong answer."""

import numpy as np
from exercising import Wrong, exercise_tests, solutions

from minimp import DynamicLossScaler, Tensor, mixed_precision_step, optim
from minimp import distributed as dist
from minimp import functional as F
from minimp.data import global_batch_indices, load_digits
from minimp.parallel import (
    DataParallel,
    shard,
    split_stages,
    stage_parameters,
)
from minimp.precision import SINGLE_PROCESS
from minimp.train import TrainConfig, build_model, train

f16 = np.float16


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


# ----- exercises: wrong solutions each checker must refuse ------------------------------
def zero3_keeping_the_weights(stage, p):
    return solutions(9).zero_bytes_per_parameter(min(stage, 2), p)


def dp_bytes_of_the_naive_algorithm(parameters, p, itemsize):
    return 2 * parameters * itemsize


def pp_bytes_both_ways_everywhere(stage, stages, batch, width, itemsize):
    return 2 * batch * width * itemsize


WRONG = {
    "check_zero_bytes_per_parameter": [
        Wrong(zero3_keeping_the_weights, ""),
    ],
    "check_dp_bytes_sent": [
        Wrong(dp_bytes_of_the_naive_algorithm, ""),
    ],
    "check_pp_bytes_sent": [
        Wrong(pp_bytes_both_ways_everywhere, ""),
    ],
}
(test_the_reference_solution_passes, test_an_unwritten_stub_is_reported_not_raised,
 test_every_wrong_solution_fails_naming_its_mistake,
 test_every_checker_refuses_two_wrong_solutions) = exercise_tests(9, WRONG)
