"""scripts/fit_machine_models.py: the shipped model is the medians of the runs' terms, fitted."""

import importlib.util
import json
import os

import numpy as np
import pytest

from minimp.measure.calibrate import PRETENDED_RANKS, ring_step_line
from minimp.measure.machinemodel import MachineModel, fit_lines

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "fit_machine_models.py")
spec = importlib.util.spec_from_file_location("fit_machine_models", SCRIPT)
fit_machine_models = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fit_machine_models)

SIZES = [12, 24, 48, 96, 192]


def run(scale: float, ranks: int = 2) -> dict:
    """One allreduce_bench --json report whose terms are `scale` times a base, and its rows."""
    terms = {
        "agree": 5e-6 * scale,
        "python": {
            name: [1e-6 * p * scale for p in PRETENDED_RANKS]
            for name in ("ring", "recursive_doubling", "naive")
        },
        "sizes": SIZES,
        "message": [(6e-6 + 1e-9 * n) * scale for n in SIZES],
        "reduce": [(1e-7 + 4e-10 * n) * scale for n in SIZES],
        "ring_step": [(20e-6 + 3e-9 * n) * scale for n in SIZES],
        "ring_step_python": 4e-6 * scale,
    }
    rows = [
        {"bytes": n, "ring": 1e-4, "recursive_doubling": 1e-4, "naive": 1e-4} for n in (64, 128)
    ]
    return {"ranks": ranks, "terms": terms, "rows": rows}


def test_the_shipped_model_fits_the_median_of_each_term():
    runs = [run(1.0), run(3.0), run(2.0)]  # medians: the scale-2 run's terms
    model = fit_machine_models.fit_from_runs(runs)
    middle = runs[2]["terms"]
    assert model.agree == pytest.approx(middle["agree"])
    messages = np.median([r["terms"]["message"] for r in runs], axis=0)
    assert model.message == fit_lines(SIZES, list(messages))
    assert model.ring_step == ring_step_line(SIZES, middle["ring_step"], 8e-6)
    assert model.ring_step(96) == pytest.approx(2 * (20e-6 + 3e-9 * 96) - 8e-6)
    assert model.name == "shipped: medians of 3 runs" and model.ranks == 2


def test_runs_of_different_sizes_are_refused():
    other = run(1.0)
    other["terms"]["sizes"] = SIZES[:-1] + [384]
    with pytest.raises(SystemExit, match="different sizes"):
        fit_machine_models.fit_from_runs([run(1.0), other])


def test_main_writes_models_and_the_band_of_the_held_out_runs(tmp_path):
    paths = []
    for i, scale in enumerate((1.0, 2.0, 3.0)):
        path = tmp_path / f"p2-{i}.json"
        path.write_text(json.dumps(run(scale)))
        paths.append(str(path))
    fresh = run(1.0)
    fresh["terms"] = None  # a --no-calibration launch: evaluated only
    fresh["rows"][0]["ring"] = 2e-4
    (tmp_path / "e2.json").write_text(json.dumps(fresh))
    out = tmp_path / "models.json"
    assert fit_machine_models.main(paths + [str(tmp_path / "e2.json"), "--out", str(out)]) == 0
    document = json.loads(out.read_text())
    assert document["runs"] == {"2": 3} and document["evaluated_runs"] == {"2": 1}
    model = MachineModel.from_dict(document["models"]["2"])
    assert model == fit_machine_models.fit_from_runs([run(1.0), run(2.0), run(3.0)])
    band = document["held_out"]["2"]["ring"]
    ring = model.allreduce_time
    errors = [ring("ring", 64) / 2e-4 - 1, ring("ring", 128) / 1e-4 - 1]
    assert band["worst"] == [pytest.approx(max(map(abs, errors)))] * 2


def test_an_out_that_holds_another_kind_of_file_is_refused_before_any_work(tmp_path, capsys):
    """--out onto a checkpoint used to write the JSON over it."""
    ckpt = tmp_path / "c.npz"
    np.savez(ckpt, a=np.zeros(2))
    before = ckpt.read_bytes()
    with pytest.raises(SystemExit) as exited:
        fit_machine_models.main([str(tmp_path / "missing-run.json"), "--out", str(ckpt)])
    assert exited.value.code == 2 and ckpt.read_bytes() == before
    error = capsys.readouterr().err  # `PROG: error: ...`, PROG being pytest's name in here
    assert error.split(": ", 1)[1] == (
        f"error: --out {ckpt} exists and holds a zip archive that is not a minimp checkpoint (an "
        ".npz, a .docx?), which this output would replace; choose another path\n")
