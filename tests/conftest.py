"""Shared fixtures: a seeded generator, the venv's interpreter path for subprocess tests, and a
stand-in `cupy` module for device code on the CPU."""

import json
import os
import shutil
import subprocess
import sys
import types

# The lessons' figures, and the tests that pin them, were made under OpenBLAS's Haswell kernel:
# another (SkylakeX, on AVX-512) adds float32 products in another order and moves last digits.
# Machines here once set this in the environment and no longer do, so the suite sets it itself,
# for this process and the notebooks and mpirun ranks it starts, before NumPy loads OpenBLAS.
if "numpy" not in sys.modules:
    os.environ["OPENBLAS_CORETYPE"] = "Haswell"
    os.environ["OPENBLAS_L2_SIZE"] = "512"

import numpy as np  # noqa: E402  (after the kernel is chosen)
import pytest  # noqa: E402

# Subprocesses (python -m minimp.train, mpirun) must use this interpreter and its mpirun.
PYTHON = sys.executable
MPIRUN = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")


def run_train(ranks, flags, timeout=180):
    """`python -m minimp.train FLAGS`, under `mpirun -n RANKS` when ranks > 1; its output kept."""
    launcher = [MPIRUN, "-n", str(ranks)] if ranks > 1 else []
    return subprocess.run(
        [*launcher, PYTHON, "-m", "minimp.train", *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def slow_cases(*cases):
    """A matrix's parameter sets for the slow tier: the default tier keeps one case of each
    mpirun matrix, so `-m "not slow"` still launches every feature under real mpirun once."""
    cases = [case if isinstance(case, tuple) else (case,) for case in cases]  # one value each
    return [pytest.param(*case, marks=pytest.mark.slow) for case in cases]


def masters(path):
    """The float32 master weights a checkpoint holds, by name."""
    with np.load(path) as archive:
        return {name: archive[name] for name in archive.files if name.startswith("master/")}


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def _gpu_available():
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, or CuPy without a driver or device
        return False


HAS_GPU = _gpu_available()
requires_gpu = pytest.mark.skipif(not HAS_GPU, reason="needs CuPy and a CUDA device")


class DeviceLike(np.ndarray):
    """A NumPy array that backend.is_device_array takes for a CuPy one (its type's module)."""

    __module__ = "cupy.stand_in"


def cupy_stand_in():
    """A `cupy` module that is NumPy, except that the arrays it makes are DeviceLike: put it in
    sys.modules (monkeypatch.setitem) to see, without a GPU, whether code keeps a device array on
    the device. NumPy's functions return DeviceLike arrays too, as CuPy's take NumPy's calls."""
    cupy = types.ModuleType("cupy")
    cupy.__getattr__ = lambda name: getattr(np, name)  # moveaxis, ... (PEP 562)
    # constructors follow no array, so NumPy's would make host arrays: CuPy's make device ones
    cupy.empty = lambda shape, dtype: np.empty(shape, dtype).view(DeviceLike)
    cupy.zeros = lambda shape, dtype=float: np.zeros(shape, dtype).view(DeviceLike)
    cupy.full = lambda shape, value, dtype=None: np.full(shape, value, dtype).view(DeviceLike)
    cupy.arange = lambda *args, **kwargs: np.arange(*args, **kwargs).view(DeviceLike)
    cupy.asarray = lambda a, dtype=None: np.asarray(a, dtype).view(DeviceLike)
    cupy.ascontiguousarray = lambda a: np.ascontiguousarray(a).view(DeviceLike)
    cupy.broadcast_to = lambda array, shape: np.broadcast_to(array, shape, subok=True)
    # cupy.lib.stride_tricks.as_strided returns a CuPy view of a CuPy array
    as_strided = lambda x, shape=None, strides=None: np.lib.stride_tricks.as_strided(  # noqa: E731
        x, shape, strides, subok=True
    )
    cupy.lib = types.SimpleNamespace(stride_tricks=types.SimpleNamespace(as_strided=as_strided))
    return cupy


def fastest_first(nodeids, duration_by_test):
    """The test ids in order of their recorded durations, fastest first (unknown ones last, in
    their own order: Python's sort is stable)."""
    return sorted(nodeids, key=lambda nodeid: duration_by_test.get(nodeid, float("inf")))


def named_first(nodeids, named):
    """The test ids with those `named` (a test function, any of its parameters) first, each group
    in its own order."""
    def is_named(nodeid):
        return nodeid.split("[")[0] in named
    return [n for n in nodeids if is_named(n)] + [n for n in nodeids if not is_named(n)]


def pytest_collection_modifyitems(config, items):
    """Under mutmut (a mutant's name in MUTANT_UNDER_TEST), run the mutant's tests fastest first,
    and before them the tests its entry in docs/mutation_results.json names.

    mutmut hands pytest the tests that reach the mutated function in no set order and stops at
    the first failure (-x), so a mutant a 0.1 s test kills could first wait for a 20 s training
    test. The durations are the ones mutmut measured (mutmut-stats.json, in the mutants/ folder
    it runs the tests from). A survivor of an earlier run whose entry names the test written to
    kill it would otherwise rerun every test that passed before that one. The order changes what
    runs first, not the verdict: every test still runs until one fails. Nothing changes outside
    mutmut.
    """
    mutant = os.environ.get("MUTANT_UNDER_TEST", "")
    if "__mutmut_" not in mutant:
        return
    by_id = {item.nodeid: item for item in items}
    order = named_first(fastest_first(list(by_id), _mutmut_durations()), _row_tests(mutant))
    items[:] = [by_id[nodeid] for nodeid in order]


def _row_tests(mutant):
    """The test ids (tests/...py::name) the mutant's entry in docs/mutation_results.json names."""
    try:
        with open(os.path.join("docs", "mutation_results.json")) as results:
            entry = json.load(results).get("survivors", {}).get(mutant, {})
    except (OSError, ValueError):
        return set()
    return set(entry.get("tests", []))


def _mutmut_durations():
    try:
        with open("mutmut-stats.json") as stats:
            return json.load(stats)["duration_by_test"]
    except (OSError, ValueError, KeyError):
        return {}
