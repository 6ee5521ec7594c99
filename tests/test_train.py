"""The training command end to end:
accuracy, resume bit-identity, micro-batches, overflow, bad input."""

import cProfile
import json
import re
import subprocess
import sys
import threading

import numpy as np
import pytest
from conftest import PYTHON

from minimp.checkpoints.errors import AgreedError
from minimp.train import TrainConfig, train
from minimp.train.sizes import FP8_RECORD_BYTES, RECORD_BYTES, check_memory, memory_parts
from minimp.train.sizes import parameter_count


def run_command(*flags, timeout=120):
    return subprocess.run(
        [PYTHON, "-m", "minimp.train", *flags], capture_output=True, text=True, timeout=timeout
    )


def quiet_train(**overrides):
    config = TrainConfig(log_every=1000, **overrides)
    config.validate()
    return train(config, log=lambda line: None)


def test_default_run_reaches_90_percent_test_accuracy(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    result = run_command("--metrics", str(metrics))
    assert result.returncode == 0, result.stderr
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    steps = [r["step"] for r in records[:-1]]
    assert steps == list(range(1, len(steps) + 1)) and len(steps) == TrainConfig().steps
    assert {
        "step",
        "loss",
        "loss_scale",
        "skipped",
        "compute_seconds",
        "communication_seconds",
        "bytes_sent",
    } <= set(records[0])
    assert records[-1]["test_accuracy"] >= 0.90
    assert "test accuracy" in result.stdout


@pytest.mark.parametrize(
    "precision, optimizer", [("fp16", "adam"), ("fp32", "sgd"), ("bf16", "adamw")]
)
def test_resume_continues_bit_identically(tmp_path, precision, optimizer):
    common = dict(
        precision=precision,
        optimizer=optimizer,
        hidden=32,
        layers=2,
        batch_size=32,
        loss_scale_growth_interval=3,
        inject_overflow="4:0",
        # a schedule that moves every step; its length is its own setting, saved and continued
        lr_schedule="cosine",
        warmup=3,
        min_lr=1e-4,
        lr_decay_steps=20,
    )
    straight = quiet_train(steps=20, save=str(tmp_path / "straight.npz"), **common)
    quiet_train(steps=10, save=str(tmp_path / "half.npz"), **common)
    common.pop("inject_overflow")  # step 4 is behind the resumed run: it could never fire again
    resumed = quiet_train(
        steps=20, resume=str(tmp_path / "half.npz"), save=str(tmp_path / "resumed.npz"), **common
    )
    assert [r["step"] for r in resumed["history"]] == list(range(11, 21))
    assert [r["loss"] for r in resumed["history"]] == [r["loss"] for r in straight["history"][10:]]
    with np.load(tmp_path / "straight.npz") as a, np.load(tmp_path / "resumed.npz") as b:
        assert sorted(a.files) == sorted(b.files)
        for name in a.files:
            np.testing.assert_array_equal(a[name], b[name], err_msg=name)


def test_micro_batches_give_the_big_batch_result_in_fp32():
    common = dict(precision="fp32", steps=20, hidden=32, layers=2, batch_size=64)
    one = quiet_train(micro_batches=1, **common)["master_weights"]
    four = quiet_train(micro_batches=4, **common)["master_weights"]
    for name in one:
        np.testing.assert_allclose(four[name], one[name], rtol=1e-5, atol=1e-6, err_msg=name)


def test_injected_overflow_skips_that_step_and_halves_the_scale():
    history = quiet_train(steps=8, hidden=32, layers=2, inject_overflow="5:0")["history"]
    assert [r["skipped"] for r in history] == [False] * 4 + [True] + [False] * 3
    assert history[5]["loss_scale"] == history[4]["loss_scale"] / 2


def test_the_trainer_says_when_the_scale_is_stuck_at_its_minimum():
    """lr 1e4 throws the fp16 weights so far that every later step overflows: the scale falls
    from 2^16 to 1 in 16 skipped steps, and the 17th overflow is reported."""
    lines = []
    config = TrainConfig(steps=20, lr=1e4, hidden=16, layers=2, log_every=1000)
    with pytest.raises(AgreedError, match="the run ended at step 20 with loss nan"):
        train(config, log=lines.append)  # a run that ends unable to compute its loss: exit 1
    assert any("minimum loss scale 1" in line for line in lines)


def test_bf16_trains_without_loss_scaling():
    result = quiet_train(precision="bf16", steps=200)
    assert all(r["loss_scale"] == 1.0 for r in result["history"])
    assert result["test_accuracy"] >= 0.85


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'lessons' extra)")
    quiet_train(steps=6, hidden=16, layers=1, inject_overflow="3:0", plot=str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "small.npz"
    quiet_train(steps=2, hidden=16, layers=1, save=str(path))
    return path


BAD_INPUTS = [
    (["--dropout", "0.5"], "--dropout applies to the GPT (--dataset shakespeare)"),  # ignored
    (["--heads", "3"], "--heads applies to the GPT (--dataset shakespeare)"),  # before
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--steps", "-3"], "--steps must be a positive integer"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--lr", "-1"], "--lr must be a positive number"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--batch-size", "100000"], "larger than the training set"),
    (["--precision", "fp4"], "invalid choice"),
    (["--steps", "ten"], "invalid int value"),
    (["--batch-size", "60", "--micro-batches", "7"], "not divisible by --micro-batches"),
    (["--loss-scale", "huge"], "--loss-scale must be"),
    (["--loss-scale", "1e-50"], "--loss-scale 1e-50 rounds to 0 in float32"),
    (["--loss-scale", "1e-45"], "--loss-scale 1e-45 is subnormal in float32"),  # 1/S: inf
    (["--inject-overflow", "5"], "--inject-overflow takes STEP:RANK"),
    (["--inject-overflow", "5:1"], "the rank must lie in 0..0"),
    (["--resume", "/nonexistent/checkpoint.npz"], "does not exist"),
    (["--zero", "4"], "--zero must be 0, 1, 2 or 3 (ZeRO's stages), got 4"),
    (["--recompute", "1"], "unrecognized arguments: 1"),
    (["--schedule", "interleaved"], "interleaving needs --pp 2 or more"),
    (["--virtual-stages", "2"], "--virtual-stages 2 needs --schedule interleaved"),
    (["--virtual-stages", "0"], "--virtual-stages must be a positive integer"),
    (["--schedule", "zb-h1", "--recompute"], "--schedule zb-h1 does not work with --recompute"),
    (["--save", "/tmp/x.npz", "--timeline", "/tmp/x.npz"], "--timeline /tmp/x.npz is also --save"),
    (["--metrics", "/tmp/m.json", "--timeline", "/tmp/./m.json"], "is also --metrics's file"),
    (["--save", "/tmp/q.npz", "--metrics", "/tmp/q.npz"], "--metrics /tmp/q.npz is also --save"),
    (["--timeline", "/proc/version/t.json"], "/proc/version is a file, not a folder"),
    (["--tp", "99999999999999999999"], "--tp 99999999999999999999 is more than the 1 ranks"),
    (["--metrics", "/proc/version/a/b/m.jsonl"], "/proc/version is a file, not a folder"),
]


