"""`vitserve train`'s flags: made from TrainConfig and AugmentConfig (model.config), each parsed into its field,
help showing the dataclasses' defaults, and no torch until `train` runs."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import typing
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import model.augment
import model.config
import model.data
import model.train
from model.augment import AugmentConfig
from model.cli import train_config
from model.train import TrainConfig
from model.vit import ViTConfig
from vitserve.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]

EVERY_FLAG = [
    "--data", "photos", "--data-dir", "/data/fm", "--model", "S/16", "--image-size", "32x40", "--patch-size", "8",
    "--embed-dim", "64", "--depth", "3", "--num-heads", "4", "--mlp-dim", "128", "--dropout", "0.1",
    "--attention-dropout", "0.2", "--representation-size", "32", "--channels", "1", "--epochs", "7",
    "--batch-size", "16", "--lr", "0.002", "--min-lr", "1e-6", "--weight-decay", "0.1", "--warmup-epochs", "0.5",
    "--label-smoothing", "0.0", "--grad-clip", "0", "--seed", "5", "--crop", "rrc", "--crop-padding", "4",
    "--rrc-scale", "0.5", "0.9", "--rrc-ratio", "0.8", "1.25", "--no-hflip", "--erasing-prob", "0.5",
    "--erasing-scale", "0.1", "0.2", "--erasing-ratio", "0.5", "2", "--out", "runs/x", "--resume",
    "--init-from", "runs/old/checkpoint", "--val-fraction", "0.2", "--max-steps-per-epoch", "9", "--name", "cats",
    "--version", "2", "--threads", "3", "--no-progress",
]
EVERY_FIELD_CHANGED = TrainConfig(
    data="photos", data_dir="/data/fm", model="S/16",
    model_overrides=dict(image_size=[32, 40], patch_size=8, embed_dim=64, depth=3, num_heads=4, mlp_dim=128,
                         dropout=0.1, attention_dropout=0.2, representation_size=32),
    channels=1, epochs=7, batch_size=16, lr=0.002, min_lr=1e-6, weight_decay=0.1, warmup_epochs=0.5,
    label_smoothing=0.0, grad_clip=0.0, seed=5,
    augment=AugmentConfig(crop="rrc", crop_padding=4, rrc_scale=(0.5, 0.9), rrc_ratio=(0.8, 1.25), hflip=False,
                          erasing_prob=0.5, erasing_scale=(0.1, 0.2), erasing_ratio=(0.5, 2.0)),
    out_dir="runs/x", resume=True, init_from="runs/old/checkpoint", val_fraction=0.2, max_steps_per_epoch=9,
    name="cats", version="2", threads=3, progress=False)


def parse(*argv: str) -> TrainConfig:
    return train_config(build_parser().parse_args(["train", *argv]))


def test_no_flags_keep_the_dataclass_defaults():
    assert parse() == TrainConfig()


def test_every_flag_sets_its_field():
    # EVERY_FIELD_CHANGED really changes every field, so a field added without a flag fails here.
    for config, default in [(EVERY_FIELD_CHANGED, TrainConfig()), (EVERY_FIELD_CHANGED.augment, AugmentConfig())]:
        unchanged = [f.name for f in dataclasses.fields(config) if getattr(config, f.name) == getattr(default, f.name)]
        assert unchanged == []
    assert parse(*EVERY_FLAG) == EVERY_FIELD_CHANGED


@pytest.mark.parametrize("text, size", [("28", [28, 28]), ("32x40", [32, 40]), ("32X40", [32, 40]),
                                        ("32,40", [32, 40])])
def test_image_size_is_h_or_h_x_w(text, size):
    assert parse("--image-size", text).model_overrides == {"image_size": size}


def test_model_overrides_hold_only_the_flags_given():
    assert parse("--depth", "3", "--dropout", "0.25").model_overrides == {"depth": 3, "dropout": 0.25}
    assert parse("--model", "tiny").model_overrides == {}


def test_bool_flags_change_the_default():
    assert parse("--no-hflip").augment == AugmentConfig(hflip=False)
    assert parse("--no-progress") == TrainConfig(progress=False)
    assert parse("--resume") == TrainConfig(resume=True)
    assert parse("--out", "runs/y").out_dir == "runs/y"


@pytest.mark.parametrize("argv", [["--hflip"], ["--progress"], ["--crop", "centre"], ["--channels", "2"],
                                  ["--epochs", "2.5"], ["--rrc-scale", "0.5"]])
def test_invalid_flags_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exit:
        parse(*argv)
    assert exit.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error:" in error and argv[0] in error


def help_entries(capsys, monkeypatch) -> dict[str, str]:
    """`vitserve train --help` as {first option string: its whole entry on one line}."""
    monkeypatch.setenv("COLUMNS", "300")  # no wrapping inside a default
    with pytest.raises(SystemExit) as exit:
        main(["train", "--help"])
    assert exit.value.code == 0
    entries, key = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line.startswith("  -"):
            key = line.split()[0].rstrip(",")
            entries[key] = line
        elif key and line.startswith("    "):
            entries[key] += line
    return {k: " ".join(v.split()) for k, v in entries.items()}


def shown(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, tuple):
        return " ".join(shown(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


def expected_help(config) -> dict[str, str]:
    """{flag: the end of its help} for every plain field of a config, read from its values."""
    expected = {}
    for f in dataclasses.fields(config):
        value, name = getattr(config, f.name), f.metadata.get("flag", f.name).replace("_", "-")
        if isinstance(value, bool):
            expected[f"--no-{name}" if value else f"--{name}"] = f"(default: {'on' if value else 'off'})"
        elif not isinstance(value, (dict, AugmentConfig)):
            expected[f"--{name}"] = f"(default: {shown(value)})"
    return expected


def test_help_shows_every_default_from_the_dataclasses(capsys, monkeypatch):
    entries = help_entries(capsys, monkeypatch)
    expected = {**expected_help(TrainConfig()), **expected_help(TrainConfig().augment)}
    assert {"--epochs": "(default: 40)", "--out": "(default: runs/train)", "--no-hflip": "(default: on)",
            "--max-steps-per-epoch": "(default: none)", "--rrc-ratio": "(default: 0.75 1.33333)"}.items() <= (
        expected.items())
    for flag, default in expected.items():
        assert entries[flag].endswith(default), entries[flag]
    overrides = ["--image-size", "--patch-size", "--embed-dim", "--depth", "--num-heads", "--mlp-dim", "--dropout",
                 "--attention-dropout", "--representation-size"]
    assert set(entries) == {"-h", *expected, *overrides}
    assert entries["--image-size"].endswith("(default: the data's own)")
    for flag in overrides[1:]:
        assert entries[flag].endswith("(default: the variant's)"), entries[flag]
    assert entries["--crop"].startswith("--crop {pad,rrc,none} pad: random crop")


NO_TORCH = """
import contextlib, io, sys
import model.config
print("torch" in sys.modules, "numpy" in sys.modules)
import model.cli
from vitserve.cli import build_parser
parser = build_parser()
parser.format_help()
parser.parse_args(["import", "weights.pth", "--format", "timm", "--out", "ckpt"])
for argv in (["train", "--depth", "3", "--no-hflip", "--rrc-scale", "0.5", "1"], ["train", "--help"]):
    with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
        parser.parse_args(argv)
