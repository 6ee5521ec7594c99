"""Weights that leave minimp: safetensors files that a NumPy forward written here (and PyTorch,
where it is installed) turns into the logits minimp computes."""

import json
import math
import os
import struct
import subprocess

import numpy as np
import pytest
from checkpoint_edits import GPT_EDITS, edited
from conftest import PYTHON

from minimp import export
from minimp.checkpoints import checkpoint
from minimp.checkpoints.errors import CheckpointError
from minimp.tensor import Tensor, no_grad
from minimp.train import TrainConfig, train
from minimp.train.config import DATASET_DEFAULTS
from minimp.train.tasks import TASKS, build_model

safetensors_numpy = pytest.importorskip(
    "safetensors.numpy", reason="export needs the 'export' extra (safetensors)"
)

GPT = dict(dataset="shakespeare", layers=2, hidden=32, heads=2, context=16, batch_size=8)


@pytest.fixture(scope="module")
def gpt_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "gpt.npz"
    config = TrainConfig(**GPT, steps=4, eval_every=0, save=str(path), log_every=1000)
    train(config, log=lambda line: None)
    return path


@pytest.fixture(scope="module")
def mlp_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("export") / "mlp.npz"
    train(TrainConfig(steps=2, hidden=16, layers=1, save=str(path)), log=lambda line: None)
    return path


def minimp_logits(checkpoint_path, ids):
    """What minimp's own GPT computes, in float32, from the checkpoint's masters."""
    config = TrainConfig(**GPT, precision="fp32")
    model = TASKS["shakespeare"](config, np.float32).build_model(np.random.default_rng(0))
    with np.load(checkpoint_path) as archive:
        model.load_state_dict(
            {name: archive[f"master/{name}"] for name, _ in model.named_parameters()}
        )
    with no_grad():
        return model(Tensor(ids)).data


def layer_norm(x, weight, bias):
    mean, variance = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(variance + 1e-5) * weight + bias