@pytest.mark.parametrize("flags, message", BAD_INPUTS, ids=[" ".join(f) for f, _ in BAD_INPUTS])
def test_bad_input_is_one_clear_line_and_exit_2(flags, message):
    result = run_command(*flags)
    assert result.returncode == 2
    assert result.stderr.startswith("minimp.train: error:") and message in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1


def test_corrupt_checkpoint_is_a_clear_error(tmp_path, small_checkpoint):
    corrupt = tmp_path / "corrupt.npz"
    corrupt.write_bytes(small_checkpoint.read_bytes()[:200])
    result = run_command("--resume", str(corrupt))
    assert result.returncode == 2 and "not a readable minimp checkpoint" in result.stderr
    assert "Traceback" not in result.stderr


def test_checkpoint_of_another_model_shape_is_a_clear_error(small_checkpoint):
    result = run_command("--resume", str(small_checkpoint), "--hidden", "16", "--layers", "2")
    assert result.returncode == 2
    assert "trained with --layers 1, this run has --layers 2" in result.stderr


OUT_OF_RANGE = [
    (["--weight-decay", "nan"], "--weight-decay must be 0 or more, got nan"),
    (["--momentum", "inf"], "--momentum must lie in [0, 1), got inf"),
    (["--momentum", "2"], "--momentum must lie in [0, 1), got 2.0"),  # SGD's rule: it diverges
    (["--max-grad-norm", "-1"], "--max-grad-norm must be 0 or more"),
    (["--bucket-mb", "nan"], "--bucket-mb must be a positive number"),
    (["--timeout", "nan"], "--timeout must be 0 (never) or seconds"),
    (["--timeout", "1e-9"], "--timeout 1e-09 s is shorter than a healthy message can wait"),
    (["--timeout", "0.999"], "use 0 (never) or at least 1 s"),
    (["--seed", "-1"], "--seed must be 0 or more, got -1"),
    (["--inject-fault", "99:0", "--steps", "2"], "can never fire: this run takes steps 1..2"),
    (["--inject-overflow", "0:0"], "can never fire"),
    (["--save-every", "5"], "--save-every needs --save"),
    (["--max-consecutive-skips", "-2"], "--max-consecutive-skips must be 0 or more"),
]


