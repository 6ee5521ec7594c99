"""The GPU benchmarks and scripts/gpu_check.sh as far as a machine without a GPU can check them:
the one-line exit without CuPy or a device, the GEMM shapes the profile times, the shell syntax."""

import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import HAS_GPU, PYTHON

from minimp import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

no_gpu_only = pytest.mark.skipif(HAS_GPU, reason="a GPU is here: the no-GPU exit is not reached")


def run(command):
    """command from the repository's root; scripts/gpu_check.sh on this interpreter, not python3."""
    environment = {**os.environ, "PYTHONPATH": ROOT, "PYTHON": PYTHON}
    return subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env=environment)  # fmt: skip


@no_gpu_only
@pytest.mark.parametrize(
    "command, prefix",
    [
        ([PYTHON, "benchmarks/gpu_step_profile.py"], "gpu_step_profile: "),
        ([PYTHON, "benchmarks/gpu_ring_bench.py"], "gpu_ring_bench: "),
        ([PYTHON, "benchmarks/gpu_gpt_bench.py"], "gpu_gpt_bench: "),
        (["bash", "scripts/gpu_check.sh", os.devnull], "gpu_check: "),
    ],
)
def test_without_a_gpu_each_says_why_in_one_line_and_exits_2(command, prefix):
    result = run(command)
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix) and "device 'gpu'" in lines[0], lines


def test_gpu_check_is_valid_bash():
    assert run(["bash", "-n", "scripts/gpu_check.sh"]).returncode == 0


def test_the_profile_times_the_gemms_the_step_runs():
    """Forward and dL/dW for every Linear, dL/dx for all but the first (the input data needs no
    gradient): 3 GEMMs per layer but the first's 2, each 2 M N K FLOPs."""
    from gpu_step_profile import gemm_shapes

    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(),
                          nn.Linear(16, 10))  # fmt: skip
    shapes = gemm_shapes(model, batch=32)
    assert [name for name, *_ in shapes] == [
        "layer 0 forward", "layer 0 grad_weight",
        "layer 1 forward", "layer 1 grad_x", "layer 1 grad_weight",
        "layer 2 forward", "layer 2 grad_x", "layer 2 grad_weight",
    ]  # fmt: skip
    assert shapes[0][1:] == (32, 16, 8) and shapes[1][1:] == (16, 8, 32)
    flops = sum(2 * m * n * k for _, m, n, k in shapes)
    linears = [layer for layer in model if isinstance(layer, nn.Linear)]
    weights = sum(int(np.prod(layer.weight.shape)) for layer in linears)
    assert flops == 6 * 32 * weights - 2 * 32 * 8 * 16  # 6 N B, less the first layer's dL/dx


def test_the_phases_cover_the_step_and_leave_it_as_it_was():
    """The profile's phase timer runs on the CPU too (synchronising is then a no-op): every phase
    is timed, and step.py's helpers and the optimizer's methods are restored afterwards."""
    from gpu_step_profile import phases
    from step_bench import build

    from minimp import Tensor
    from minimp.precision import StaticLossScaler
    from minimp.precision import step as step_module

    model, optimizer = build(16, 2, 10, np.float16)
    helpers = {name: getattr(step_module, name) for name in ("all_finite", "unscale_")}
    rng = np.random.default_rng(0)
    x = Tensor(rng.standard_normal((8, 16)).astype(np.float16))
    targets = rng.integers(0, 10, 8)
    timings = phases(model, optimizer, StaticLossScaler(8.0), x, targets, repeats=2)
    assert set(timings) == {
        "forward", "backward", "accumulate", "finite checks", "unscale", "update + round",
        "whole step function",
    }  # fmt: skip
    assert all(ms > 0 for ms in timings.values())
    assert timings["whole step function"] >= timings["update + round"]
    assert all(getattr(step_module, name) is f for name, f in helpers.items())
    assert "step" not in vars(optimizer) and "accumulate_gradients" not in vars(optimizer)
