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
from minimp.checkpoints.errors import AgreedError, ConfigError, DivergenceError, Terminated
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
        raise Terminated()  # what SIGTERM becomes (files.exit_cleanly_on_sigterm)

    with pytest.raises(Terminated):
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
    variant("no-seed-flag", lambda m: m["flags"].pop("--seed"))
    variant("version-0", lambda m: m.update(version=0))
    variant("schedule-not-an-object", lambda m: m.update(schedule=[1]))
    variant("bad-decay-steps", lambda m: m["schedule"].update(lr_decay_steps="x"))
    variant("scale-true", lambda m: m["scaler"].update(loss_scale=True))
    variant("sgd-state", lambda m: m["optimizer"].update(kind="SGD"))
    variant("negative-exp-avg-sq", change_arrays=lambda a: a.update(
        {"optimizer/0.weight/exp_avg_sq": -np.abs(a["optimizer/0.weight/exp_avg_sq"]) - 1}))
    variant("hidden-as-text", lambda m: m["flags"].update({"--hidden": "16"}))
    (folder / "folder.npz").mkdir()  # a folder named like a checkpoint
    os.symlink(folder / "nowhere", folder / "dangling.npz")
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
    "wrong-slot-shape": "optimizer/0.weight/exp_avg has shape (3,), the model needs (16, 64)",
    "npy-renamed": "holds a single array, not an .npz archive",
    "truncated": "not a readable minimp checkpoint",
    "no-seed-flag": "its flags lack --seed, which a resume must repeat",
    "version-0": "format version 0 is unknown (this minimp reads versions 1 to 2)",
    "schedule-not-an-object": "schedule is [1], not a JSON object",
    "bad-decay-steps": "lr_decay_steps 'x' is not an integer >= 1",
    "folder": "is a folder, not a checkpoint file",
    "dangling": "is a link that leads nowhere",
    "scale-true": "loss scale True is not a positive finite number",
    "sgd-state": "holds SGD's state, this run's optimizer is Adam",
    "negative-exp-avg-sq": "optimizer/0.weight/exp_avg_sq holds negative values",
    "hidden-as-text": "trained with --hidden '16', this run has --hidden 16",
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


@pytest.mark.parametrize("sent, code, word", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated")],
                         ids=["ctrl-c", "sigterm"])