def numpy_gpt(t, config, ids):
    """nanoGPT's forward, in plain NumPy, from the exported tensors `t` and the config JSON."""
    heads, width = config["n_head"], config["n_embd"]
    batch, tokens = ids.shape
    x = t["transformer.wte.weight"][ids] + t["transformer.wpe.weight"][:tokens]
    for i in range(config["n_layer"]):
        p = lambda name: t[f"transformer.h.{i}.{name}"]  # noqa: E731
        h = layer_norm(x, p("ln_1.weight"), p("ln_1.bias"))
        qkv = h @ p("attn.c_attn.weight").T + p("attn.c_attn.bias")
        q, k, v = (
            part.reshape(batch, tokens, heads, width // heads).transpose(0, 2, 1, 3)
            for part in np.split(qkv, 3, axis=-1)
        )
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(width // heads)
        scores = np.where(np.tril(np.ones((tokens, tokens), bool)), scores, -np.inf)
        weights = np.exp(scores - scores.max(-1, keepdims=True))
        weights /= weights.sum(-1, keepdims=True)
        y = (weights @ v).transpose(0, 2, 1, 3).reshape(batch, tokens, width)
        x = x + y @ p("attn.c_proj.weight").T + p("attn.c_proj.bias")
        h = layer_norm(x, p("ln_2.weight"), p("ln_2.bias"))
        h = h @ p("mlp.c_fc.weight").T + p("mlp.c_fc.bias")
        h = 0.5 * h * (1 + np.tanh(math.sqrt(2 / math.pi) * (h + 0.044715 * h**3)))
        x = x + h @ p("mlp.c_proj.weight").T + p("mlp.c_proj.bias")
    x = layer_norm(x, t["transformer.ln_f.weight"], t["transformer.ln_f.bias"])
    return x @ t["transformer.wte.weight"].T  # lm_head is tied to the token embedding


def test_a_numpy_gpt_on_the_exported_weights_gives_minimp_s_logits(gpt_checkpoint, tmp_path):
    out = tmp_path / "gpt.safetensors"
    assert export.main([str(gpt_checkpoint), str(out)]) == 0
    tensors = safetensors_numpy.load_file(str(out))
    config = json.loads((tmp_path / "gpt.json").read_text())
    assert "lm_head.weight" not in tensors and "tied" in config["lm_head"]
    assert config["vocabulary"][:3] == "\n !" and config["n_layer"] == 2
    assert tensors["transformer.h.0.attn.c_attn.weight"].shape == (96, 32)  # (out, in)
    ids = np.random.default_rng(0).integers(0, 65, (3, 16))
    theirs = numpy_gpt({k: v.astype(np.float64) for k, v in tensors.items()}, config, ids)
    np.testing.assert_allclose(minimp_logits(gpt_checkpoint, ids), theirs, rtol=1e-4, atol=1e-4)


def test_fp16_and_bf16_exports_hold_the_masters_rounding(gpt_checkpoint, tmp_path):
    half = tmp_path / "half.safetensors"
    assert export.main([str(gpt_checkpoint), str(half), "--dtype", "fp16"]) == 0
    tensors = safetensors_numpy.load_file(str(half))
    with np.load(gpt_checkpoint) as archive:
        master = archive["master/1.mlp.c_fc.weight"]
    np.testing.assert_array_equal(tensors["transformer.h.0.mlp.c_fc.weight"], master.astype("f2"))
    brain = tmp_path / "brain.safetensors"
    assert export.main([str(gpt_checkpoint), str(brain), "--dtype", "bf16"]) == 0
    raw = brain.read_bytes()
    header = json.loads(raw[8 : 8 + struct.unpack("<Q", raw[:8])[0]])
    entry = header["transformer.wte.weight"]  # the safetensors header: dtype, shape, offsets
    assert entry["dtype"] == "BF16" and entry["shape"] == [65, 32]
    assert entry["data_offsets"][1] - entry["data_offsets"][0] == 65 * 32 * 2


def test_the_mlp_exports_under_sequential_names(tmp_path):
    ckpt = tmp_path / "mlp.npz"
    train(TrainConfig(steps=3, hidden=16, layers=1, save=str(ckpt)), log=lambda line: None)
    out = tmp_path / "mlp.safetensors"
    assert export.main([str(ckpt), str(out)]) == 0
    tensors = safetensors_numpy.load_file(str(out))
    assert sorted(tensors) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    x = np.random.default_rng(0).random((4, 64), dtype=np.float32)
    hidden = np.maximum(x @ tensors["0.weight"].T + tensors["0.bias"], 0)
    ours = hidden @ tensors["2.weight"].T + tensors["2.bias"]
    model = TASKS["digits"](TrainConfig(hidden=16, layers=1), np.float32).build_model(
        np.random.default_rng(0)
    )
    model.load_state_dict(tensors)
    np.testing.assert_allclose(model(Tensor(x)).data, ours, rtol=1e-5, atol=1e-6)


def test_export_errors_are_one_line(tmp_path, capsys):
    assert export.main([str(tmp_path / "none.npz"), str(tmp_path / "x.safetensors")]) == 2
    assert "minimp.export: error: checkpoint" in capsys.readouterr().err
    assert export.main([str(tmp_path / "none.npz"), str(tmp_path)]) == 2
    assert "is a folder" in capsys.readouterr().err


def test_the_export_never_destroys_a_file_it_was_not_asked_to_replace(gpt_checkpoint, tmp_path,
                                                                     capsys):
    """The checkpoint it reads (by its name or a link), an output whose config would land on it,
    and a file already there (without --force) are refused in one line, before any write."""
    checkpoint = str(gpt_checkpoint)
    original = open(checkpoint, "rb").read()
    link = tmp_path / "link.safetensors"
    link.symlink_to(gpt_checkpoint)
    victim = tmp_path / "victim.npz"
    victim.write_bytes(b"another run's checkpoint")
    refused = [
        ([checkpoint, checkpoint], "is the checkpoint being exported"),
        ([checkpoint, str(link)], "is the checkpoint being exported"),
        ([checkpoint, str(tmp_path / "out.json")], "the same file"),
        ([checkpoint, str(victim)], "exists; pass --force to replace it"),
    ]
    for argv, said in refused:
        assert export.main(argv) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err
    assert open(checkpoint, "rb").read() == original
    assert victim.read_bytes() == b"another run's checkpoint"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.safetensors", "victim.npz"]
    # its config exists: refused too, until --force replaces both
    (tmp_path / "new.json").write_text("{}")
    assert export.main([checkpoint, str(tmp_path / "new.safetensors")]) == 2
    assert "config" in capsys.readouterr().err
    assert export.main([checkpoint, str(victim), "--force"]) == 0
    assert victim.read_bytes()[:8] != b"another "
    assert export.main([checkpoint, str(victim), "--force"]) == 0  # again: the same file


def assert_refused(argv, folder, said, capsys):
    """export.main(argv) says `said` in one line, exit 2, and leaves `folder` as it was."""
    before = sorted(os.listdir(folder))
    assert export.main(argv) == 2
    out, err = capsys.readouterr()
    assert said in err and err.startswith("minimp.export: error: ") and len(err.splitlines()) == 1
    assert out == "" and sorted(os.listdir(folder)) == before, err


@pytest.mark.parametrize("edit, said", [case[1:] for case in GPT_EDITS],
                         ids=[case[0] for case in GPT_EDITS])
def test_an_edited_checkpoint_is_refused_in_one_line_and_nothing_is_written(
        gpt_checkpoint, tmp_path, capsys, edit, said):
    """Tracebacks (KeyError, ValueError) or, worse, exit 0 with a `block_size` 0, a context of a
    billion, a GPT exported as an MLP or a tensor that disagrees with its own config."""
    path = edited(gpt_checkpoint, tmp_path / "x.npz", **edit)
    assert_refused([path, str(tmp_path / "out.safetensors")], tmp_path,
                   f"checkpoint {path}: {said}", capsys)


@pytest.mark.parametrize("edit, said", [
    (dict(flags={"--layers": 2}), "--layers 2 needs 6 masters (a weight and a bias per Linear)"),
    (dict(flags={"--hidden": 8}), "master/0.weight has shape (16, 64), --hidden 8 needs (8, 64)"),
    (dict(arrays={"master/2.weight": np.zeros((10, 15), np.float32)}),
     "master/2.weight has shape (10, 15), the model of its flags needs (10, 16)"),
])
def test_an_edited_mlp_checkpoint_is_refused(mlp_checkpoint, tmp_path, capsys, edit, said):
    path = edited(mlp_checkpoint, tmp_path / "x.npz", **edit)
    assert_refused([path, str(tmp_path / "out.safetensors")], tmp_path, said, capsys)


@pytest.mark.parametrize("layers, hidden", [(1, 16), (3, 5)])
def test_the_mlp_check_knows_the_mlp_that_training_builds(layers, hidden):
    """checkpoint.check_mlp accepts the masters of the MLP training builds and refuses them
    under another --hidden; checkpoint.DATASETS (checkpoints import nothing of train) are those
    train knows."""
    model = build_model(64, 10, hidden, layers, np.random.default_rng(0))
    masters = {name: p.data for name, p in model.named_parameters()}
    flags = {"--layers": layers, "--hidden": hidden}
    checkpoint.check_mlp("x.npz", flags, masters, 64, 10)
    with pytest.raises(CheckpointError):
        checkpoint.check_mlp("x.npz", {**flags, "--hidden": hidden + 1}, masters, 64, 10)
    assert checkpoint.DATASETS == tuple(DATASET_DEFAULTS)


def test_a_cast_that_overflows_the_dtype_is_refused(gpt_checkpoint, tmp_path, capsys):
    """A weight of 1e6 was written as inf in fp16, exit 0; bf16 holds it."""
    with np.load(gpt_checkpoint) as archive:
        weight = archive["master/1.mlp.c_fc.weight"].copy()
    weight[3, 4] = -1e6
    path = edited(gpt_checkpoint, tmp_path / "big.npz",
                  arrays={"master/1.mlp.c_fc.weight": weight})
    out = str(tmp_path / "out.safetensors")
    said = ("--dtype fp16: transformer.h.0.mlp.c_fc.weight holds |weight| 1e+06, above fp16's "
            "largest 65504; export with --dtype bf16 or fp32")
    assert_refused([path, out, "--dtype", "fp16"], tmp_path, said, capsys)
    assert export.main([path, out, "--dtype", "bf16"]) == 0


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[1]), int(sys.argv[1])))
from minimp.export import main
sys.exit(main(sys.argv[2:]))
"""


def test_an_export_to_a_full_disk_is_one_line_and_leaves_nothing(gpt_checkpoint, tmp_path):
    """It was a 25-line OSError traceback. The GPT's tensors (~100 KB) outgrow a 20 KB limit."""
    folder = tmp_path / "out"
    folder.mkdir()
    result = subprocess.run([PYTHON, "-c", FULL_DISK, "20000", str(gpt_checkpoint),
                             str(folder / "gpt.safetensors")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stderr.startswith(
        f"minimp.export: error: {folder / 'gpt.safetensors'} could not be written (File too large)"
    ) and len(result.stderr.splitlines()) == 1, result.stderr
    assert os.listdir(folder) == []


def test_an_empty_output_or_one_naming_a_folder_is_refused_before_a_folder_is_made(
        gpt_checkpoint, tmp_path, capsys):
    """`""` was a FileNotFoundError traceback; `newdir/` a NotADirectoryError traceback that left
    newdir behind."""
    assert_refused([str(gpt_checkpoint), ""], tmp_path, "output is empty; give a file name", capsys)
    assert_refused([str(gpt_checkpoint), str(tmp_path / "newdir") + os.sep], tmp_path,
                   "names a folder", capsys)


def torch_gpt(torch, config):
    """nanoGPT's module tree (its parameter names) in PyTorch, for the export to load into."""
    nn, width, heads = torch.nn, config["n_embd"], config["n_head"]

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1, self.ln_2 = nn.LayerNorm(width), nn.LayerNorm(width)
            self.attn = nn.Module()
            self.attn.c_attn = nn.Linear(width, 3 * width)
            self.attn.c_proj = nn.Linear(width, width)
            self.mlp = nn.Module()
            self.mlp.c_fc = nn.Linear(width, 4 * width)
            self.mlp.c_proj = nn.Linear(4 * width, width)

        def forward(self, x):
            batch, tokens, _ = x.shape
            q, k, v = self.attn.c_attn(self.ln_1(x)).split(width, dim=2)
            q, k, v = (t.view(batch, tokens, heads, -1).transpose(1, 2) for t in (q, k, v))
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.attn.c_proj(y.transpose(1, 2).reshape(batch, tokens, width))
            hidden = nn.functional.gelu(self.mlp.c_fc(self.ln_2(x)), approximate="tanh")
            return x + self.mlp.c_proj(hidden)

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.transformer = nn.ModuleDict(
                dict(
                    wte=nn.Embedding(config["vocab_size"], width),
                    wpe=nn.Embedding(config["block_size"], width),
                    h=nn.ModuleList(Block() for _ in range(config["n_layer"])),
                    ln_f=nn.LayerNorm(width),
                )
            )

        def forward(self, ids):
            t = self.transformer
            x = t.wte(ids) + t.wpe(torch.arange(ids.shape[1]))
            for block in t.h:
                x = block(x)
            return t.ln_f(x) @ t.wte.weight.T  # lm_head tied to wte, as the config says

    return GPT()


def test_pytorch_loads_the_export_into_its_own_gpt(gpt_checkpoint, tmp_path):
    torch = pytest.importorskip("torch", reason="PyTorch is not installed (never a dependency)")
    from safetensors.torch import load_file

    out = tmp_path / "gpt.safetensors"
    assert export.main([str(gpt_checkpoint), str(out)]) == 0
    config = json.loads((tmp_path / "gpt.json").read_text())
    model = torch_gpt(torch, config)
    model.load_state_dict(load_file(str(out)))  # strict: every name matches, none is missing
    ids = np.random.default_rng(1).integers(0, 65, (2, 16))
    with torch.no_grad():
        theirs = model(torch.from_numpy(ids)).numpy()
    np.testing.assert_allclose(minimp_logits(gpt_checkpoint, ids), theirs, rtol=1e-4, atol=1e-4)