print("torch" in sys.modules)
"""


def test_building_the_parsers_does_not_import_torch():
    # model.config alone imports neither torch nor numpy; the whole parser, `train --help` included, no torch.
    result = subprocess.run([sys.executable, "-c", NO_TORCH], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False", "False"]


def test_the_configs_live_in_model_config_and_keep_their_old_homes():
    assert model.train.TrainConfig is model.config.TrainConfig
    assert model.train.AugmentConfig is model.augment.AugmentConfig is model.config.AugmentConfig
    assert model.data.FASHION_MNIST_DIR == model.config.FASHION_MNIST_DIR == TrainConfig().data_dir


def test_model_override_flags_have_the_vit_config_types():
    # model.config writes those types down (ViTConfig's module imports torch); they must stay ViTConfig's.
    hints = typing.get_type_hints(ViTConfig)
    flags = TrainConfig.__dataclass_fields__["model_overrides"].metadata["flags"]
    assert {name: hint for name, (hint, _) in flags.items()} == {name: hints[name] for name in flags}


def test_train_command_runs_a_tiny_model(tmp_path, capsys):
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (tmp_path / "data" / name).mkdir(parents=True)
        for i in range(4):
            Image.fromarray(rng.integers(0, 255, (8, 8), dtype=np.uint8)).save(tmp_path / "data" / name / f"{i}.png")
    out = tmp_path / "run"
    code = main(["train", "--data", str(tmp_path / "data"), "--channels", "1", "--image-size", "8", "--model", "tiny",
                 "--patch-size", "4", "--embed-dim", "16", "--depth", "1", "--num-heads", "2", "--mlp-dim", "32",
                 "--epochs", "1", "--batch-size", "4", "--max-steps-per-epoch", "1", "--val-fraction", "0.25",
                 "--out", str(out), "--name", "cli-run", "--no-progress"])
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["epoch"] == 1
    saved = json.loads((out / "checkpoint" / "config.json").read_text())
    assert saved["name"] == "cli-run" and saved["labels"] == ["a", "b"]
    assert {k: saved["architecture"][k] for k in ("image_size", "patch_size", "embed_dim", "depth", "in_channels")} == {
        "image_size": [8, 8], "patch_size": 4, "embed_dim": 16, "depth": 1, "in_channels": 1}
