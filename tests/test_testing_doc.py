"""docs/mutation_results.json's survivor entries: every test an entry says kills a mutant exists."""

import json
import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")
NAMED = re.compile(r"tests/[\w/]+\.py::\w+")


def survivors():
    with open(os.path.join(ROOT, "docs", "mutation_results.json")) as file:
        return json.load(file)["survivors"]


def test_every_test_named_in_the_survivor_entries_exists():
    entries = survivors()
    assert len(entries) > 500  # the entries are there
    missing = []
    for test in sorted({test for entry in entries.values() for test in entry["tests"]}):
        path, name = test.split("::")
        full = os.path.join(ROOT, path)
        source = open(full).read() if os.path.exists(full) else ""
        if not re.search(rf"^\s*def {name}\(", source, re.M):
            missing.append(test)
    assert not missing, missing


def test_an_entry_lists_the_tests_its_text_names_and_a_kill_names_at_least_one():
    """conftest runs an entry's "tests" first under mutmut: a test named only in the prose, or a
    "killed by" with no test listed, would leave that mutant's killer to run after the others."""
    unlisted, killed_by_nothing = [], []
    for mutant, entry in survivors().items():
        rows = [entry, *entry.get("earlier", [])]
        named = {test for row in rows for test in NAMED.findall(row["change"] + row["why"])}
        unlisted += [f"{mutant}: {test}" for test in sorted(named - set(entry["tests"]))]
        if entry["why"].lower().startswith("killed") and not entry["tests"]:
            killed_by_nothing.append(mutant)
    assert not unlisted, unlisted
    assert not killed_by_nothing, killed_by_nothing
