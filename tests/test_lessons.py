"""Every lesson runs top to bottom in a fresh kernel (nbclient) and is stored without outputs."""

import os

import pytest

nbformat = pytest.importorskip(
    "nbformat", reason="the lessons need the 'lessons' extra (nbformat, nbclient)"
)
nbclient = pytest.importorskip("nbclient", reason="the lessons need the 'lessons' extra (nbclient)")

LESSONS = os.path.join(os.path.dirname(__file__), "..", "lessons")
NOTEBOOKS = sorted(name for name in os.listdir(LESSONS) if name.endswith(".ipynb"))


def test_there_are_nine_lessons():
    assert len(NOTEBOOKS) == 9


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lesson_is_stored_without_outputs(name):
    notebook = nbformat.read(os.path.join(LESSONS, name), as_version=4)
    for cell in notebook.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, (
                f"{name}: clear outputs before committing"
            )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_lesson_runs_top_to_bottom(name, tmp_path):
    notebook = nbformat.read(os.path.join(LESSONS, name), as_version=4)
    client = nbclient.NotebookClient(
        notebook, timeout=120, kernel_name="python3", resources={"metadata": {"path": LESSONS}}
    )
    client.execute()  # raises CellExecutionError, with the failing cell, on any error
