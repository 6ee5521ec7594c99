"""scripts/moe_balance.py: docs/moe.md's balance table from a metrics file, by hand on two steps of
two blocks, and one line on bad input."""

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "scripts"))
import moe_balance  # noqa: E402


def test_the_worst_block_each_block_and_the_sum_by_hand(tmp_path, capsys):
    # step 1: block 0 [3, 1] (max/mean 1.5), block 1 [1, 3] (1.5); summed [4, 4] (1.0)
    # step 2: block 0 [2, 2] (1.0), block 1 [4, 0] (2.0); summed [6, 2] (1.5)
    rows = [{"step": 1, "expert_load_by_block": [[3, 1], [1, 3]], "expert_load_imbalance": 1.5},
            {"step": 2, "expert_load_by_block": [[2, 2], [4, 0]], "expert_load_imbalance": 2.0},
            {"val_loss": 1.25}]
    result = moe_balance.balance(rows, 1, 2)
    assert result == {"worst": 1.75, "blocks": [1.25, 1.75], "summed": 1.25, "steps": 2}
    path = tmp_path / "m.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert moe_balance.main([str(path), "--steps", "1-2"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "steps 1-2 (2 rows): max/mean worst block 1.750; each block 1.250, 1.750; summed over "
        "the blocks 1.250", "final validation loss 1.250000"]


def test_a_run_without_experts_or_steps_is_one_line_and_exit_2(tmp_path, capsys):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    assert moe_balance.main([str(path), "--steps", "1-1"]) == 2
    assert moe_balance.main([str(path), "--steps", "5-9"]) == 2
    assert moe_balance.main([str(tmp_path / "missing.jsonl")]) == 2
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 3 and "expert_load_by_block" in errors[0] and "5-9" in errors[1]
