"""The test suite's own machinery: the order it takes under mutmut (named tests, then fastest)."""

import json
import os
import subprocess
import sys

from conftest import fastest_first, named_first


def test_fastest_first_orders_by_duration_and_puts_unknown_tests_last_in_their_order():
    durations = {"a": 3.0, "b": 0.5, "c": 1.0}
    assert fastest_first(["a", "x", "b", "y", "c"], durations) == ["b", "c", "a", "x", "y"]


def test_named_first_puts_the_named_tests_and_their_parameters_first_in_their_order():
    nodeids = ["t.py::a", "t.py::b[1]", "t.py::c", "t.py::b[2]", "t.py::bb"]
    assert named_first(nodeids, {"t.py::b", "t.py::c"}) == [
        "t.py::b[1]", "t.py::c", "t.py::b[2]", "t.py::a", "t.py::bb"
    ]
    assert named_first(nodeids, set()) == nodeids


def test_under_a_mutant_the_collected_tests_run_fastest_first(tmp_path):
    """A test file of three tests, mutmut's stats file beside it: pytest runs them by duration."""
    (tmp_path / "conftest.py").write_text(
        open(os.path.join(os.path.dirname(__file__), "conftest.py")).read()
    )
    (tmp_path / "test_three.py").write_text(
        "def test_slow(): pass\ndef test_quick(): pass\ndef test_middle(): pass\n"
    )
    durations = {"test_three.py::test_slow": 9.0, "test_three.py::test_quick": 0.1}
    durations["test_three.py::test_middle"] = 1.0
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": durations}))
    ran = {}
    for mutant in ("", "minimp.x_f__mutmut_1"):
        env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "test_three.py"]
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
        ran[mutant] = [line.split("::")[1].split()[0] for line in passed]
    assert ran[""] == ["test_slow", "test_quick", "test_middle"]  # the file's order
    assert ran["minimp.x_f__mutmut_1"] == ["test_quick", "test_middle", "test_slow"]


def test_under_a_mutant_its_rows_tests_run_first_then_the_rest_fastest_first(tmp_path):
    """The mutant's entry in docs/mutation_results.json names the slowest test: it runs first;
    another mutant's entry changes nothing."""
    (tmp_path / "conftest.py").write_text(
        open(os.path.join(os.path.dirname(__file__), "conftest.py")).read()
    )
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_three.py").write_text(
        "def test_slow(): pass\ndef test_quick(): pass\ndef test_middle(): pass\n"
    )
    durations = {"tests/test_three.py::test_slow": 9.0, "tests/test_three.py::test_quick": 0.1}
    durations["tests/test_three.py::test_middle"] = 1.0
    (tmp_path / "mutmut-stats.json").write_text(json.dumps({"duration_by_test": durations}))
    (tmp_path / "docs").mkdir()
    entry = {"change": "`a` -> `b`", "why": "killed by tests/test_three.py::test_slow",
             "tests": ["tests/test_three.py::test_slow"]}
    (tmp_path / "docs" / "mutation_results.json").write_text(
        json.dumps({"files": {}, "survivors": {"minimp.x_f__mutmut_1": entry}})
    )
    ran = {}
    for mutant in ("minimp.x_f__mutmut_1", "minimp.x_f__mutmut_2"):
        env = {**os.environ, "MUTANT_UNDER_TEST": mutant}
        command = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "tests"]
        result = subprocess.run(
            command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
        )
        passed = [line for line in result.stdout.splitlines() if "PASSED" in line]
        ran[mutant] = [line.split("::")[1].split()[0] for line in passed]
    assert ran["minimp.x_f__mutmut_1"] == ["test_slow", "test_quick", "test_middle"]
    assert ran["minimp.x_f__mutmut_2"] == ["test_quick", "test_middle", "test_slow"]


def test_the_suite_runs_numpy_s_openblas_on_the_haswell_kernel_the_figures_were_made_with():
    """conftest pins OPENBLAS_CORETYPE before NumPy loads; had NumPy been imported first (by a
    plugin), the kernel would be the CPU's own and kernel-dependent figures would drift."""
    from threadpoolctl import threadpool_info

    openblas = [pool for pool in threadpool_info() if pool["internal_api"] == "openblas"]
    assert openblas, "NumPy's BLAS is not OpenBLAS here: the pinned figures assume it"
    assert {pool["architecture"] for pool in openblas} == {"Haswell"}
    assert os.environ["OPENBLAS_CORETYPE"] == "Haswell"  # the notebooks and mpirun ranks inherit it
