"""The MPI jobs lessons start: found from any working directory, and a failure shows the job's own
stderr (never a blank line, never a JSONDecodeError)."""

import pytest

from minimp.lessons import processes

pytestmark = pytest.mark.mpi


def test_the_repository_is_found_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = processes.repository_root()
    assert (root / "mpirun_examples" / "ring_allreduce.py").is_file()


def test_a_failing_job_shows_its_stderr():
    with pytest.raises(processes.JobFailed, match="exited with status 1(.|\n)*boom"):
        processes.run_job(1, ["-c", "import sys; sys.exit('boom')"], timeout=120)


def test_a_script_that_prints_no_json_shows_what_it_printed(tmp_path):
    script = tmp_path / "talks.py"
    script.write_text("print('not json at all')\n")
    with pytest.raises(processes.JobFailed, match="not json at all"):
        processes.run_json(1, str(script), timeout=120)


def test_a_missing_script_is_named():
    with pytest.raises(FileNotFoundError, match="no_such_script.py"):
        processes.run_script(1, "mpirun_examples/no_such_script.py")
