"""What a run writes and reads: outputs checked before the first step, atomic files, checkpoints
validated field by field, --save-every, metrics that never repeat a step, runs that diverge."""

import json
import os
import signal
import stat
import subprocess
import time

import numpy as np
import pytest
from conftest import PYTHON

from minimp.checkpoints import files
from minimp.checkpoints.errors import AgreedError, ConfigError, DivergenceError
from minimp.train.config import TrainConfig
from minimp.train.guards import Guards

SMALL = ["--hidden", "16", "--layers", "1", "--log-every", "1000"]


def run_command(*flags, timeout=120):
    return subprocess.run(
        [PYTHON, "-m", "minimp.train", *SMALL, *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def unwritable_folder(tmp_path):
    """A folder no file can be created in: read-only for a normal user; root ignores file modes,
    so for root a path inside /proc (a file system that refuses new files)."""
    if os.geteuid() == 0:
        return "/proc/minimp-no-such-folder"
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o500)
    return str(folder)


@pytest.mark.parametrize("flag", ["--save", "--metrics", "--timeline", "--plot"])
def test_an_unwritable_output_is_refused_before_the_first_step(tmp_path, flag):
    name = "out.png" if flag == "--plot" else "out.file"
    result = run_command(flag, os.path.join(unwritable_folder(tmp_path), name), "--steps", "5")
    assert result.returncode == 2, result.stderr
    assert f"minimp.train: error: {flag}" in result.stderr and "cannot be written" in result.stderr
    assert "step" not in result.stdout  # no work was done


def test_outputs_that_are_folders_or_of_an_unknown_image_type_are_refused(tmp_path):
    result = run_command("--save", str(tmp_path))
    assert result.returncode == 2 and "is a folder" in result.stderr
    result = run_command("--plot", str(tmp_path / "run.xyz"))
    assert result.returncode == 2 and "use one of the extensions" in result.stderr


def test_an_output_that_is_a_device_or_a_pipe_is_refused_and_left_as_it_is(tmp_path):
    """The save renames its file into place: over /dev/null or /dev/full (a new user's --save
    /dev/full, run as root, replaced the device node) it would replace the node itself."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for flag in ("--save", "--metrics", "--timeline"):
        result = run_command(flag, str(pipe))
        assert result.returncode == 2 and "is not a regular file" in result.stderr, flag
        assert len(result.stderr.strip().splitlines()) == 1 and "step" not in result.stdout
    assert stat.S_ISFIFO(os.stat(pipe).st_mode)  # still a pipe
    result = subprocess.run([PYTHON, "-m", "minimp.export", str(pipe), str(pipe)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and stat.S_ISFIFO(os.stat(pipe).st_mode)


def test_missing_folders_of_an_output_are_made(tmp_path):
    metrics = tmp_path / "new" / "folder" / "m.jsonl"
    assert run_command("--steps", "2", "--metrics", str(metrics)).returncode == 0
    assert len(metrics.read_text().splitlines()) == 3  # two steps and the summary


def test_files_get_the_user_s_mode_and_a_killed_write_leaves_nothing(tmp_path):
    path = tmp_path / "file.bin"
    old_mask = os.umask(0o022)
    try:
        files.atomic_write(str(path), lambda file: file.write(b"first"))
    finally:
        os.umask(old_mask)
    assert path.stat().st_mode & 0o777 == 0o644 and path.read_bytes() == b"first"

    def killed(file):
        file.write(b"half")
        raise SystemExit(143)  # what SIGTERM becomes (files.exit_cleanly_on_sigterm)

    with pytest.raises(SystemExit):
        files.atomic_write(str(path), killed)
    assert path.read_bytes() == b"first" and os.listdir(tmp_path) == ["file.bin"]


def test_a_temporary_file_left_by_a_kill_9_is_removed_by_the_next_save(tmp_path):
    stale = tmp_path / f".ckpt.npz.abc123{files.TEMPORARY_SUFFIX}"
    stale.write_bytes(b"half a checkpoint")
    (tmp_path / "other.tmp").write_bytes(b"not ours")
    files.atomic_write(str(tmp_path / "ckpt.npz"), lambda file: file.write(b"whole"))
    assert sorted(os.listdir(tmp_path)) == ["ckpt.npz", "other.tmp"]


def test_resuming_keeps_only_the_metrics_rows_up_to_the_checkpoint(tmp_path):
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "c.npz"
    assert run_command("--steps", "6", "--metrics", str(metrics)).returncode == 0
    assert run_command("--steps", "4", "--save", str(ckpt)).returncode == 0
    # the first run got to step 6; resuming the step-4 checkpoint must not leave steps 5, 6 twice
    result = run_command("--steps", "8", "--resume", str(ckpt), "--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line).get("step") for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6, 7, 8, None]


def test_save_every_survives_a_kill_9_and_the_run_resumes_from_it(tmp_path):
    ckpt = tmp_path / "ckpt.npz"
    command = [PYTHON, "-m", "minimp.train", *SMALL, "--steps", "100000", "--save", str(ckpt)]
    job = subprocess.Popen([*command, "--save-every", "20"], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ckpt.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(0.3)
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    with np.load(ckpt) as archive:
        step = json.loads(str(archive["meta"]))["step"]
    assert step % 20 == 0 and step >= 20
    # A kill that lands inside a save leaves that save's temporary file (nothing can delete it
    # then), never a damaged checkpoint; the next save of the same path removes it. One such
    # leftover is made here for certain, whatever moment the kill hit.
    (tmp_path / f".{ckpt.name}.stale{files.TEMPORARY_SUFFIX}").write_bytes(b"half a save")
    result = run_command("--steps", str(step + 3), "--resume", str(ckpt), "--save", str(ckpt))
    assert result.returncode == 0 and f"resumed from {ckpt} after step {step}" in result.stdout
    assert not [name for name in os.listdir(tmp_path) if name.endswith(files.TEMPORARY_SUFFIX)]


def make_checkpoint_variants(good, folder):
    """{name: path} of damaged copies of a good checkpoint, one fault each."""
    with np.load(good) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(str(arrays["meta"]))

    def variant(name, change_meta=None, change_arrays=None):
        new_meta, new_arrays = json.loads(json.dumps(meta)), dict(arrays)
        if change_meta:
            change_meta(new_meta)
        if change_arrays:
            change_arrays(new_arrays)
        new_arrays["meta"] = np.array(json.dumps(new_meta))
        np.savez(folder / f"{name}.npz", **new_arrays)

    weight = "master/0.weight"
    variant("no-step", lambda m: m.pop("step"))
    variant("negative-step", lambda m: m.update(step=-3))
    variant("fractional-step", lambda m: m.update(step=2.5))
    variant("flags-not-an-object", lambda m: m.update(flags=[1, 2]))
    variant("zero-scale", lambda m: m["scaler"].update(loss_scale=0))
    variant("nan-scale", lambda m: m["scaler"].update(loss_scale=float("nan")))
    variant("bad-scaler-kind", lambda m: m["scaler"].update(kind="weird"))
    variant("bad-tracker", lambda m: m["scaler"].update(growth_tracker=-5))
    variant("newer-version", lambda m: m.update(version=99))
    variant("bad-lr", lambda m: m["optimizer"].update(lr=-1))
    variant("nan-weights", change_arrays=lambda a: a.update({weight: a[weight] * np.nan}))
    variant("float16-weights", change_arrays=lambda a: a.update({weight: a[weight].astype("f2")}))
    variant("missing-slot", change_arrays=lambda a: a.pop("optimizer/0.weight/exp_avg"))
    variant(
        "wrong-slot-shape",
        change_arrays=lambda a: a.update({"optimizer/0.weight/exp_avg": np.zeros(3, "f4")}),
    )
    np.save(folder / "array.npy", np.zeros(3))
    os.replace(folder / "array.npy", folder / "npy-renamed.npz")
    (folder / "truncated.npz").write_bytes(good.read_bytes()[:300])


BAD_CHECKPOINTS = {
    "no-step": "metadata lacks 'step'",
    "negative-step": "step -3 is not an integer >= 0",
    "fractional-step": "step 2.5 is not an integer >= 0",
    "flags-not-an-object": "flags is [1, 2], not a JSON object",
    "zero-scale": "loss scale 0 is not a positive finite number",
    "nan-scale": "loss scale nan is not a positive finite number",
    "bad-scaler-kind": "loss scaler kind 'weird'",
    "bad-tracker": "growth_tracker must be an integer >= 0",
    "newer-version": "written by a newer minimp (format version 99",
    "bad-lr": "optimizer lr -1 is not a positive finite number",
    "nan-weights": "master/0.weight holds inf or NaN",
    "float16-weights": "master/0.weight is float16",
    "missing-slot": "lacks optimizer/0.weight/exp_avg",
    "wrong-slot-shape": "optimizer/0.weight/exp_avg is float32 of shape (3,)",
    "npy-renamed": "holds a single array, not an .npz archive",
    "truncated": "not a readable minimp checkpoint",
}


@pytest.fixture(scope="module")
def checkpoint_variants(tmp_path_factory):
    folder = tmp_path_factory.mktemp("variants")
    good = folder / "good.npz"
    assert run_command("--steps", "3", "--save", str(good)).returncode == 0
    make_checkpoint_variants(good, folder)
    return folder


@pytest.mark.parametrize("name", sorted(BAD_CHECKPOINTS))
def test_a_damaged_checkpoint_is_one_line_naming_the_file_and_the_fault(checkpoint_variants, name):
    path = checkpoint_variants / f"{name}.npz"
    result = run_command("--steps", "10", "--resume", str(path))
    assert result.returncode == 2
    assert result.stderr.startswith(f"minimp.train: error: checkpoint {path}")
    assert BAD_CHECKPOINTS[name] in result.stderr and len(result.stderr.splitlines()) == 1
    assert "resumed from" not in result.stdout


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "3"], "saved after step 3; --steps 3 leaves nothing to run"),
        (["--batch-size", "32"], "trained with --batch-size 64, this run has --batch-size 32"),
        (["--seed", "1"], "trained with --seed 0, this run has --seed 1"),
        (["--optimizer", "sgd"], "trained with --optimizer adam, this run has --optimizer sgd"),
        (["--inject-fault", "2:0"], "--inject-fault 2:0 can never fire: this run takes steps 4"),
    ],
)
def test_a_resume_that_cannot_continue_correctly_is_refused(checkpoint_variants, flags, message):
    flags = ["--steps", "10", *flags] if "--steps" not in flags else flags
    result = run_command("--resume", str(checkpoint_variants / "good.npz"), *flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr


def test_a_resume_may_change_the_learning_rate(checkpoint_variants):
    good = checkpoint_variants / "good.npz"
    result = run_command("--resume", str(good), "--steps", "5", "--lr", "0.01")
    assert result.returncode == 0 and "resumed from" in result.stdout


def test_a_run_whose_steps_are_all_skipped_stops_with_the_likely_cause(tmp_path):
    ckpt = tmp_path / "never.npz"
    result = run_command("--lr", "1e4", "--max-consecutive-skips", "10", "--save", str(ckpt))
    assert result.returncode == 1
    assert result.stderr.count("error: the last 10 steps") == 1 and "(--lr)" in result.stderr
    assert not ckpt.exists()  # a diverged run saves nothing


def test_a_non_finite_loss_on_a_step_that_was_taken_stops_at_once():
    guards = Guards(TrainConfig(steps=10), rank=0, start_step=0, world_size=1)
    guards.stop_if_diverging(7, 2.5, skipped=False, loss_scale=1.0)
    with pytest.raises(AgreedError) as stopped:
        guards.stop_if_diverging(8, float("nan"), skipped=False, loss_scale=1.0)
    assert isinstance(stopped.value.error, DivergenceError) and stopped.value.exit_code == 1
    assert "step 8: the loss is nan" in str(stopped.value)


def test_check_output_path_creates_nothing_but_folders(tmp_path):
    files.check_output_path("--save", str(tmp_path / "a" / "b.npz"))
    assert os.listdir(tmp_path / "a") == []
    (tmp_path / "a" / "file").write_text("a file, not a folder")
    with pytest.raises(ConfigError, match="a/file is a file, not a folder"):
        files.check_output_path("--save", str(tmp_path / "a" / "file" / "c.npz"))


def test_ctrl_c_is_one_line_exit_130_and_the_checkpoint_stays(tmp_path):
    """SIGINT (Ctrl-C) used to print a KeyboardInterrupt traceback."""
    ckpt = tmp_path / "ckpt.npz"
    command = [PYTHON, "-m", "minimp.train", *SMALL, "--steps", "100000", "--save", str(ckpt)]
    job = subprocess.Popen(
        [*command, "--save-every", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130
    assert stderr.strip() == "minimp.train: interrupted; files already saved are intact"
    with np.load(ckpt) as archive:
        assert json.loads(str(archive["meta"]))["step"] % 20 == 0
