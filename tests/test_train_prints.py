"""What a first run shows: the line of a skipped step (whose gradients overflowed, the loss scale
before and after), the summary at the end, the resolved config, the sample's streamed text and the
pipeline example's default stage count."""

import importlib.util
import io
import os
import re
import signal
import subprocess

import pytest
from checkpoint_edits import GPT_EDITS, edited
from conftest import MPIRUN, PYTHON, run_train
from test_train_gpt import TINY as GPT

from minimp import distributed as dist
from minimp import sample
from minimp.train import TrainConfig, train
from minimp.train import progress, threads
from minimp.train.threads import choose_threads
from minimp.backend import available_cores

MLP = dict(hidden=16, layers=2, batch_size=32, log_every=1000)
SKIPPED = "step 2: skipped, non-finite gradients on {}; loss scale 65536 -> 32768"


def config(world_size=1, **overrides):
    settings = TrainConfig(**{**MLP, **overrides})
    settings.validate(world_size)
    return settings


def simulated(world_size, **overrides):
    """[(lines logged, train's result)] of every rank of a simulated world."""
    settings = config(world_size, **overrides)

    def body(comm):
        lines = []
        return lines, train(settings, log=lines.append, comm=comm)

    return dist.simulate(world_size, body)


def test_one_process_says_a_skipped_step_when_it_happens():
    lines = []
    train(config(steps=3, log_every=1, inject_overflow="2:0"), log=lines.append)
    assert lines[0].startswith("step     1/3") and lines[2].startswith("step     2/3")
    assert lines[1] == SKIPPED.format("rank 0")


@pytest.mark.parametrize(
    "layout, who",
    [
        (dict(overlap=False), "rank 1"),  # each replica checks its own gradients
        # overlap: both replicas check the reduced mean, inf on both
        (dict(), "ranks 0, 1 (found after the all-reduce in backward)"),
        (dict(pp=2), "rank 1"),  # each stage checks its own
        (dict(tp=2), "rank 1"),
        (dict(zero=1, overlap=False), "rank 1"),  # ZeRO 1 reduces after the check
        # ZeRO 2 reduce-scatters in backward
        (dict(zero=2, overlap=False), "ranks 0, 1 (found after the reduce-scatter in backward)"),
    ],
    ids=["dp", "dp-overlap", "pp", "tp", "zero1", "zero2"],
)
def test_rank_0_alone_names_the_ranks_whose_gradients_overflowed(layout, who):
    (first, _), (second, _) = simulated(2, steps=3, inject_overflow="2:1", **layout)
    assert [line for line in first if line.startswith("step 2: ")] == [SKIPPED.format(who)]
    assert second == []


def test_learning_who_overflowed_is_one_scalar_collective_on_a_skip_and_no_bytes():
    """The skipped step counts the extra all-reduce with its others; every other step sends the
    same bytes and makes the same scalar all-reduces as a run without the overflow."""
    clean = simulated(2, steps=3, overlap=False)[0][1]["history"]
    skipped = simulated(2, steps=3, overlap=False, inject_overflow="2:1")[0][1]["history"]
    counted = [(r["bytes_sent"], r["scalar_allreduces"]) for r in clean]
    assert [(r["bytes_sent"], r["scalar_allreduces"]) for r in skipped] == [
        counted[0],
        (0, counted[1][1]),  # the overflow decision once, not twice: who overflowed instead
        counted[2],
    ]


def test_a_run_ends_with_its_summary():
    lines = []
    result = train(config(steps=3, inject_overflow="2:0"), log=lines.append)
    done, *summary = lines[-1].splitlines()
    assert done.startswith("done: 3 steps, 1 skipped, test accuracy ")
    peak = max(result["peak_model_state_bytes"])
    activations = max(r["peak_activation_bytes"] for r in result["history"])
    assert re.fullmatch(r"  wall time     [\d.]+ s in all; the 3 steps took [\d.]+ s", summary[0])
    assert re.fullmatch(r"  throughput    [\d,]+ samples/s over the steps", summary[1])
    assert summary[2:] == [
        "  skipped       1 of 3 steps",
        "  sent          nothing (one rank)",
        f"  peak memory   {progress.size_text(peak)} model state, "
        f"{progress.size_text(activations)} activations (the most any rank held)",
    ]


