"""Checkers for lesson 12 (cutting every layer): the row-parallel Linear's forward and backward as
a Function on simulated ranks, and the bytes a tensor-parallel group sends in a step. Reference
solutions: lessons/solutions/lesson12.py."""

import functools
from typing import Any, Callable

import numpy as np

from minimp import Tensor
from minimp.lessons.checking import Report, call, expect
from minimp.lessons.cutting import one_step
from minimp.lessons.lesson02 import numerical_gradient
from minimp.lessons.lesson05 import _run
from minimp.measure.tensor_parallel_accounts import gpt_tensor_parallel_bytes, ring_fraction
from minimp.train import TrainConfig, train

RTOL = 1e-12  # float64 sums in another order: a few units in the last place


def _row_parallel_rank(comm: Any, RowParallel: Any, x: np.ndarray, weight: np.ndarray,
                       grad_output: np.ndarray, backward: bool = True) -> dict:
    """This rank's slice of x's last axis and of the weight's columns through the learner's
    Function; then (unless not `backward`) backward from grad_output, the same on every rank."""
    cut = np.array_split(np.arange(x.shape[-1]), comm.size)[comm.rank]
    x_r = Tensor(np.ascontiguousarray(x[..., cut]), requires_grad=True)
    weight_r = Tensor(np.ascontiguousarray(weight[:, cut]), requires_grad=True)
    start = comm.bytes_sent
    y = RowParallel.apply(x_r, weight_r, comm=comm)
    forward = comm.bytes_sent - start
    expect(isinstance(y, Tensor), f"apply returned a {type(y).__name__}, not a Tensor")
    if not backward:  # the forward check: a wrong backward must not fail it
        return {"y": y.data}
    y.backward(grad_output)
    return {"y": y.data, "grad_x": x_r.grad, "grad_weight": weight_r.grad, "cut": cut,
            "forward_bytes": forward, "backward_bytes": comm.bytes_sent - start - forward}


def _cases(shape: tuple, out: int, ranks: int, seed: int) -> tuple:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(shape)
    weight = rng.standard_normal((out, shape[-1]))
    grad_output = rng.standard_normal((*shape[:-1], out))
    return x, weight, grad_output


def _close(got: Any, want: np.ndarray, what: str) -> None:
    expect(got is not None, f"{what}: no gradient arrived")
    got = np.asarray(got)
    expect(got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}")
    worst = float(np.max(np.abs(got - want)))
    expect(np.allclose(got, want, rtol=RTOL, atol=RTOL * np.max(np.abs(want))),
           f"{what}: differs from one process by up to {worst:.3g}")


def check_row_parallel(RowParallel: Any, quiet: bool = False) -> Report:
    """RowParallel: a Function; RowParallel.apply(x_r, weight_r, comm=comm) -> y, the sum over
    comm's t ranks of x_r weight_r^T, with x_r (..., in/t) this rank's slice of the input features
    and weight_r (out, in/t) its columns of the weight, rank r holding the r-th contiguous slice
    (no bias). forward gets the arrays and comm; backward gets dL/dy, the same whole array on every
    rank, and returns (dL/dx_r, dL/dweight_r), shaped like x_r and weight_r."""
    report = Report("RowParallel", quiet)
    shape, out = (3, 4, 12), 5  # (B, T, in): a batch of sequences, as in the GPT

    @report.case("forward on 1, 2, 3 and 4 ranks: every rank holds x W^T, one process's output",
                 hint="x_r @ weight_r.T is only this rank's partial sum; return "
                 "all_reduce(comm, x_r @ weight_r.T), g's forward: the sum, not the mean")
    def _():
        for ranks in (1, 2, 3, 4):
            x, weight, grad_output = _cases(shape, out, ranks, seed=ranks)
            for rank, got in enumerate(_run(ranks, _row_parallel_rank, RowParallel, x, weight,
                                            grad_output, False)):
                _close(got["y"], x @ weight.T, f"{ranks} ranks, rank {rank}'s output")

    @report.case("backward on 1 to 4 ranks: each rank's dL/dx_r and dL/dW_r are its slices "
                 "of one process's", hint="dL/dx_r = grad_output @ weight_r, not summed over "
                 "the ranks (g's backward is the identity: x_r's gradient is this rank's alone); "
                 "dL/dW_r = grad_output^T x_r summed over every leading axis (reshape both to "
                 "2-D first), shaped (out, in/t) like the weight, not its transpose")
    def _():
        for ranks in (1, 2, 3, 4):
            x, weight, grad_output = _cases(shape, out, ranks, seed=10 + ranks)
            grad_x = grad_output @ weight
            grad_weight = grad_output.reshape(-1, out).T @ x.reshape(-1, shape[-1])
            for rank, got in enumerate(_run(ranks, _row_parallel_rank, RowParallel, x, weight,
                                            grad_output)):
                where = f"{ranks} ranks, rank {rank}'s"
                _close(got["grad_x"], grad_x[..., got["cut"]], f"{where} dL/dx_r")
                _close(got["grad_weight"], grad_weight[:, got["cut"]], f"{where} dL/dW_r")

    @report.case("backward on 2 ranks against central differences of L = sum(y * G)",
                 hint="the gradients of the whole x W^T, cut as the inputs are cut")
    def _():
        x, weight, grad_output = _cases((2, 2, 4), 3, 2, seed=20)

        def scalar(arrays):
            return float(np.sum((arrays[0] @ arrays[1].T) * grad_output))

        numeric = [numerical_gradient(scalar, [x, weight], index) for index in (0, 1)]
        for rank, got in enumerate(_run(2, _row_parallel_rank, RowParallel, x, weight,
                                        grad_output)):
            cut = got["cut"]
            for name, want in (("grad_x", numeric[0][..., cut]),
                               ("grad_weight", numeric[1][:, cut])):
                expect(got[name] is not None and np.allclose(got[name], want, atol=1e-6),
                       f"rank {rank}'s {name} differs from central differences")

    @report.case("bytes on 4 ranks: one all-reduce of y forward, nothing backward",
                 hint="forward: a ring all-reduce sends 2 (t - 1)/t of y's bytes; backward: "
                 "dL/dy is whole on every rank already, so nothing travels (f, in front of the "
                 "column layer, does the backward all-reduce)")
    def _():
        x, weight, grad_output = _cases(shape, out, 4, seed=30)
        want = 2 * ring_fraction(4) * grad_output.nbytes
        for rank, got in enumerate(_run(4, _row_parallel_rank, RowParallel, x, weight,
                                        grad_output)):
            expect(got["forward_bytes"] == want, f"rank {rank} sent {got['forward_bytes']:,} "
                   f"bytes in forward; one all-reduce of y sends {want:,.0f}")
            expect(got["backward_bytes"] == 0, f"rank {rank} sent {got['backward_bytes']:,} "
                   "bytes in backward, where g's backward is the identity and sends nothing")

    return report.finish()


