"""The type hints hold: mypy checks the whole package (settings in pyproject.toml)."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("mypy", reason="type checking needs mypy (in the 'dev' extra)")
ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_mypy_finds_no_errors_in_minimp():
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "minimp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
