"""Checkers for lesson 9 (myths): memory per parameter under ZeRO, and the bytes data and pipeline
parallelism send per step, predicted and then measured on the training command's own ranks.
Reference solutions: lessons/solutions/lesson09.py."""

from typing import Callable

import numpy as np

from minimp import DynamicLossScaler, Tensor, mixed_precision_step, optim
from minimp import distributed as dist
from minimp import functional as F
from minimp import nn
from minimp.data import global_batch_indices, load_digits
from minimp.lessons.checking import Report, call, close, expect
from minimp.lessons.lesson05 import _run
from minimp.parallel import DataParallel, shard
from minimp.precision import SINGLE_PROCESS
from minimp.train import TrainConfig, build_model, train
from minimp.train.sizes import parameter_count

# What lessons/09_myths.ipynb measures; tests/lessons/test_lesson09.py checks the same.
DOT_SEED, DOT_LENGTH = 0, 4096  # the dot product summed in float16 and float32
REPLICAS = 4  # data-parallel replicas, pipeline stages
BATCH = 256  # the global batch of the measured step


def build() -> nn.Sequential:
    """The measured model: an MLP of 4 hidden layers of 128 on the 64-pixel digits, 10 classes."""
    return build_model(64, 10, 128, 4, np.random.default_rng(0))


def one_step(comm: dist.Communicator) -> tuple[dict, int]:
    """One mixed-precision step (float16 weights, float32 masters, Adam) on this rank's shard of a
    BATCH-sample batch of digits, data-parallel when comm has several ranks. Returns the bytes
    this rank holds afterwards, by kind, and the bytes it sent in the step."""
    digits = load_digits()
    model = build()
    optimizer = optim.Adam(model.parameters())
    model.to(np.float16)
    replicas = DataParallel(comm, optimizer) if comm.size > 1 else None
    if replicas:
        replicas.broadcast_parameters()  # every replica starts from rank 0's weights
    sent_before = comm.bytes_sent
    rows = shard(global_batch_indices(0, 1, BATCH, len(digits.train_labels)), comm.rank,
                 comm.size)
    scaler = DynamicLossScaler()
    logits = model(Tensor(digits.train_images[rows].astype(np.float16)))
    scaler.scale(F.cross_entropy(logits, digits.train_labels[rows])).backward()
    mixed_precision_step(optimizer, scaler, sync=replicas or SINGLE_PROCESS)
    buffers = replicas.buffers if replicas else []
    held = {"float16 weights": sum(p.data.nbytes for p in model.parameters()),
            "float32 masters": sum(m.nbytes for m in optimizer.master_weights),
            "Adam's two moments": sum(s.nbytes for slot in optimizer.slots for s in slot.values()),
            "all-reduce buffers": sum(send.nbytes + receive.nbytes for send, receive in buffers)}
    return held, comm.bytes_sent - sent_before


def training_bytes_per_step(**flags: object) -> list[int]:
    """Bytes each of REPLICAS simulated ranks sent in the second step of the training command's
    default model (the same MLP, batch 64, float16)."""
    config = TrainConfig(steps=2, log_every=1000, **flags)  # type: ignore[arg-type]
    results = dist.simulate(REPLICAS, lambda comm: train(config, log=lambda line: None, comm=comm))
    return [result["history"][-1]["bytes_sent"] for result in results]


def zero_bytes(stage: int, p: int) -> float:
    """Rajbhandari et al. 2020, Figure 1, mixed-precision Adam (K = 12): float16 parameters (2)
    and gradients (2), float32 master, momentum and variance (12), the last sharded first."""
    parameters, gradients, optimizer = 2.0, 2.0, 12.0
    if stage >= 1:
        optimizer /= p
    if stage >= 2:
        gradients /= p
    if stage >= 3:
        parameters /= p
    return parameters + gradients + optimizer


