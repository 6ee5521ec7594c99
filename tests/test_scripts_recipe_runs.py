"""scripts/recipe_runs.py: docs/fp8.md's recipe table from metrics files, by hand on two bf16 seeds
and two recipes (one inside its bound, one outside), and one line on bad input."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import recipe_runs  # noqa: E402

# 10 parameters: bf16 weights 20 bytes, float32 sums and masters 40 each, Adam's state 80
KINDS = {"parameters": 20, "accumulators": 40, "masters": 40, "optimizer_state": 80}


def write_run(folder, name, val_loss, seconds):
    rows = [{"step": step, "compute_seconds": s} for step, s in enumerate(seconds, 1)]
    rows.append({"val_loss": val_loss, "model_state_by_kind": [KINDS]})
    path = folder / name
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def test_the_table_by_hand(tmp_path, capsys):
    # bf16: mean 2.0, spread 0.1, so the fp8 bound is max(0.02, 0.2) = 0.2, NVFP4's max(0.06, 0.2)
    paths = [write_run(tmp_path, "bf16_s0.jsonl", 1.95, [0.1, 0.3, 0.2]),
             write_run(tmp_path, "bf16_s1.jsonl", 2.05, [0.2]),
             write_run(tmp_path, "mxfp8_s0.jsonl", 2.1, [0.4]),  # mean 2.15: +7.5%, inside 0.2
             write_run(tmp_path, "mxfp8_s1.jsonl", 2.2, [0.4]),
             write_run(tmp_path, "nvfp4_s0.jsonl", 2.3, [0.5])]  # +15%: outside
    assert recipe_runs.main(paths) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2] == "| bf16 | 1.9500 | 2.0500 | 2.0000 |  |  |  | 0.200 | 18 |"
    assert lines[3] == "| mxfp8 | 2.1000 | 2.2000 | 2.1500 | +7.50% | 0.2000 | yes | 0.400 | 18 |"
    assert lines[4] == "| nvfp4 | 2.3000 |  | 2.3000 | +15.00% | 0.2000 | NO | 0.500 | 18 |"


def test_bad_files_are_one_line_and_exit_2(tmp_path, capsys):
    unfinished = tmp_path / "bf16_s0.jsonl"
    unfinished.write_text(json.dumps({"step": 1, "compute_seconds": 0.1}) + "\n")
    not_json = tmp_path / "mxfp8_s0.jsonl"
    not_json.write_text("{bad\n")
    misnamed = write_run(tmp_path, "run.jsonl", 2.0, [0.1])
    only_recipe = write_run(tmp_path, "rowwise_s0.jsonl", 2.0, [0.1])
    for args in ([str(unfinished)], [str(not_json)], [misnamed], [only_recipe],
                 [str(tmp_path / "missing_s0.jsonl")]):
        assert recipe_runs.main(args) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 5 and all(line.startswith("recipe_runs: ") for line in errors)
    assert "did the run end" in errors[0] and "not a --metrics file" in errors[1]
    assert "<recipe>_s<seed>" in errors[2] and "no bf16 runs" in errors[3]