def test_the_summary_gives_each_ranks_mean_bytes_per_step_and_a_gpt_tokens():
    (first, result), _ = simulated(2, steps=3, overlap=False, inject_overflow="2:1")
    mean = sum(r["bytes_sent"] for r in result["history"]) / 3  # the skipped step sent nothing
    said = f"  sent          {progress.size_text(mean)} per step by each of 2 ranks"
    assert said in first[-1].splitlines()
    (first, _), _ = simulated(2, pp=2, **{**GPT, "steps": 2})
    assert " tokens/s over the steps\n" in first[-1]


def test_bytes_read_as_people_write_them():
    assert [progress.size_text(n) for n in (0, 1023, 1536, 3 * 2**20, 2**31)] == [
        "0 B", "1023 B", "1.5 KiB", "3.0 MiB", "2.0 GiB",
    ]  # fmt: skip
    assert progress._bytes_by_rank([10.0, 2048.0]) == "per step: rank 0 10 B, rank 1 2.0 KiB"
    assert progress._bytes_by_rank([2048.0, 2049.0]) == "2.0 KiB per step by each of 2 ranks"
    assert progress._bytes_by_rank([0.0]) == "nothing (one rank)"
    assert progress._seconds(0.01234) == "0.0123 s" and progress._seconds(1234.4) == "1,234 s"


def test_the_config_shows_what_runs_and_only_the_flags_that_differ_from_the_defaults():
    assert TrainConfig().describe() == (
        "digits: an MLP of 4 hidden layers x 128, fp16 with a dynamic loss scale, adam lr 0.001, "
        "batch 64, 500 steps, 1 rank\n  every flag at the digits defaults (--help lists them)"
    )
    gpt = TrainConfig(dataset="shakespeare", steps=20, overlap=False, loss_scale="1024",
                      recompute=True)
    assert gpt.describe(4) == (
        "shakespeare: a GPT of 4 blocks x 128 (4 heads, context 64), fp16 with a static loss "
        "scale of 1024, adamw lr 0.001, batch 12, 20 steps, 4 ranks\n"
        "  differs from the shakespeare defaults: --loss-scale 1024 --steps 20 --recompute "
        "--no-overlap"
    )
    # A derived value is listed only where it was chosen: --min-lr follows --lr, fp8's settings
    # follow --precision fp8.
    assert TrainConfig(lr=0.01).changed_flags() == ["--lr 0.01"]
    assert TrainConfig(lr=0.01, min_lr=0.0005).changed_flags() == ["--lr 0.01", "--min-lr 0.0005"]
    assert TrainConfig(precision="fp8").changed_flags() == ["--precision fp8"]
    assert TrainConfig(precision="fp8", fp8_amax_history=32).changed_flags() == [
        "--precision fp8", "--fp8-amax-history 32"]


@pytest.mark.mpi
@pytest.mark.skipif(MPIRUN is None, reason="no mpirun on PATH (pip install 'minimp[mpi]')")
def test_mpirun_prints_the_config_one_skip_line_and_the_summary_from_rank_0():
    flags = ["--hidden", "16", "--layers", "1", "--batch-size", "32", "--steps", "3"]
    result = run_train(2, [*flags, "--inject-overflow", "2:1", "--no-overlap"])
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[:2] == [
        "minimp.train: digits: an MLP of 1 hidden layers x 16, fp16 with a dynamic loss scale, "
        "adam lr 0.001, batch 32, 3 steps, 2 ranks",
        "  differs from the digits defaults: --steps 3 --batch-size 32 --layers 1 --hidden 16 "
        "--no-overlap --inject-overflow 2:1",
    ]
    settings = TrainConfig(hidden=16, layers=1, batch_size=32)  # 16 rows a replica, 2 ranks here
    assert lines[2] == f"  {threads.describe(choose_threads(settings, available_cores(), 2, 2))}"
    assert lines.count(SKIPPED.format("rank 1")) == 1
    assert lines[-5].startswith("  wall time ") and lines[-2].endswith(" by each of 2 ranks")


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("sample") / "gpt.npz"
    train(config(**{**GPT, "steps": 2, "eval_every": 0, "save": str(path)}), log=lambda line: None)
    return str(path)


class Screen(io.StringIO):
    """stdout that notes what had been written at each flush."""

    def __init__(self):
        super().__init__()
        self.flushed = []

    def flush(self):
        self.flushed.append(self.getvalue())


def test_sample_prints_each_character_as_it_is_drawn(gpt_checkpoint, monkeypatch):
    screen = Screen()
    monkeypatch.setattr("sys.stdout", screen)
    assert sample.main(["--resume", gpt_checkpoint, "--tokens", "12", "--prompt", "RO"]) == 0
    model, data = sample.load_model(gpt_checkpoint)
    whole = data.decode(sample.generate(model, data.encode("RO"), 12, 0.8, 0, 0))
    assert screen.getvalue() == whole + "\n"
    assert [text for text in screen.flushed if text][:13] == [whole[: 2 + i] for i in range(13)]


