"""tests/decision_mutants.json, the hand-written flips of the package's decisions: well formed,
each `find` where the mutant expects it, each test there, each listed in docs/testing.md; the slow
tier plants every mutant (scripts/decision_mutants.py) and requires its test to kill it."""

import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import decision_mutants  # noqa: E402

ROOT = decision_mutants.ROOT
ENTRIES = decision_mutants.load()
KEBAB = re.compile(r"[a-z0-9]+(-[a-z0-9]+)*")


def test_every_entry_has_exactly_the_fields_each_a_non_empty_string():
    assert isinstance(ENTRIES, list) and ENTRIES
    for entry in ENTRIES:
        assert tuple(entry) == decision_mutants.FIELDS, entry.get("id")
        assert all(isinstance(value, str) and value for value in entry.values()), entry["id"]
        assert entry["find"] != entry["replace"], entry["id"]


def test_ids_are_kebab_case_and_unique():
    ids = [entry["id"] for entry in ENTRIES]
    assert [i for i in ids if not KEBAB.fullmatch(i)] == []
    assert len(set(ids)) == len(ids)


def test_every_find_occurs_exactly_once_in_its_file_of_the_package():
    assert all(entry["file"].startswith("minimp/") for entry in ENTRIES)
    assert decision_mutants.bad_finds(ENTRIES) == []


def test_every_test_names_an_existing_test_function():
    missing = []
    for entry in ENTRIES:
        path, _, name = entry["test"].partition("::")
        function = name.split("[")[0]
        full = os.path.join(ROOT, path)
        source = open(full).read() if path.startswith("tests/") and os.path.exists(full) else ""
        if not function.startswith("test_") or not re.search(rf"^def {function}\(", source, re.M):
            missing.append(entry["test"])
    assert missing == []


def rows_of_the_testing_doc():
    """{id: test} of the table in docs/testing.md's "Decision mutants" section."""
    with open(os.path.join(ROOT, "docs", "testing.md")) as file:
        section = file.read().split("\n## Decision mutants\n", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("| `")]
    return {row[0].strip("`"): row[-1].strip("`") for row in rows}


def test_docs_testing_lists_every_mutant_with_its_test():
    assert rows_of_the_testing_doc() == {entry["id"]: entry["test"] for entry in ENTRIES}


@pytest.mark.slow
def test_every_decision_mutant_is_killed():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "decision_mutants.py")],
                          capture_output=True, text=True, timeout=3600)
    assert done.returncode == 0, done.stdout + done.stderr
    n = len(ENTRIES)
    assert done.stdout.splitlines()[-1] == f"decision mutants: {n} of {n} killed (100%)"
