"""Mutation-test results kept in the repository, so that a mutmut run goes on in a later session.

    python scripts/mutation_state.py save      # mutants/**/*.meta -> docs/mutation_results.json
    python scripts/mutation_state.py restore   # docs/mutation_results.json -> mutants/**/*.meta
    nice -n 19 mutmut run --max-children 2     # after restore: checks only what is not known

mutmut keeps its results in mutants/ (a generated tree, ignored by git), which a clean clone does
not have, and a whole run over minimp's scope does not fit one session on 2 cores (docs/testing.md).
`save` writes, per source file, mutmut's hash of each function and the exit code of each checked
mutant. `restore`, on a clone without mutants/, writes them back as the .meta files mutmut reads;
when `mutmut run` then generates the mutants, it keeps a stored result only where the function's
hash is unchanged (mutmut's own rule when it regenerates a file), so an edited function is checked
again. restore keeps the detected mutants (killed, timeout, segfault) and the survivors whose
entry under the file's "survivors" says equivalent; every other result (a survivor, a mutant no
test reached) is left for the run to redo, since the tests may have changed since it was saved;
`save` keeps what the results file holds for a mutant the run did not check, while its function's
hash is unchanged, so a run stopped before it reran them does not lose them, and it keeps the
survivors' entries, which are written by hand. A detected mutant stays
detected unless a test was removed or weakened: for a score after such a change, rerun it
(`mutmut run NAME`) or start fresh.
"""

import argparse
import glob
import json
import os
import sys

from mutation_score import DETECTED, documented
from mutmut import __version__ as mutmut_version
from mutmut.stats import status_by_exit_code

RESULTS = os.path.join("docs", "mutation_results.json")


def function_of(mutant: str) -> str:
    """The mangled name of its function, as mutmut hashes it: `a.b.x_f__mutmut_3` -> `x_f`."""
    return mutant.rsplit("__mutmut_", 1)[0].rsplit(".", 1)[1]


def save(mutants_dir: str, results_path: str) -> int:
    """Write every .meta file's hashes and non-empty exit codes; returns the mutants saved. The
    file's other keys (the survivors' entries, written by hand) are kept as they are.

    A result the results file already holds is kept for a mutant this run did not check, while
    its function's hash is unchanged: restore leaves undocumented survivors out for a rerun, and a
    run stopped before it reached them must not lose that they were checked and survived. A file
    this run did not mutate at all (a narrower `only_mutate`) keeps its entry as it is while the
    source file exists (mutants/ lies in the project's root); the entry of a source file that is
    gone (moved, merged, deleted) is dropped: its mutants name a module that no longer exists."""
    files, saved = {}, 0
    stored = {"files": {}}
    if os.path.exists(results_path):
        with open(results_path) as file:
            stored = json.load(file)
    previous = stored["files"]
    root = os.path.dirname(os.path.abspath(mutants_dir))
    pattern = os.path.join(mutants_dir, "**", "*.py.meta")
    for meta_path in sorted(glob.glob(pattern, recursive=True)):
        with open(meta_path) as file:
            meta = json.load(file)
        source = os.path.relpath(meta_path, mutants_dir)[: -len(".meta")]
        hashes = meta["hash_by_function_name"]
        codes = {name: code for name, code in meta["exit_code_by_key"].items() if code is not None}
        before = previous.get(source, {"hashes": {}, "exit_codes": {}})
        for name, code in before["exit_codes"].items():
            function = function_of(name)
            if name not in codes and before["hashes"].get(function) == hashes.get(function):
                codes[name] = code
        files[source] = {"hashes": hashes, "exit_codes": dict(sorted(codes.items()))}
        saved += len(codes)
    for source, entry in previous.items():
        if source not in files and os.path.exists(os.path.join(root, source)):
            files[source] = entry
            saved += len(entry["exit_codes"])
    with open(results_path, "w") as file:
        json.dump({**stored, "mutmut": mutmut_version, "files": files}, file, indent=0,
                  sort_keys=True)
        file.write("\n")
    return saved


def kept(name: str, code: int, why: dict[str, str]) -> bool:
    status = status_by_exit_code[code]
    return status in DETECTED or why.get(name, "").lower().startswith("equivalent")


def restore(mutants_dir: str, results_path: str) -> int:
    """Write .meta files mutmut will merge with the mutants it generates; returns the results
    kept. Refuses to overwrite a mutants/ that already holds results."""
    if glob.glob(os.path.join(mutants_dir, "**", "*.py.meta"), recursive=True):
        raise SystemExit(
            f"mutation_state: {mutants_dir}/ already holds results; `mutmut run` resumes from "
            f"them as they are (remove {mutants_dir}/ first to restore {results_path})"
        )
    if not os.path.exists(results_path):
        raise SystemExit(f"mutation_state: no {results_path}: `save` after a run writes it")
    with open(results_path) as file:
        stored = json.load(file)["files"]
    why, restored = documented(results_path), 0
    for source, entry in stored.items():
        codes = {n: c for n, c in entry["exit_codes"].items() if kept(n, c, why)}
        meta = {
            "exit_code_by_key": codes,
            "hash_by_function_name": entry["hashes"],
            "type_check_error_by_key": {},
            "durations_by_key": {},
            "estimated_durations_by_key": {},
        }
        meta_path = os.path.join(mutants_dir, source + ".meta")
        os.makedirs(os.path.dirname(meta_path), exist_ok=True)
        with open(meta_path, "w") as file:
            json.dump(meta, file)
        restored += len(codes)
    return restored


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("--mutants", default="mutants")
    parser.add_argument("--results", default=RESULTS)
    args = parser.parse_args(argv)
    if args.action == "save":
        if not os.path.isdir(args.mutants):
            raise SystemExit(f"mutation_state: no {args.mutants}/ here: run `mutmut run` first")
        count = save(args.mutants, args.results)
        print(f"mutation_state: {count} results of {args.mutants}/ saved in {args.results}")
    else:
        count = restore(args.mutants, args.results)
        print(f"mutation_state: {count} results restored into {args.mutants}/; now `mutmut run`")
    return 0


if __name__ == "__main__":
    sys.exit(main())
