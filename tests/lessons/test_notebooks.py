"""Every lesson is stored executed (one run, top to bottom), prints nothing to stderr, holds at
most 1,500 words of prose, ends in exercises whose checkers it calls, and is listed with them in
lessons/README.md; in the slow tier, nbval runs each again in a fresh kernel started outside
lessons/, under two OpenBLAS kernels, and compares what it prints with what is stored
(lessons/sanitize.cfg masks timings)."""

import importlib
import os
import platform
import re
import shutil
import subprocess
import sys

import pytest

from minimp.lessons import LESSONS as CHECKER_MODULES

nbformat = pytest.importorskip(
    "nbformat", reason="the lessons need the 'lessons' extra (nbformat, nbclient)"
)

LESSONS = os.path.join(os.path.dirname(__file__), "..", "..", "lessons")
NOTEBOOKS = sorted(name for name in os.listdir(LESSONS) if name.endswith(".ipynb"))
# Lessons are numbered by topic and may land out of order, so the numbers may skip.
NUMBERS = [int(module.removeprefix("lesson")) for module in CHECKER_MODULES]
MOST_WORDS = 1500
BENIGN_STDERR = ("Matplotlib is building the font cache",)  # a fresh machine's first plot


def notebook_of(number):
    """lessons/NN_*.ipynb."""
    (name,) = [name for name in NOTEBOOKS if name.startswith(f"{number:02d}_")]
    return name


def read(name):
    return nbformat.read(os.path.join(LESSONS, name), as_version=4)


def prose_words(notebook):
    """The words of the markdown cells, their fenced code blocks left out (code, not prose)."""
    text = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    return len(re.sub(r"```.*?```", " ", text, flags=re.S).split())


def test_each_notebook_has_its_checker_module():
    assert [int(name.split("_")[0]) for name in NOTEBOOKS] == NUMBERS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lesson_is_stored_executed_top_to_bottom_in_one_run(name):
    """scripts/execute_lessons.py stores them so: every code cell ran, in order, in one kernel,
    with no error and nothing on stderr (a warning a reader would see is a bug to fix)."""
    cells = [cell for cell in read(name).cells if cell.cell_type == "code"]
    counts = [cell.execution_count for cell in cells]
    assert counts == list(range(1, len(cells) + 1)), (
        f"{name}: execution counts {counts}: run `python scripts/execute_lessons.py "
        f"{int(name[:2])}` to store it executed"
    )
    for number, cell in enumerate(cells, 1):
        for output in cell.outputs:
            assert output.output_type != "error", f"{name}: code cell {number} raised"
            assert not (output.get("name") == "stderr"
                        and not output["text"].startswith(BENIGN_STDERR)), (
                f"{name}: code cell {number} printed to stderr: {output['text'][:300]}"
            )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lesson_holds_at_most_1500_words_of_prose(name):
    words = prose_words(read(name))
    assert words <= MOST_WORDS, f"{name}: {words} words of prose (at most {MOST_WORDS})"


def exercises(number):
    return importlib.import_module(f"minimp.lessons.lesson{number:02d}").EXERCISES


@pytest.mark.parametrize("number", NUMBERS)
def test_each_lesson_ends_in_two_to_four_exercises_whose_checkers_it_calls(number):
    notebook = read(notebook_of(number))
    code = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")
    checkers = exercises(number)
    assert 2 <= len(checkers) <= 4
    for _, checker in checkers:
        assert f"{checker.__name__}(" in code, f"{notebook_of(number)} never calls {checker}"
    markdown = "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "markdown")
    assert "## Exercises" in markdown.split("\n"), f"{notebook_of(number)}: no Exercises section"


@pytest.mark.parametrize("number", NUMBERS)
def test_the_readme_lists_each_lessons_exercises(number):
    readme = open(os.path.join(LESSONS, "README.md")).read()
    row = next(line for line in readme.splitlines() if line.startswith(f"| {number} |"))
    for solution_name, _ in exercises(number):
        assert f"`{solution_name}`" in row, f"lessons/README.md: lesson {number}: {solution_name}?"


# The suite's kernel (tests/conftest.py) and the oldest x86-64 one: a lesson prints its figures to
# the digits that do not move with the order another kernel adds float32 products in.
KERNELS = ("Haswell", "Prescott") if platform.machine() in ("x86_64", "AMD64") else ("Haswell",)


@pytest.mark.slow  # every lesson again in a fresh kernel, under each OpenBLAS kernel: 2 x 15 runs
@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_a_fresh_run_prints_what_the_notebook_stores(name, kernel, tmp_path):
    """nbval, on a copy in an empty folder (the kernel starts where the notebook is: not in
    lessons/, so nothing may depend on it), with no pytest configuration but its own, under
    OpenBLAS's `kernel` (OPENBLAS_CORETYPE: the stored outputs were made under Haswell)."""
    pytest.importorskip("nbval", reason="the notebooks' check needs nbval (the 'dev' extra)")
    shutil.copy(os.path.join(LESSONS, name), tmp_path / name)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-c",
         str(tmp_path / "pytest.ini"), "--nbval", "--nbval-current-env",
         "--nbval-sanitize-with", os.path.abspath(os.path.join(LESSONS, "sanitize.cfg")),
         str(tmp_path / name)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env={**os.environ, "OPENBLAS_CORETYPE": kernel},
    )
    assert result.returncode == 0, (
        f"{name} under {kernel}: a fresh run differs:\n{result.stdout[-6000:]}"
    )