def test_a_signal_is_one_line_and_the_checkpoint_stays(tmp_path, sent, code, word):
    """SIGINT (Ctrl-C) used to print a KeyboardInterrupt traceback; SIGTERM exited 143 without
    a word."""
    ckpt = tmp_path / "ckpt.npz"
    command = [PYTHON, "-m", "minimp.train", *SMALL, "--steps", "100000", "--save", str(ckpt)]
    job = subprocess.Popen(
        [*command, "--save-every", "20"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not ckpt.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    job.send_signal(sent)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == code
    assert stderr.strip() == f"minimp.train: {word}; files already saved are intact"
    with np.load(ckpt) as archive:
        assert json.loads(str(archive["meta"]))["step"] % 20 == 0


def test_a_resume_across_loss_scalers_names_the_flags_and_the_fix(checkpoint_variants):
    """An fp16 checkpoint (dynamic scale) resumed in bf16 (none) used to blame "a none loss
    scaler"; both directions name --precision and the --loss-scale that carries on."""
    good = checkpoint_variants / "good.npz"  # fp16: a dynamic loss scale
    result = run_command("--resume", str(good), "--steps", "5", "--precision", "bf16")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"minimp.train: error: checkpoint {good} was trained with a dynamic loss scale, and this "
        "run's --precision and --loss-scale give it no loss scale: resume with the checkpoint's "
        "--precision, or pass --loss-scale dynamic"]
    carried = run_command("--resume", str(good), "--steps", "5", "--precision", "bf16",
                          "--loss-scale", "dynamic")
    assert carried.returncode == 0, carried.stderr


OUTPUT_OF_KIND = {"checkpoint": ("--save", "c.npz"), "metrics": ("--metrics", "m.jsonl"),
                  "timeline": ("--timeline", "t.json"), "plot": ("--plot", "p.png")}
KINDS = ["checkpoint", "archive", "metrics", "timeline", "plot", "image", "json", "text", "binary",
         "empty"]


def write_sample(path, kind, checkpoint):
    """A file of each kind file_kind tells apart, the outputs' own as a run writes them
    (`checkpoint`: a good checkpoint's path)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    figure = pyplot.figure()
    samples = {
        "checkpoint": lambda: path.write_bytes(checkpoint.read_bytes()),
        "archive": lambda: np.savez(path.open("wb"), a=np.zeros(2)),  # an .npz, not minimp's
        "metrics": lambda: path.write_text('{"step": 1, "loss": 2.3}\n{"step": 2}\n'),
        "timeline": lambda: path.write_text('{"traceEvents": [], "otherData": {}}'),
        "plot": lambda: figure.savefig(path.open("wb"), format="png"),
        "image": lambda: path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(40)),  # no matplotlib
        "json": lambda: path.write_text('{"name": "my package", "version": "1.0"}\n'),
        "text": lambda: path.write_text("my notes, not metrics\n"),
        "binary": lambda: path.write_bytes(bytes(range(256))),
        "empty": lambda: path.write_bytes(b""),
    }
    samples[kind]()
    pyplot.close(figure)


@pytest.mark.parametrize("kind", KINDS)
def test_file_kind_tells_the_outputs_apart(tmp_path, checkpoint_variants, kind):
    pytest.importorskip("matplotlib", reason="the plot sample is drawn by matplotlib")
    path = tmp_path / "file"
    write_sample(path, kind, checkpoint_variants / "good.npz")
    assert files.file_kind(str(path)) == kind


@pytest.mark.parametrize("found", [kind for kind in KINDS if kind != "empty"])
@pytest.mark.parametrize("output", sorted(OUTPUT_OF_KIND))
def test_an_output_replaces_only_a_file_of_its_own_kind(tmp_path, checkpoint_variants, output,
                                                          found):
    """--metrics c.npz used to write JSON lines over a checkpoint without a word; then any zip
    passed for a checkpoint, any JSON for metrics or a timeline, any PDF for a plot."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    from minimp.train.__main__ import check_outputs

    flag, name = OUTPUT_OF_KIND[output]
    path = tmp_path / name
    write_sample(path, found, checkpoint_variants / "good.npz")
    before = path.read_bytes()
    model = dict(hidden=16, layers=1)  # the good checkpoint's run: a rerun may replace it
    config = TrainConfig(**{flag[2:]: str(path)}, **model)
    if found == output:
        check_outputs(config)  # a rerun replaces its own output
    else:
        with pytest.raises(ConfigError, match=f"{flag} {path} exists and holds .*--force"):
            check_outputs(config)
        check_outputs(TrainConfig(**{flag[2:]: str(path)}, force=True, **model))  # --force
    assert path.read_bytes() == before  # a check writes nothing


def test_save_replaces_only_a_checkpoint_of_the_same_run(checkpoint_variants):
    """The issue's rule: no command overwrites a checkpoint it did not create for this purpose.
    A rerun of the same run (the flags a resume would need) or a resume in place may replace it;
    a checkpoint of another model, seed or batch size needs --force."""
    from minimp.train.__main__ import check_outputs

    good = str(checkpoint_variants / "good.npz")  # --hidden 16 --layers 1, seed 0, batch 64
    check_outputs(TrainConfig(save=good, hidden=16, layers=1))
    check_outputs(TrainConfig(save=good, resume=good, hidden=16, layers=1, lr=0.1))
    for other in (dict(hidden=32), dict(seed=1), dict(batch_size=32)):
        config = TrainConfig(save=good, **{"hidden": 16, "layers": 1, **other})
        flag = "--" + next(iter(other)).replace("_", "-")
        with pytest.raises(ConfigError, match=f"holds the checkpoint of another run \\(trained "
                                              f"with {flag} .*--force to replace it"):
            check_outputs(config)
        check_outputs(TrainConfig(save=good, force=True, **{"hidden": 16, "layers": 1, **other}))


def test_metrics_onto_a_checkpoint_is_one_line_and_the_checkpoint_is_kept(checkpoint_variants):
    good = checkpoint_variants / "good.npz"
    before = good.read_bytes()
    result = run_command("--steps", "2", "--metrics", str(good))
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"minimp.train: error: --metrics {good} exists and holds a minimp checkpoint, which this "
        "output would replace; choose another path, or pass --force"]
    assert good.read_bytes() == before