def test_sample_piped_into_head_ends_quietly(gpt_checkpoint):
    """`minimp.sample ... | head -c 20` ended in a BrokenPipeError traceback."""
    job = subprocess.Popen([PYTHON, "-m", "minimp.sample", "--resume", gpt_checkpoint,
                            "--tokens", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job.stdout.read(20)
    job.stdout.close()  # what head does once it has its bytes
    stderr = job.stderr.read()
    assert job.wait(timeout=60) == 141 and stderr == b""


def test_ctrl_c_in_sample_is_one_line(gpt_checkpoint):
    job = subprocess.Popen([PYTHON, "-m", "minimp.sample", "--resume", gpt_checkpoint,
                            "--tokens", "100000"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    job.stdout.read(20)  # it is drawing
    job.send_signal(signal.SIGINT)
    _, stderr = job.communicate(timeout=60)
    assert job.returncode == 130 and stderr == b"minimp.sample: interrupted\n"


@pytest.mark.parametrize("edit, said", [case[1:] for case in GPT_EDITS],
                         ids=[case[0] for case in GPT_EDITS])
def test_sample_refuses_an_edited_checkpoint_in_one_line(gpt_checkpoint, tmp_path, capsys, edit,
                                                         said):
    """Flags that cannot build a GPT, or disagree with its masters, were tracebacks (KeyError,
    ValueError, a 119 GiB MemoryError for --context 1e9) or a line that named no field."""
    path = edited(gpt_checkpoint, tmp_path / "x.npz", **edit)
    assert sample.main(["--resume", path, "--tokens", "3"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"minimp.sample: error: checkpoint {path}: "), err
    assert said in err and len(err.splitlines()) == 1, err


@pytest.mark.parametrize("flags, said", [(["--top-k", "-1"], "--top-k must be 0 or more, got -1"),
                                         (["--seed", "-2"], "--seed must be 0 or more, got -2")])
def test_sample_names_the_flag_that_is_negative(gpt_checkpoint, capsys, flags, said):
    assert sample.main(["--resume", gpt_checkpoint, *flags]) == 2
    assert capsys.readouterr().err == f"minimp.sample: error: {said}\n"


def test_sample_help_says_the_prompt_default_in_words():
    """`--prompt`'s default, a newline, printed as "(default: " and a line break."""
    text = " ".join(sample.build_parser().format_help().split())
    assert "text the generation continues (default: a newline)" in text


def load_example(name):
    path = os.path.join(os.path.dirname(__file__), "..", "mpirun_examples", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_pipeline_example_defaults_to_the_stages_the_cores_can_show(capsys, monkeypatch):
    example = load_example("pipeline_timeline")
    assert [example.default_stages(cores) for cores in (1, 2, 3, 4, 16)] == [2, 2, 2, 4, 4]
    monkeypatch.setattr(example, "available_cores", lambda: 2)
    with pytest.raises(SystemExit):
        example.main(["--help"])
    assert "(default: 2, for the 2 cores here" in " ".join(capsys.readouterr().out.split())


def test_the_pipeline_timeline_example_refuses_an_image_over_another_kind(tmp_path, capsys):
    """--png onto a checkpoint: refused in one line before minutes of measuring."""
    example = load_example("pipeline_timeline")
    ckpt = tmp_path / "c.png"  # named like an image, but holding an archive
    ckpt.write_bytes(b"PK\x03\x04 a checkpoint")
    with pytest.raises(SystemExit) as exited:
        example.main(["--png", str(ckpt), "--steps", "3"])
    assert exited.value.code == 2 and ckpt.read_bytes() == b"PK\x03\x04 a checkpoint"
    error = capsys.readouterr().err  # `PROG: error: ...`, PROG being pytest's name in here
    assert error.split(": ", 1)[1] == (
        f"error: --png {ckpt} exists and holds a zip archive that is not a minimp checkpoint (an "
        ".npz, a .docx?), which this output would replace; choose another path\n")


def test_on_a_terminal_the_skip_line_is_written_above_the_bar(capsys):
    said = []
    history = progress.History(said.append, "", None, steps=3, log_every=1, units_per_step=1,
                               interactive=True)
    history.say("step 2: skipped")
    history.bar.close()
    assert said == [] and "step 2: skipped\n" in capsys.readouterr().out
