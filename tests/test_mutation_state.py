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
SURVIVORS = {
    "pkg.f.x_g__mutmut_2": {"change": "c", "why": "equivalent: no input", "tests": []},
    "pkg.f.x_g__mutmut_3": {"change": "c", "why": "killed by tests/t.py::t",
                            "tests": ["tests/t.py::t"]},
}


def write_meta(folder, codes):
    os.makedirs(folder / "pkg")
    meta = dict.fromkeys(("type_check_error_by_key", "durations_by_key"), {})
    meta.update(exit_code_by_key=codes, hash_by_function_name={"x_g": "abc"})
    meta["estimated_durations_by_key"] = {}
    (folder / "pkg" / "f.py.meta").write_text(json.dumps(meta))


def test_restore_keeps_detected_and_equivalent_results_and_leaves_the_rest_to_rerun(tmp_path):
    write_meta(tmp_path / "old", CODES)
    results = tmp_path / "results.json"
    results.write_text(json.dumps({"files": {}, "survivors": SURVIVORS}))
    assert mutation_state.save(str(tmp_path / "old"), str(results)) == 5  # the unchecked one: not
    assert json.loads(results.read_text())["survivors"] == SURVIVORS  # save keeps the entries
    assert mutation_state.restore(str(tmp_path / "new"), str(results)) == 3
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
        mutation_state.restore(str(tmp_path / "mutants"), str(tmp_path / "r.json"))
    with pytest.raises(SystemExit, match="no .*nothing.json"):
        mutation_state.restore(str(tmp_path / "empty"), str(tmp_path / "nothing.json"))


def test_the_survivors_verdicts_are_read_from_the_results_file(tmp_path):
    """mutation_score counts a survivor by its entry's "why"; a file with no entries yet (a first
    run) has none."""
    import mutation_score

    results = tmp_path / "results.json"
    results.write_text(json.dumps({"files": {}, "survivors": SURVIVORS}))
    assert mutation_score.documented(str(results)) == {
        name: entry["why"] for name, entry in SURVIVORS.items()
    }
    results.write_text(json.dumps({"files": {}}))
    assert mutation_score.documented(str(results)) == {}


def test_save_keeps_an_earlier_result_of_a_mutant_this_run_did_not_check_while_its_hash_holds(
    tmp_path,
):
    """restore leaves the survivors out to be rerun; a run stopped before it reached them would
    otherwise save them as never checked. A result this run has wins, and a function whose hash
    has moved loses its old results (its mutants are new)."""
    results = str(tmp_path / "results.json")
    write_meta(tmp_path / "first", CODES)
    assert mutation_state.save(str(tmp_path / "first"), results) == 5
    rerun = {"pkg.f.x_g__mutmut_1": 1, "pkg.f.x_g__mutmut_3": 1}  # _3 now killed, the rest unrun
    write_meta(tmp_path / "second", rerun)
    assert mutation_state.save(str(tmp_path / "second"), results) == 5
    with open(results) as file:
        saved = json.load(file)["files"]["pkg/f.py"]
    assert saved["exit_codes"] == {"pkg.f.x_g__mutmut_1": 1, "pkg.f.x_g__mutmut_2": 0,
                                   "pkg.f.x_g__mutmut_3": 1, "pkg.f.x_g__mutmut_4": 33,
                                   "pkg.f.x_g__mutmut_6": 36}  # fmt: skip
    write_meta(tmp_path / "edited", {"pkg.f.x_g__mutmut_1": 0})
    meta_path = tmp_path / "edited" / "pkg" / "f.py.meta"
    meta = json.loads(meta_path.read_text())
    meta["hash_by_function_name"] = {"x_g": "def"}
    meta_path.write_text(json.dumps(meta))
    assert mutation_state.save(str(tmp_path / "edited"), results) == 1


def test_a_mutant_s_function_is_the_mangled_name_mutmut_hashes():
    assert mutation_state.function_of("a.b.x_f__mutmut_12") == "x_f"
    assert mutation_state.function_of("a.b.xǁCǁ__init____mutmut_3") == "xǁCǁ__init__"


def test_save_keeps_the_entry_of_a_file_this_run_did_not_mutate_and_drops_one_whose_source_is_gone(
    tmp_path,
):
    """A run over a narrower only_mutate checks some files: the others' results stay, hashes and
    all (restore and mutmut still check each hash); a file moved or deleted since has no module
    its mutants could name, so its entry goes."""
    results = tmp_path / "results.json"
    kept = {"hashes": {"x_k": "k1"}, "exit_codes": {"pkg.g.x_k__mutmut_1": 1}}
    moved = {"hashes": {"x_m": "m1"}, "exit_codes": {"pkg.h.x_m__mutmut_1": 0}}
    results.write_text(json.dumps({"files": {"pkg/g.py": kept, "pkg/h.py": moved}}))
    write_meta(tmp_path / "mutants", {"pkg.f.x_g__mutmut_1": 1})
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "g.py").write_text("")  # pkg/h.py is gone
    assert mutation_state.save(str(tmp_path / "mutants"), str(results)) == 2
    saved = json.loads(results.read_text())["files"]
    assert saved == {"pkg/f.py": {"hashes": {"x_g": "abc"},
                                  "exit_codes": {"pkg.f.x_g__mutmut_1": 1}},
                     "pkg/g.py": kept}  # fmt: skip