@pytest.mark.parametrize("flags, message", OUT_OF_RANGE, ids=[" ".join(f) for f, _ in OUT_OF_RANGE])
def test_numbers_outside_their_range_are_refused(flags, message):
    result = run_command(*flags)
    assert result.returncode == 2 and message in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "step" not in result.stdout


TOO_BIG = [  # (flags, the flags the line says to lower): each part of memory_parts the largest once
    (["--layers", "100000"], "--hidden or --layers"),
    (["--hidden", "100000000"], "--hidden or --layers"),
    (["--dataset", "shakespeare", "--context", "100000000"], "--context, --batch-size or --layers"),
    (["--precision", "fp8", "--fp8-amax-history", "100000000000"], "--fp8-amax-history"),
    (["--steps", "10000000000"], "--steps"),
    (["--steps", "10000000000", "--timeline", "/tmp/t.json"], "--steps, or leave out --timeline"),
    (["--dataset", "shakespeare", "--eval-batches", "10000000000000"], "--eval-batches"),
]
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
SIZE = r"([\d.]+) (B|KiB|MiB|GiB)"


def _size(number, unit):
    return float(number) * UNITS[unit]


def _rounding(unit):
    """Half the last printed digit: sizes print to 0.1 of their unit, bytes whole."""
    return _size("0.5" if unit == "B" else "0.05", unit)


@pytest.mark.parametrize("flags, lower", TOO_BIG, ids=[" ".join(f) for f, _ in TOO_BIG])
def test_a_run_too_big_for_this_machine_is_refused_up_front_with_figures_that_add_up(flags, lower):
    """Refused before anything is allocated (fp8's histories, the records of --steps, the
    evaluation's draws were not counted: the run grew until the kernel killed it), in a line
    whose figures follow from each other: the parts add up to the total, and the weights are the
    parameters it prints times the bytes it prints (an absurd --context printed a GiB that did not
    follow from its parameter count)."""
    result = run_command(*flags, timeout=60)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    line = result.stderr.strip()
    total = re.search(rf"needs about {SIZE} for the (\d+) rank\(s\)", line)
    parts = re.findall(rf"{SIZE} of ([a-z0-9 -]+)", line)
    assert total and parts and line.endswith(f"(lower {lower})"), line
    rounding = sum(_rounding(unit) for _, unit, _ in parts)
    needed = sum(_size(number, unit) for number, unit, _ in parts) * int(total[3])
    assert abs(needed - _size(total[1], total[2])) <= rounding + _rounding(total[2]), line
    weights = re.search(rf"{SIZE} of weights \(([\d,]+) parameters x (\d+) bytes", line)
    parameters, per_parameter = int(weights[3].replace(",", "")), int(weights[4])
    assert abs(parameters * per_parameter - _size(weights[1], weights[2])) <= _rounding(
        weights[2]), line


def test_the_plot_shows_losses_scale_rate_and_communication():
    pytest.importorskip("matplotlib", reason="the plot needs matplotlib (the 'lessons' extra)")
    from minimp.train.plot import history_figure

    rows = [
        {"step": s, "loss": 3.0 - s / 10, "loss_scale": 2.0**16 / (1 + (s > 3)), "skipped": s == 3,
         "compute_seconds": 0.1, "communication_seconds": 0.05 * (s > 1)}  # fmt: skip
        for s in range(1, 6)
    ]
    rows[3]["val_loss"] = 2.7
    figure = history_figure(rows, units_per_step=768, unit="tokens")
    labels = [axis.get_ylabel() for axis in figure.axes]
    assert labels == ["loss", "loss scale", "tokens/s", "communication\nshare of step"]
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["training", "validation"]
    np.testing.assert_allclose(figure.axes[2].get_lines()[0].get_ydata()[0], 768 / 0.1)
    alone = history_figure([{**row, "communication_seconds": 0.0} for row in rows], 64, "samples")
    assert len(alone.axes) == 3  # no communication panel for a run that sent nothing


