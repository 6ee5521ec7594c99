"""Checkpoints written by an earlier minimp still resume, and continue to the same bits.

tests/data/main_faa207f_*.npz were written by main at faa207f (before the redesign), under the
suite's OpenBLAS kernel (conftest.py), with
  G="--dataset shakespeare --layers 1 --hidden 16 --heads 2 --context 8 --batch-size 4
     --eval-batches 1 --precision fp8"
  python -m minimp.train $G --steps 2 --save gpt_fp8.npz
  python -m minimp.train $G --steps 3 --resume gpt_fp8.npz --save gpt_fp8_resumed.npz
  M="--layers 2 --hidden 16"
  python -m minimp.train $M --steps 3 --save mlp_fp16.npz
  python -m minimp.train $M --steps 4 --resume mlp_fp16.npz --save mlp_fp16_resumed.npz
Resuming the first of each pair today must write the second, array for array and bit for bit.
"""

import json
import os

import numpy as np
import pytest

from minimp.train import parse_config, train

DATA = os.path.join(os.path.dirname(__file__), "data")
GPT = "--dataset shakespeare --layers 1 --hidden 16 --heads 2 --context 8 --batch-size 4 "
GPT += "--eval-batches 1 --precision fp8"
CASES = {
    "gpt_fp8": (GPT, 3),
    "mlp_fp16": ("--layers 2 --hidden 16", 4),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_checkpoint_of_main_before_the_redesign_resumes_to_the_same_bits(name, tmp_path):
    flags, steps = CASES[name]
    saved = str(tmp_path / "resumed.npz")
    resume = os.path.join(DATA, f"main_faa207f_{name}.npz")
    config = parse_config([*flags.split(), "--steps", str(steps), "--resume", resume])
    config.save = saved
    train(config, log=lambda line: None)
    with np.load(os.path.join(DATA, f"main_faa207f_{name}_resumed.npz")) as expected:
        with np.load(saved) as written:
            assert sorted(written.files) == sorted(expected.files)
            assert json.loads(str(written["meta"])) == json.loads(str(expected["meta"]))
            for key in expected.files:
                if key != "meta":
                    assert written[key].dtype == expected[key].dtype, key
                    assert written[key].tobytes() == expected[key].tobytes(), key
