"""The README reads in five minutes: short, its map early, its links resolving, its Python run."""

import os
import re

import numpy as np

import pytest

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = os.path.join(ROOT, "README.md")
DOCS = ["README.md"] + sorted(
    os.path.join("docs", name) for name in os.listdir(os.path.join(ROOT, "docs"))
    if name.endswith(".md"))


def python_blocks():
    return re.findall(r"```python\n(.*?)```", open(README).read(), flags=re.S)


def test_every_python_block_in_the_readme_runs_and_prints_what_the_readme_says(capsys):
    blocks = python_blocks()
    assert blocks, "the README shows the library API in at least one python block"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})
    said = re.findall(r"It prints `([^`]+)`", open(README).read())
    assert said and capsys.readouterr().out.splitlines() == said


def test_the_step_written_out_is_mixed_precision_step():
    """The README's example spells out the step, then says minimp.mixed_precision_step is its
    last lines: run both (the example seeds its generator); the weights and the scaler agree to
    the bit."""
    block = next(b for b in python_blocks() if "accumulate_gradients" in b)
    head, _ = block.split("grads = optimizer.accumulate_gradients()")
    runs = []
    for source in (block, head + "minimp.mixed_precision_step(optimizer, scaler)\n"):
        namespace = {}
        exec(compile(source, "README.md", "exec"), namespace)
        runs.append(namespace)
    written, library = runs
    assert written["found_inf"] is False and written["scaler"].loss_scale == 2.0**16
    for mine, theirs in zip(written["model"].parameters(), library["model"].parameters()):
        assert np.array_equal(mine.data, theirs.data)
    assert written["scaler"].state_dict() == library["scaler"].state_dict()


def test_the_readme_is_short_and_its_map_comes_early():
    lines = open(README).read().splitlines()
    assert len(lines) <= 250
    headings = [number for number, line in enumerate(lines, 1)
                if re.match(r"## (Map|Tour|Layout|The code)", line)]
    assert headings and headings[0] <= 120


@pytest.mark.parametrize("path", DOCS)
def test_every_relative_link_resolves(path):
    text = open(os.path.join(ROOT, path)).read()
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)  # links only in prose
    missing = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a web address, or a heading of the same page
        file = target.split("#")[0]
        if not os.path.exists(os.path.join(ROOT, os.path.dirname(path), file)):
            missing.append(target)
    assert not missing, f"{path} links to files that do not exist: {missing}"


@pytest.mark.parametrize("path", DOCS)
def test_every_test_a_page_names_exists(path):
    """A table row that names `test_x.py::test_name` as the test holding a case must name a test
    that exists (a renamed test used to leave docs/reliability.md pointing at nothing).
    `test_x.py::test_y` is testing.md's placeholder in a command's shape."""
    text = open(os.path.join(ROOT, path)).read()
    missing = []
    for file, name in set(re.findall(r"(test_\w+\.py)::(test_\w+)", text)):
        source = os.path.join(ROOT, "tests", file)
        if file == "test_x.py" or (os.path.exists(source)
                                   and re.search(rf"^def {name}\(", open(source).read(), re.M)):
            continue
        missing.append(f"{file}::{name}")
    assert not missing, f"{path} names tests that do not exist: {sorted(missing)}"
