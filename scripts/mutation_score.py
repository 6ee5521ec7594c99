"""The mutation score of the last `mutmut run`, by package, survivors judged by their entries.

    nice mutmut run --max-children 2        # resumable: results stay in mutants/
    python scripts/mutation_score.py        # the score table
    python scripts/mutation_score.py --undocumented   # survivors with no entry yet

A mutant is detected when a test failed (killed), ran past mutmut's time limit (timeout: the mutant
made the code loop or crawl, which a test run notices) or crashed the interpreter (segfault).
Each survivor examined has an entry under "survivors" in docs/mutation_results.json. Survivors
whose entry says "equivalent" (no input tells them apart from the code) leave the denominator;
every other survivor, and every mutant no test reaches, counts against the score. "killed since"
counts the survivors whose entry says a test written after the run kills them (each checked by
hand against that one mutant); "now" counts them as detected, the score the next run should show
for the mutants this one checked; "survived" is the rest.
"""

import argparse
import collections
import glob
import json
import os
import sys

from mutmut.stats import status_by_exit_code

DETECTED = ("killed", "timeout", "segfault")
PACKAGES = (
    "minimp.ops", "minimp.precision", "minimp.optim", "minimp.distributed", "minimp.parallel",
    "minimp.train.loop",
)  # fmt: skip
RESULTS = os.path.join("docs", "mutation_results.json")


def statuses(mutants_dir: str) -> dict[str, str]:
    """{mutant name: status} over every .meta file mutmut wrote."""
    found = {}
    for path in glob.glob(os.path.join(mutants_dir, "**", "*.py.meta"), recursive=True):
        with open(path) as file:
            codes = json.load(file).get("exit_code_by_key", {})
        found.update({name: status_by_exit_code[code] for name, code in codes.items()})
    return found


def documented(results_path: str) -> dict[str, str]:
    """{mutant name: why} from the "survivors" of the results file: one entry per survivor,
    {"change": what it changes, "why": "equivalent: ..." or "killed by tests/...", "tests": [the
    test ids `why` names], ...}."""
    with open(results_path) as file:
        survivors = json.load(file).get("survivors", {})
    return {name: entry["why"] for name, entry in survivors.items()}


def package_of(name: str) -> str:
    module = name.split("__mutmut_")[0].rsplit(".", 1)[0]  # minimp.ops.softmax.x_cross_entropy
    return next((p for p in PACKAGES if module == p or module.startswith(p + ".")), "other")


def score_table(found: dict[str, str], why: dict[str, str]) -> list[dict]:
    rows: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for name, status in found.items():
        if package_of(name) == "other":  # left from a run with a wider scope: not counted
            continue
        row = rows[package_of(name)]
        row["mutants"] += 1
        if status in DETECTED:
            row["detected"] += 1
        elif status == "survived" and why.get(name, "").lower().startswith("equivalent"):
            row["equivalent"] += 1
        elif status == "survived" and why.get(name, "").lower().startswith("killed"):
            row["killed since"] += 1  # by a test written after the run: checked by hand
        else:
            row[status] += 1
    table = []
    rows["all"] = sum(rows.values(), collections.Counter())
    for package in sorted(rows, key=lambda p: (p == "all", p)):
        row = rows[package]
        counted = row["mutants"] - row["equivalent"] - row["not checked"]
        score = row["detected"] / max(counted, 1)
        now = (row["detected"] + row["killed since"]) / max(counted, 1)
        table.append({"package": package, **row, "score": score, "score now": now})
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mutants", default="mutants", help="mutmut's folder (default: mutants)")
    parser.add_argument("--results", default=RESULTS, help=f"the survivors' entries ({RESULTS})")
    parser.add_argument(
        "--undocumented", action="store_true", help="list the survivors with no entry"
    )
    args = parser.parse_args(argv)
    if not os.path.isdir(args.mutants):
        raise SystemExit(f"mutation_score: no {args.mutants}/ here: run `mutmut run` first")
    found, why = statuses(args.mutants), documented(args.results)
    if args.undocumented:
        for name in sorted(n for n, status in found.items() if status == "survived"):
            if name not in why:
                print(name)
        return 0
    columns = ("mutants", "detected", "survived", "killed since", "equivalent", "no tests",
               "not checked")  # fmt: skip
    header = "".join(f"{c:>13s}" for c in columns)
    print(f"{'package':20s}{header}{'score':>8s}{'now':>8s}")
    for row in score_table(found, why):
        cells = "".join(f"{row.get(c, 0):13d}" for c in columns)
        print(f"{row['package']:20s}{cells}{row['score']:8.1%}{row['score now']:8.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
