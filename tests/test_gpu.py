"""The CuPy path: float32 accumulation in float16 matmuls, ops and training on the GPU against
the CPU, and GPU buffers over MPI.

Every test here skips (with its reason) where CuPy or a device is absent.
"""

import os
import subprocess

import numpy as np
import pytest
from conftest import HAS_GPU, MPIRUN, PYTHON, requires_gpu
from test_ops import OPS

from minimp import Tensor, backend
from minimp.train import TrainConfig, train

pytestmark = [pytest.mark.gpu, requires_gpu]

if HAS_GPU:
    import cupy


@pytest.fixture(autouse=True)
def on_gpu():
    with backend.Device("gpu"):
        yield


def test_float16_matmul_accumulates_in_float32_range():
    """Rows of +60000 then -60000: a float16 accumulator overflows to inf at 65504;
    float32 gives 0."""
    row = np.concatenate([np.full(2048, 60000.0), np.full(2048, -60000.0)]).astype(np.float16)
    a = cupy.asarray(np.tile(row, (64, 1)))
    b = cupy.ones((4096, 64), cupy.float16)
    product = (Tensor(a) @ Tensor(b)).data
    assert product.dtype == cupy.float16
    assert bool(cupy.all(product == 0))


def test_float16_matmul_accumulates_in_float32_precision():
    """1 + 4096 x 2^-15: each term is a quarter of float16's ulp at 1, so a float16 running sum
    stays at 1 (even in blocks of 16, 16 x 2^-15 is half an ulp and ties to even);
    float32 gives 1.125."""
    row = np.concatenate([[1.0], np.full(4096, 2.0**-15)]).astype(np.float16)
    a = cupy.asarray(np.tile(row, (64, 1)))
    b = cupy.ones((4097, 64), cupy.float16)
    assert bool(cupy.all((Tensor(a) @ Tensor(b)).data == 1.125))


@pytest.mark.parametrize("name, op, shapes, positive", OPS, ids=[row[0] for row in OPS])
def test_every_op_on_the_gpu_matches_the_cpu(name, op, shapes, positive):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    if positive:
        arrays = [np.abs(a) + 0.5 for a in arrays]
    results = []
    for to_array in (np.asarray, cupy.asarray):
        tensors = [Tensor(to_array(a), requires_grad=True) for a in arrays]
        output = op(*tensors)
        output.backward(to_array(np.ones(output.shape, output.dtype)))
        results.append(
            [backend.to_numpy(output.data)] + [backend.to_numpy(t.grad) for t in tensors]
        )
    for cpu, gpu in zip(*results):
        np.testing.assert_allclose(gpu, cpu, rtol=1e-4, atol=1e-5, err_msg=name)


def test_training_on_the_gpu_matches_the_cpu_in_fp32_and_learns_in_fp16():
    common = dict(hidden=32, layers=2, batch_size=32, steps=20, log_every=1000, precision="fp32")
    gpu = train(TrainConfig(device="gpu", **common), log=lambda line: None)["master_weights"]
    backend.use_device("cpu")
    cpu = train(TrainConfig(device="cpu", **common), log=lambda line: None)["master_weights"]
    for name in cpu:
        np.testing.assert_allclose(gpu[name], cpu[name], rtol=1e-4, atol=1e-6, err_msg=name)
    fp16 = train(TrainConfig(device="gpu", steps=300, log_every=1000), log=lambda line: None)
    assert fp16["test_accuracy"] >= 0.9


@pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH")
def test_gpu_buffers_over_mpi():
    program = (
        "import cupy, numpy as np\n"
        "from minimp import backend\nfrom minimp import distributed as dist\n"
        "comm = dist.world(); backend.use_device('gpu', comm.rank)\n"
        "x = cupy.arange(1000, dtype=cupy.float32) * (comm.rank + 1)\n"
        "y = dist.ring_allreduce(comm, x)\n"
        "assert type(y).__module__.startswith('cupy')\n"
        "np.testing.assert_allclose(y.get(), np.arange(1000) * sum(range(1, comm.size + 1)))\n"
        "print('ok', comm.rank, flush=True)\n"
    )
    result = subprocess.run(
        [MPIRUN, "-n", "2", PYTHON, "-c", program],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("ok") == 2


def test_a_gpt_with_dropout_gives_the_same_gradients_on_the_gpu_as_on_the_cpu():
    """Embedding's scatter-add (cupy.add.at), the causal softmax and the uint64 dropout hash."""
    from minimp import functional as F
    from minimp.models import GPT, GPTConfig

    config = GPTConfig(vocab_size=11, context=8, layers=2, heads=2, width=16, dropout=0.1)
    ids = np.random.default_rng(0).integers(0, 11, (3, 8))
    grads = {}
    for device in ("cpu", "gpu"):
        backend.use_device(device)
        model = GPT(config, np.random.default_rng(0))
        model.set_dropout_state(seed=1, step=1, sample_indices=np.arange(3))
        logits = model(ids)  # (B, T, V)
        F.cross_entropy(logits.reshape(-1, 11), ids.reshape(-1)).backward()
        grads[device] = {n: backend.to_numpy(p.grad) for n, p in model.named_parameters()}
    for name, grad in grads["cpu"].items():
        np.testing.assert_allclose(grads["gpu"][name], grad, rtol=1e-4, atol=1e-6, err_msg=name)
