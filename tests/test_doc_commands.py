"""Every command in the ```bash fences of the README and the guides in docs/ runs as written.

The slow tier runs them, a file's commands in order in one temporary folder (a checkpoint one block
saves, a later block resumes). The conventions, which docs/testing.md states for writers:
- ```bash lines are run, and so is the example column of the README's modes table (elsewhere a
  table names commands without running them). ```sh lines are shown and never run (a GPU, a
  cluster); ```text is output.
- `python` becomes this test's interpreter and the venv's bin goes first on PATH (so `mpirun` is the
  one next to it); paths into the repository (`mpirun_examples/...`) become absolute.
- `pip ...`, `python -m pytest ...` and `jupyter lab ...` are not run: CI runs the first two itself,
  the third waits for a browser.
- A command whose comment holds `[long]` is not run; its block holds a short version of it, which is
  (the default tier checks that it does).
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
DOCS = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md"))
NOT_RUN = ("pip ", "python -m pytest", "jupyter lab")
LONG = "[long]"
# a word `python` (not python3, not a path ending in python)
PYTHON = re.compile(r"(?<![\w/.-])python(?![\w.-])")
IN_REPOSITORY = re.compile(r"(?<![\w/.-])((?:mpirun_examples|benchmarks|scripts|lessons)/)")


def blocks(text: str) -> list[list[str]]:
    """The commands of each ```bash fence, continuation lines joined, comment lines dropped."""
    found = []
    for body in re.findall(r"^```bash\n(.*?)^```", text, flags=re.S | re.M):
        lines = re.sub(r"\\\n\s*", " ", body).splitlines()
        found.append([line.strip() for line in lines
                      if line.strip() and not line.strip().startswith("#")])
    return found


def table_commands(text: str) -> list[str]:
    """The commands in the modes table's "example" column: code that starts with python or
    mpirun (the other columns name flags, the map's cells name commands without running them)."""
    section = text.split("\n## Training modes\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")]
    column = rows[0].index("example")
    return [code for row in rows[2:]
            for code in re.findall(r"`((?:python|mpirun) [^`]+)`", row[column])]


def program(command: str) -> str:
    """What a command runs: `python -m minimp.train` or the script's path, past any mpirun."""
    match = re.search(r"python (-m \S+|\S+\.py)|bash (\S+)", command)
    return match.group(0) if match else command.split()[0]


def runnable(command: str) -> bool:
    return not command.startswith(NOT_RUN) and LONG not in command


def rewritten(command: str) -> str:
    command = PYTHON.sub(sys.executable, command)
    return IN_REPOSITORY.sub(lambda m: os.path.join(ROOT, m.group(1)), command)


def doc_text(path: str) -> str:
    with open(os.path.join(ROOT, path)) as file:
        return file.read()


@pytest.mark.parametrize("path", DOCS)
def test_every_long_command_has_a_short_version_beside_it(path):
    """A `[long]` command is not run, so its block must hold one that runs the same program."""
    for block in blocks(doc_text(path)):
        for command in block:
            if LONG in command:
                shorts = [c for c in block if runnable(c) and program(c) == program(command)]
                assert shorts, f"{path}: no short version beside {command!r}"


@pytest.mark.slow
@pytest.mark.parametrize("path", DOCS)
def test_every_command_runs_as_written(path, tmp_path):
    text = doc_text(path)
    commands = [c for block in blocks(text) for c in block]
    if path == "README.md":
        commands += table_commands(text)
    commands = [c for c in commands if runnable(c)]
    if not commands:
        pytest.skip(f"{path} has no ```bash command to run")
    env = dict(os.environ, MPLBACKEND="Agg")
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    for command in commands:
        try:
            done = subprocess.run(["bash", "-c", rewritten(command)], cwd=tmp_path, env=env,
                                  capture_output=True, text=True, timeout=600)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{path}: {command!r} ran past 600 s")
        assert done.returncode == 0, (
            f"{path}: {command!r} exited {done.returncode}\n{done.stdout[-2000:]}\n"
            f"{done.stderr[-2000:]}")