def test_resumed_metrics_keep_their_rows_up_to_a_damaged_line(tmp_path):
    """A metrics file whose tail is not UTF-8 (a crash, a disk error) used to end a resume in a
    UnicodeDecodeError traceback: the rows before the damage are kept, the rest dropped."""
    metrics = tmp_path / "m.jsonl"
    metrics.write_bytes(b'{"step": 1}\n{"step": 2}\n\xff\xfe garbage\n{"step": 3}\n')
    files.keep_metrics_up_to(str(metrics), 5)
    assert metrics.read_bytes() == b'{"step": 1}\n{"step": 2}\n'


# Run train with a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored: a write past it fails with
# EFBIG, as a full disk fails with ENOSPC), set after MPI's start-up, which writes large files.
FULL_DISK = """
import resource, signal, sys
from minimp.distributed import world
world()
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from minimp.train.__main__ import main
sys.exit(main(sys.argv[2:]))
"""


def run_on_a_small_disk(limit, *flags):
    return subprocess.run([PYTHON, "-c", FULL_DISK, str(limit), "--hidden", "8", "--layers", "1",
                           "--log-every", "1000", *flags],
                          capture_output=True, text=True, timeout=120)


def test_a_failing_write_of_a_report_is_one_line_and_the_checkpoint_still_saves(tmp_path):
    """A full disk under --metrics, --timeline or --plot used to end the run in a traceback.
    With 150 steps the metrics (~75 KB), the timeline and the plot outgrow a 40 KB limit; the
    checkpoint (13 KB) does not."""
    pytest.importorskip("matplotlib", reason="--plot needs matplotlib")
    out = {name: tmp_path / name for name in ("c.npz", "m.jsonl", "t.json", "p.png")}
    result = run_on_a_small_disk(
        40_000, "--steps", "150", "--save", str(out["c.npz"]), "--metrics", str(out["m.jsonl"]),
        "--timeline", str(out["t.json"]), "--plot", str(out["p.png"]))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        f"minimp.train: error: could not write --timeline {out['t.json']} (File too large), "
        f"--plot {out['p.png']} (File too large), --metrics {out['m.jsonl']} (File too large); "
        f"the checkpoint {out['c.npz']} was saved"]
    assert f"--metrics {out['m.jsonl']}: a write failed (File too large)" in result.stdout
    assert "saved checkpoint" in result.stdout and "done: 150 steps" in result.stdout
    with np.load(out["c.npz"]) as archive:
        assert json.loads(str(archive["meta"]))["step"] == 150
    assert not out["t.json"].exists() and not out["p.png"].exists()  # no half-written report


def test_a_checkpoint_the_disk_cannot_hold_is_one_line_and_the_old_one_is_kept(tmp_path):
    ckpt = tmp_path / "c.npz"
    assert run_command("--steps", "2", "--save", str(ckpt)).returncode == 0  # 16 wide: ~30 KB
    before = ckpt.read_bytes()
    result = run_on_a_small_disk(5_000, "--steps", "2", "--hidden", "16", "--save", str(ckpt))
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"minimp.train: error: checkpoint {ckpt} could not be written after step 2 (File too "
        "large); the file there is as it was"]
    assert ckpt.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]  # no temporary file left