def check_zero_bytes_per_parameter(zero_bytes_per_parameter: Callable[[int, int], float],
                                   quiet: bool = False) -> Report:
    """zero_bytes_per_parameter(stage, p): bytes per parameter on each rank with mixed-precision
    Adam: stage 0 is plain data parallelism, stages 1-3 are ZeRO's."""
    report = Report("zero_bytes_per_parameter", quiet)
    hint = ("per parameter: 2 bytes of float16 weight, 2 of float16 gradient, 12 of optimizer "
            "state (float32 master, momentum, variance); ZeRO-1 splits the 12 over p ranks, "
            "ZeRO-2 the gradient too, ZeRO-3 (like FSDP) the weights as well")
    for stage in range(4):

        @report.case(f"stage {stage}, p = 1, 8 and 1024", hint=hint)
        def _():
            for p in (1, 8, 1024):
                got = float(call(zero_bytes_per_parameter, stage, p))
                want = zero_bytes(stage, p)
                expect(close(got, want, 1e-12), f"p={p}: returned {got:g}, expected {want:g}")

    return report.finish()


def measured_bytes_per_step(p: int, **flags: object) -> list[int]:
    """Bytes each rank sent in the last step of a 2-step run of the training command on p
    simulated ranks (scalar all-reduces are not counted: they carry a few float64s)."""
    config = TrainConfig(batch_size=32, steps=2, log_every=1000, **flags)  # type: ignore[arg-type]
    results = _run(p, lambda comm: train(config, log=lambda line: None, comm=comm))
    return [result["history"][-1]["bytes_sent"] for result in results]


def check_dp_bytes_sent(dp_bytes_sent: Callable[[int, int, int], float],
                        quiet: bool = False) -> Report:
    """dp_bytes_sent(parameters, p, itemsize): the bytes one data-parallel rank sends per step,
    on average over the ranks (minimp's ring, one bucket)."""
    report = Report("dp_bytes_sent", quiet)
    # p = 3 does not divide 2(p - 1) x itemsize: the average is not a whole number there
    for p, wire in ((2, "fp32"), (4, "fp16"), (4, "fp32"), (3, "fp32")):

        @report.case(
            f"{p} replicas, {wire} wire: as measured on the training command's ranks",
            hint="the ring all-reduce sends 2(p - 1) chunks of 1/p of the gradient (p - 1 in "
            "its reduce-scatter, p - 1 in its all-gather): 2(p - 1)/p of its bytes, at itemsize "
            "bytes an element on the wire (when p does not divide it, ranks differ by an "
            "element: the average is exact, and need not be a whole number: do not round)",
        )
        def _():
            config = dict(hidden=32, layers=2, grad_comm_dtype=wire)
            parameters = parameter_count(TrainConfig(**config))  # type: ignore[arg-type]
            itemsize = 4 if wire == "fp32" else 2
            got = float(call(dp_bytes_sent, parameters, p, itemsize))
            measured = float(np.mean(measured_bytes_per_step(p, **config)))
            expect(close(got, measured, 1e-9), f"{parameters:,} parameters: you say {got:,.1f} "
                   f"bytes, each rank sent {measured:,.1f} on average")

    return report.finish()


def check_pp_bytes_sent(pp_bytes_sent: Callable[[int, int, int, int, int], float],
                        quiet: bool = False) -> Report:
    """pp_bytes_sent(stage, stages, batch, width, itemsize): the bytes a pipeline stage sends per
    step (activations forward, their gradients back; every cut is `width` wide)."""
    report = Report("pp_bytes_sent", quiet)
    for stages, micro_batches, precision in ((2, 1, "fp16"), (4, 2, "fp16"), (3, 4, "fp32")):

        @report.case(
            f"{stages} stages, {micro_batches} micro-batch(es), {precision}: as measured",
            hint="stage s sends each micro-batch's output forward (unless it is the last) and its "
            "input's gradient back (unless it is the first): batch x width numbers each way",
        )
        def _():
            config = dict(hidden=32, layers=3, pp=stages, micro_batches=micro_batches,
                          precision=precision)
            measured = measured_bytes_per_step(stages, **config)
            itemsize = 2 if precision == "fp16" else 4
            for stage in range(stages):
                got = float(call(pp_bytes_sent, stage, stages, 32, 32, itemsize))
                expect(got == measured[stage], f"stage {stage}: you say {got:,.0f} bytes, "
                       f"it sent {measured[stage]:,}")

    return report.finish()


EXERCISES = [
    ("zero_bytes_per_parameter", check_zero_bytes_per_parameter),
    ("dp_bytes_sent", check_dp_bytes_sent),
    ("pp_bytes_sent", check_pp_bytes_sent),
]
