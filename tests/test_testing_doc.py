"""docs/testing.md's survivor tables: every test a row says kills a mutant exists."""

import os
import re

ROOT = os.path.join(os.path.dirname(__file__), "..")
NAMED = re.compile(r"tests/(\w+\.py)::(\w+)")


def test_every_test_named_in_the_survivor_tables_exists():
    with open(os.path.join(ROOT, "docs", "testing.md")) as file:
        rows = [line for line in file if line.startswith("| `minimp.")]
    assert len(rows) > 500  # the tables are there
    missing = []
    for path, name in sorted({m for row in rows for m in NAMED.findall(row)}):
        full = os.path.join(ROOT, "tests", path)
        source = open(full).read() if os.path.exists(full) else ""
        if not re.search(rf"^\s*def {name}\(", source, re.M):
            missing.append(f"tests/{path}::{name}")
    assert not missing, missing