@pytest.mark.parametrize("precision", ["fp16", "fp32"])
@pytest.mark.parametrize("save_every", ["0", "1"])
def test_weights_gone_non_finite_are_never_saved_and_the_run_exits_1(tmp_path, precision,
                                                                     save_every):
    """--lr 1e308 made inf weights, trained on, exited 0 and saved them over the checkpoint.
    Step 1's update makes them inf; with --save-every 1 the save after it refuses them, else
    step 2's non-finite loss has every rank check its masters and stop."""
    ckpt = tmp_path / "c.npz"
    assert run_command("--steps", "2", "--save", str(ckpt)).returncode == 0
    before = ckpt.read_bytes()
    result = run_command("--steps", "6", "--lr", "1e308", "--precision", precision,
                         "--save", str(ckpt), "--save-every", save_every)
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [{
        "1": "minimp.train: error: master/0.weight holds inf or NaN after step 1: the model "
             f"diverged (lower --lr, clip with --max-grad-norm); not saved, {ckpt} is left as it "
             "was",
        "0": "minimp.train: error: step 2: the float32 master weights hold inf or NaN: the model "
             f"diverged (lower --lr, clip with --max-grad-norm); not saved, {ckpt} keeps what it "
             "held"}[save_every]]
    assert "saved checkpoint" not in result.stdout and ckpt.read_bytes() == before


def test_a_checkpoint_is_never_written_with_non_finite_masters(tmp_path):
    from minimp import nn
    from minimp.checkpoints import checkpoint
    from minimp.optim import SGD
    from minimp.precision import NoLossScaler

    ckpt = tmp_path / "c.npz"
    ckpt.write_bytes(b"PK\x03\x04 an older checkpoint")
    optimizer = SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    arrays = {"master/0.weight": np.array([1.0, np.inf], np.float32)}
    with pytest.raises(DivergenceError, match="master/0.weight holds inf or NaN after step 4"):
        checkpoint.save(str(ckpt), step=4, flags={}, optimizer=optimizer, scaler=NoLossScaler(),
                        arrays=arrays)
    assert ckpt.read_bytes() == b"PK\x03\x04 an older checkpoint"


def test_a_damaged_shipped_dataset_is_one_line():
    """NaN pixels or a -1 label in the shipped data were a ValueError traceback."""
    damage = """
import sys
import numpy as np
from minimp import data
from minimp.train import tasks
def damaged():
    real = data.load_digits()
    return data.Dataset("digits", real.train_images, real.train_labels - 1, real.test_images,
                        real.test_labels)
tasks.load_digits = damaged
from minimp.train.__main__ import main
sys.exit(main(["--steps", "2"]))
"""
    result = subprocess.run([PYTHON, "-c", damage], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "minimp.train: error: --dataset digits: the data shipped with minimp cannot be used "
        "(digits: train labels must be integers >= 0); reinstall minimp"]