def test_an_output_on_the_checkpoint_it_resumes_is_refused_and_the_checkpoint_kept(
    tmp_path, small_checkpoint
):
    """--timeline or --metrics onto --resume's file would replace the checkpoint (--save onto
    it continues it in place, which is allowed)."""
    copy = tmp_path / "ckpt.npz"
    copy.write_bytes(small_checkpoint.read_bytes())
    for flag in ("--timeline", "--metrics"):
        result = run_command("--steps", "4", "--resume", str(copy), flag, str(copy))
        assert result.returncode == 2 and "is also --resume's file" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert copy.read_bytes() == small_checkpoint.read_bytes()
    model = ("--hidden", "16", "--layers", "1")
    kept = run_command(*model, "--steps", "4", "--resume", str(copy), "--save", str(copy))
    assert kept.returncode == 0, kept.stderr


def test_help_shows_each_flag_s_choices_and_no_empty_default():
    """--help printed `--device {,cpu,gpu}` with `(default: )`, and no choices for --fp8-recipe."""
    from minimp.train.cli import build_parser

    text = build_parser().format_help()
    assert "(default: )" not in text and "{," not in text
    choices = "{delayed,current,none,rowwise,blockwise,mxfp8,mxfp8-round-up}"
    assert "[--device {cpu,gpu}]" in text and f"[--fp8-recipe {choices}]" in text
    assert text.count("(default:") > 40  # the other flags keep theirs


def _calls_to_build_and_train(layers):
    """Python function calls made by the checks, the build and one step of an MLP of `layers`
    layers of width 2 (a count, not a time: the same on a loaded machine), in a thread of its
    own: a memory pool of its own, that no earlier run filled."""
    config, counts = TrainConfig(layers=layers, hidden=2, steps=1, log_every=1000), []

    def build_and_train():
        profile = cProfile.Profile()
        profile.enable()
        config.validate()
        check_memory(config, ranks_on_this_node=1, available=2**50)
        config.describe()
        train(config, log=lambda line: None)
        profile.disable()
        counts.append(sum(entry.callcount for entry in profile.getstats()))

    thread = threading.Thread(target=build_and_train)
    thread.start()
    thread.join()
    return counts[0]


def test_setup_and_a_step_grow_linearly_with_the_layers():
    """--layers 16000 --hidden 2 took minutes: the memory pool looked at every array of a shape
    on each request, and all 16,000 layers' activations share one. 4x the layers must cost about
    4x the calls (4.0 now; the quadratic pool made it 6.9 at these sizes)."""
    _calls_to_build_and_train(10)  # imports and first-call caches out of the way
    ratio = _calls_to_build_and_train(400) / _calls_to_build_and_train(100)
    assert ratio < 5, f"4x the layers made {ratio:.1f}x the calls: something is super-linear"


def _deep_size(value, seen):
    """Bytes of value and of everything it holds (each object once)."""
    if id(value) in seen:
        return 0
    seen.add(id(value))
    size = sys.getsizeof(value)
    if isinstance(value, dict):
        size += sum(_deep_size(k, seen) + _deep_size(v, seen) for k, v in value.items())
    elif isinstance(value, (list, tuple)):
        size += sum(_deep_size(item, seen) for item in value)
    return size


@pytest.mark.parametrize("precision, bound", [("fp16", RECORD_BYTES), ("fp8", FP8_RECORD_BYTES)])
def test_the_memory_check_s_bytes_per_step_record_bound_a_real_record(precision, bound):
    """--steps sizes the records every rank keeps; the memory check counts each at these bytes."""
    records = quiet_train(steps=2, hidden=8, layers=1, precision=precision)["history"]
    assert max(_deep_size(record, set()) for record in records) <= bound


def test_the_memory_check_resolves_dp_from_the_job_s_ranks():
    """--dp 0 means the job's ranks: two replicas each hold the buckets' send and receive buffers
    (float32 on the wire: 8 bytes a parameter) and half the batch's activations."""
    config = TrainConfig()
    one, two = (
        {what: size for what, size, _ in memory_parts(config, world_size)} for world_size in (1, 2)
    )
    states = "gradients and optimizer state"
    assert two[states] - one[states] == 8 * parameter_count(config)
    assert two["activations"] * 2 == one["activations"]