# ----- the bytes a tensor-parallel group sends --------------------------------------------------
TINY: dict[str, Any] = dict(dataset="shakespeare", layers=2, hidden=32, heads=4, context=16,
                            batch_size=4, micro_batches=2, steps=1, log_every=1000, eval_every=0,
                            eval_batches=1, threads=1)


@functools.cache
def _trainer_bytes(sequence_parallel: bool) -> list[int]:
    """Each rank's tensor-parallel bytes in a 1-step run of the training command, --tp 2."""
    config = TrainConfig(**TINY, tp=2, sequence_parallel=sequence_parallel)
    results = _run(2, lambda comm: train(config, log=lambda line: None, comm=comm))
    return [r["history"][-1]["bytes_by_group"]["tensor_parallel"] for r in results]


def check_tp_bytes_sent(tp_bytes_sent: Callable[..., float], quiet: bool = False) -> Report:
    """tp_bytes_sent(blocks, micro_batch_size, context, width, tp, micro_batches, compute_bytes,
    sequence_parallel): bytes one rank sends in its tensor-parallel group in one step of minimp's
    GPT, the whole model on one pipeline stage, without recomputation (the notebook's stub
    states every convention)."""
    report = Report("tp_bytes_sent", quiet)
    sizes = [(blocks, b, s, h, tp, m, d)
             for blocks, b, s, h in ((4, 8, 32, 64), (12, 1, 2048, 768))
             for tp in (1, 2, 4, 8) for m in (1, 3) for d in (2, 4)]
    for sp in (False, True):
        hint = ("per block and micro-batch: two all-reduces of one activation, b s h d bytes "
                "(b sequences of s positions), forward (g) and two backward (f), each sending "
                "2 (t - 1)/t of it, not 2 of it; t = 1 sends nothing")
        if sp:
            hint = ("the blocks send the same bytes as without it (an all-reduce is a "
                    "reduce-scatter and an all-gather); add, per micro-batch, the gather before "
                    "the head and its mirror behind the embeddings, (t - 1)/t b s h d each; and "
                    "once a step, not per micro-batch, an all-reduce of the partial gradients of "
                    "6 h-vectors a block, in float32 (4 bytes whatever d is)")

        @report.case(f"sequence parallel {sp}: 32 shapes against "
                     "tensor_parallel_accounts.gpt_tensor_parallel_bytes", hint=hint)
        def _():
            for blocks, b, s, h, tp, m, d in sizes:
                want = gpt_tensor_parallel_bytes(
                    blocks=blocks, rows=b, context=s, width=h, tp=tp, micro_batches=m,
                    compute_bytes=d, sequence_parallel=sp)
                got = call(tp_bytes_sent, blocks, b, s, h, tp, m, d, sp)
                expect(round(got) == want, f"L {blocks}, b {b}, s {s}, h {h}, t {tp}, M {m}, "
                       f"d {d}: you say {got:,.0f}, expected {want:,}")

    @report.case("measured: lesson 12's step of a GPT (4 blocks of 64, b 8, s 32, fp16) on 2 "
                 "simulated ranks, with and without sequence parallelism",
                 hint="the measured bytes are the formula's: see the crosses above")
    def _():
        for sp in (False, True):
            sent = _run(2, one_step, "tp 2 + sp" if sp else "tp 2")[0]["sent"]["tensor_parallel"]
            got = call(tp_bytes_sent, 4, 8, 32, 64, 2, 1, 2, sp)
            expect(round(got) == sent, f"sequence parallel {sp}: you say {got:,.0f}, it sent "
                   f"{sent:,}")

    @report.case("measured: the training command, --tp 2, 2 micro-batches of 2 sequences "
                 "(2 blocks of 32, context 16, fp16)", hint="the measured bytes are the "
                 "formula's: see the crosses above")
    def _():
        for sp in (False, True):
            got = call(tp_bytes_sent, 2, 2, 16, 32, 2, 2, 2, sp)
            for rank, sent in enumerate(_trainer_bytes(sp)):
                expect(round(got) == sent, f"sequence parallel {sp}, rank {rank}: you say "
                       f"{got:,.0f}, it sent {sent:,}")

    return report.finish()


EXERCISES = [
    ("RowParallel", check_row_parallel),
    ("tp_bytes_sent", check_tp_bytes_sent),
]