def test_a_reader_that_leaves_the_pipe_ends_the_run_quietly():
    """`python -m minimp.train | head -1` ended in a BrokenPipeError traceback."""
    job = subprocess.Popen([PYTHON, "-m", "minimp.train", *SMALL, "--steps", "100000"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job.stdout.readline()
    job.stdout.close()  # what head does after its line
    stderr = job.stderr.read()
    assert job.wait(timeout=60) == 141 and stderr == b""


def test_a_run_that_ends_with_a_non_finite_loss_saves_nothing_and_exits_1(tmp_path):
    """SGD in fp32 at --lr 1e38: the weights stay finite (about 1e36) but every later loss is NaN
    and every later step skipped; the run exited 0 and saved them over the good checkpoint."""
    ckpt = tmp_path / "c.npz"
    sgd = ("--optimizer", "sgd", "--precision", "fp32")
    assert run_command(*sgd, "--steps", "3", "--save", str(ckpt)).returncode == 0
    before = ckpt.read_bytes()
    # (--save-every 5: step 4's update makes the weights huge, step 5's loss shows it; a save
    # right after step 4 would hold finite weights whose next loss is NaN: a resume of them
    # computes NaN from its first step and ends with the same line.)
    result = run_command(*sgd, "--lr", "1e38", "--steps", "12", "--resume", str(ckpt),
                         "--save", str(ckpt), "--save-every", "5")
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "minimp.train: error: the run ended at step 12 with loss nan: its weights cannot compute "
        "the loss (they grew too large, or the data holds non-finite values; lower --lr, clip with "
        f"--max-grad-norm); not saved, {ckpt} keeps what it held"]
    assert "step 5: not saved, its loss is nan" in result.stdout  # the --save-every on the way
    assert ckpt.read_bytes() == before


def test_a_run_whose_every_step_was_skipped_saves_nothing_and_exits_1(tmp_path):
    """A static scale of 3.4e38 overflows every fp16 gradient: 5 of 5 skipped, exit 0 before."""
    ckpt = tmp_path / "never.npz"
    result = run_command("--steps", "5", "--loss-scale", "3.4e38", "--save", str(ckpt))
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "minimp.train: error: every step of this run (5) was skipped: its gradients were never "
        "finite, so nothing was learned (a --loss-scale too large for fp16, a --lr too high, or "
        "non-finite data); not saved"]
    assert not ckpt.exists()


def test_a_stdout_that_cannot_be_written_costs_the_lines_not_the_run(tmp_path):
    """`> log` on a full disk (here /dev/full) ended the run in an OSError traceback, unsaved."""
    ckpt = tmp_path / "c.npz"
    with open("/dev/full", "w") as full:
        result = subprocess.run([PYTHON, "-m", "minimp.train", *SMALL, "--steps", "3", "--save",
                                 str(ckpt)], stdout=full, stderr=subprocess.PIPE, text=True,
                                timeout=120)
    assert result.returncode == 1 and result.stderr.strip().splitlines() == [
        "minimp.train: error: could not write the lines on stdout (No space left on device); the "
        f"checkpoint {ckpt} was saved"]
    with np.load(ckpt) as archive:
        assert json.loads(str(archive["meta"]))["step"] == 3


@pytest.mark.parametrize("flag", ["--save", "--metrics", "--timeline"])
def test_an_output_that_names_a_folder_is_refused_before_any_work(tmp_path, flag):
    """`--save newdir/` trained every step, then could not save; `--metrics mdir/` was an
    AttributeError traceback."""
    result = run_command("--steps", "2", flag, f"{tmp_path}/newdir/")
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.strip().splitlines() == [
        f"minimp.train: error: {flag} '{tmp_path}/newdir/' names a folder, not a file; give a "
        f"file name (as '{tmp_path}/newdir/out')"]
    assert not (tmp_path / "newdir").exists()


def test_a_metrics_file_the_disk_cannot_rewrite_on_resume_is_one_line(tmp_path):
    """A resume rewrites --metrics up to its step; on a full disk that was a traceback."""
    ckpt, metrics = tmp_path / "c.npz", tmp_path / "m.jsonl"
    assert run_on_a_small_disk(10**8, "--steps", "2", "--save", str(ckpt)).returncode == 0
    metrics.write_text('{"step": 1, "padding": "..............................."}\n' * 2000)
    result = run_on_a_small_disk(40_000, "--steps", "4", "--resume", str(ckpt),
                                 "--metrics", str(metrics))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert f"--metrics {metrics}: a write failed (File too large)" in result.stdout
    assert result.stderr.strip().splitlines() == [
        f"minimp.train: error: could not write --metrics {metrics} (File too large)"]


def test_a_device_given_as_a_checkpoint_is_not_said_to_be_missing():
    """--resume /dev/null said "does not exist"."""
    result = run_command("--steps", "10", "--resume", "/dev/null")
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        "minimp.train: error: checkpoint /dev/null is not a regular file (a device, a pipe, a "
        "socket); give the path of the .npz that --save wrote"]

