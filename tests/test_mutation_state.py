"""scripts/mutation_state.py: mutmut's results saved in the repository, restored as .meta files."""

import json
import os
import sys

import pytest

pytest.importorskip("mutmut", reason="no mutmut: pip install -e '.[mutation]' installs it")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import mutation_state  # noqa: E402

# killed, survived (equivalent), survived (killed since), no tests, not checked, timeout
CODES = dict(enumerate([1, 0, 0, 33, None, 36], start=1))
CODES = {f"pkg.f.x_g__mutmut_{number}": code for number, code in CODES.items()}
DOC = (
    "| `pkg.f.x_g__mutmut_2` | c | equivalent: no input |\n"
    "| `pkg.f.x_g__mutmut_3` | c | killed by t |\n"
)


def write_meta(folder, codes):
    os.makedirs(folder / "pkg")
    meta = dict.fromkeys(("type_check_error_by_key", "durations_by_key"), {})
    meta.update(exit_code_by_key=codes, hash_by_function_name={"x_g": "abc"})
    meta["estimated_durations_by_key"] = {}
    (folder / "pkg" / "f.py.meta").write_text(json.dumps(meta))


def test_restore_keeps_detected_and_equivalent_results_and_leaves_the_rest_to_rerun(tmp_path):
    write_meta(tmp_path / "old", CODES)
    (tmp_path / "testing.md").write_text(DOC)
    results = tmp_path / "results.json"
    assert mutation_state.save(str(tmp_path / "old"), str(results)) == 5  # the unchecked one: not
    doc = str(tmp_path / "testing.md")
    assert mutation_state.restore(str(tmp_path / "new"), str(results), doc) == 3
    meta = json.loads((tmp_path / "new" / "pkg" / "f.py.meta").read_text())
    # killed (1) and timeout (36) stay; the survivor called equivalent stays; the survivor a test
    # now kills, and the mutant no test reached (33), are run again
    assert meta["exit_code_by_key"] == {"pkg.f.x_g__mutmut_1": 1, "pkg.f.x_g__mutmut_2": 0,
                                        "pkg.f.x_g__mutmut_6": 36}  # fmt: skip
    # the hash stays with the codes: mutmut reruns a function whose hash has moved
    assert meta["hash_by_function_name"] == {"x_g": "abc"}


def test_restore_refuses_to_overwrite_results_and_names_a_missing_file(tmp_path):
    write_meta(tmp_path / "mutants", CODES)
    with pytest.raises(SystemExit, match="already holds results"):
        mutation_state.restore(str(tmp_path / "mutants"), str(tmp_path / "r.json"), "doc")
    with pytest.raises(SystemExit, match="no .*nothing.json"):
        mutation_state.restore(str(tmp_path / "empty"), str(tmp_path / "nothing.json"), "doc")


def test_a_row_whose_cells_hold_escaped_pipes_is_read(tmp_path):
    """Markdown writes a pipe inside a cell as `\\|`: such a row still documents its mutant."""
    import mutation_score

    doc = tmp_path / "testing.md"
    doc.write_text("| `m.x_f__mutmut_5` | `a \\| b` -> `a & b` | equivalent: `x \\| y` is y |\n")
    assert mutation_score.documented(str(doc)) == {"m.x_f__mutmut_5": "equivalent: `x \\| y` is y"}
