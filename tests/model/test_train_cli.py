"""`vitserve train`'s flags: made from TrainConfig and AugmentConfig (model.config), each parsed into its field,
help showing the dataclasses' defaults, and no torch until `train` runs."""
from __future__ import annotations

import csv
import dataclasses
import json
import re
import shlex
import subprocess
import sys
import typing
from dataclasses import replace
from pathlib import Path

import pytest
from PIL import Image

import vitserve.model.augment
import vitserve.model.config
import vitserve.model.data
import vitserve.model.train
from vitserve.model.augment import AugmentConfig
from vitserve.model.cli import _rounded, command_line, train_config
from vitserve.model.train import TrainConfig
from vitserve.model.vit import ViTConfig
from training_fixtures import read_strict_json, write_image_folder
from vitserve.cli import build_parser, main

REPO = Path(__file__).resolve().parents[2]

EVERY_FLAG = [
    "--data", "photos", "--data-dir", "/data/fm", "--model", "S/16", "--image-size", "32x40", "--patch-size", "8",
    "--embed-dim", "64", "--depth", "3", "--num-heads", "4", "--mlp-dim", "128", "--dropout", "0.1",
    "--attention-dropout", "0.2", "--representation-size", "32", "--backbone-layers", "2,2", "--backbone-width", "32",
    "--channels", "1", "--epochs", "7",
    "--batch-size", "16", "--lr", "0.002", "--min-lr", "1e-6", "--weight-decay", "0.1", "--warmup-epochs", "0.5",
    "--label-smoothing", "0.0", "--grad-clip", "0", "--seed", "5", "--crop", "rrc", "--crop-padding", "4",
    "--rrc-scale", "0.5", "0.9", "--rrc-ratio", "0.8", "1.25", "--no-hflip", "--erasing-prob", "0.5",
    "--erasing-scale", "0.1", "0.2", "--erasing-ratio", "0.5", "2", "--out", "runs/x", "--resume",
    "--pretrain", "masked-patch", "--label-fraction", "0.1",
    "--init-from", "runs/old/checkpoint", "--distill-from", "t1/checkpoint", "--distill-from", "t2",
    "--distill-weight", "0.7", "--distill-temperature", "4", "--grid-sizes", "16,24,32",
    "--val-fraction", "0.2", "--max-steps-per-epoch", "9", "--time-limit", "30",
    "--save-every", "2.5", "--name", "cats", "--version", "2", "--threads", "3", "--no-progress",
]
EVERY_FIELD_CHANGED = TrainConfig(
    data="photos", data_dir="/data/fm", model="S/16",
    model_overrides=dict(image_size=[32, 40], patch_size=8, embed_dim=64, depth=3, num_heads=4, mlp_dim=128,
                         dropout=0.1, attention_dropout=0.2, representation_size=32, backbone_layers=(2, 2),
                         backbone_width=32),
    channels=1, epochs=7, batch_size=16, lr=0.002, min_lr=1e-6, weight_decay=0.1, warmup_epochs=0.5,
    label_smoothing=0.0, grad_clip=0.0, seed=5,
    augment=AugmentConfig(crop="rrc", crop_padding=4, rrc_scale=(0.5, 0.9), rrc_ratio=(0.8, 1.25), hflip=False,
                          erasing_prob=0.5, erasing_scale=(0.1, 0.2), erasing_ratio=(0.5, 2.0)),
    out_dir="runs/x", resume=True, pretrain="masked-patch", label_fraction=0.1, init_from="runs/old/checkpoint",
    distill_from=("t1/checkpoint", "t2"), distill_weight=0.7, distill_temperature=4.0, grid_sizes=(16, 24, 32),
    val_fraction=0.2, max_steps_per_epoch=9,
    time_limit=30.0, save_every=2.5, name="cats", version="2", threads=3, progress=False)


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
                                  ["--epochs", "2.5"], ["--rrc-scale", "0.5"], ["--grid-sizes", "20,x"]])
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
    if value is None or value == ():
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
                 "--attention-dropout", "--representation-size", "--backbone-layers", "--backbone-width"]
    assert set(entries) == {"-h", "--quick", *expected, *overrides}
    assert entries["--image-size"].endswith("(default: Fashion-MNIST's 28; an image folder's is the variant's: "
                                            "fmnist 28, others 224, --init-from the checkpoint's)")
    assert entries["--quick"].endswith("--epochs 1 --max-steps-per-epoch 100, unless given (the default model: a "
                                       "minute or two on two CPU cores, about 50% test accuracy) (default: off)")
    assert all(entry.count("(default:") == 1 for flag, entry in entries.items() if flag != "-h"), entries
    for flag in overrides[1:]:
        assert entries[flag].endswith("(default: the variant's)"), entries[flag]
    assert entries["--crop"].startswith("--crop {pad,rrc,none} pad: random crop")


NO_TORCH = """
import contextlib, io, sys
import vitserve.model.config
print("torch" in sys.modules, "numpy" in sys.modules)
import vitserve.model.cli
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
    assert vitserve.model.train.TrainConfig is vitserve.model.config.TrainConfig
    assert vitserve.model.train.AugmentConfig is vitserve.model.augment.AugmentConfig is vitserve.model.config.AugmentConfig
    assert vitserve.model.data.FASHION_MNIST_DIR == vitserve.model.config.FASHION_MNIST_DIR == TrainConfig().data_dir


def test_model_override_flags_have_the_vit_config_types():
    # model.config writes those types down (ViTConfig's module imports torch); they must stay ViTConfig's.
    hints = typing.get_type_hints(ViTConfig)
    flags = TrainConfig.__dataclass_fields__["model_overrides"].metadata["flags"]
    assert {name: hint for name, (hint, _) in flags.items()} == {name: hints[name] for name in flags}


TINY_FLAGS = ["--model", "tiny", "--patch-size", "4", "--embed-dim", "16", "--depth", "1", "--num-heads", "2",
              "--mlp-dim", "32", "--channels", "1", "--image-size", "8", "--no-progress"]


def test_train_command_runs_a_tiny_model(tmp_path, capsys):
    data = write_image_folder(tmp_path / "data", {"a": 4, "b": 4})
    out = tmp_path / "run"
    code = main(["train", "--data", str(data), *TINY_FLAGS, "--epochs", "1", "--batch-size", "4",
                 "--max-steps-per-epoch", "1", "--val-fraction", "0.25", "--out", str(out), "--name", "cli-run"])
    assert code == 0
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert row["epoch"] == 1
    saved = read_strict_json(out / "checkpoint" / "config.json")
    assert saved["name"] == "cli-run" and saved["labels"] == ["a", "b"]
    assert {k: saved["architecture"][k] for k in ("image_size", "patch_size", "embed_dim", "depth", "in_channels")} == {
        "image_size": [8, 8], "patch_size": 4, "embed_dim": 16, "depth": 1, "in_channels": 1}


def test_help_says_what_a_run_without_flags_does(capsys, monkeypatch):
    from vitserve.model.vit import VisionTransformer, count_parameters, vit_config

    monkeypatch.setenv("COLUMNS", "300")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "With no flags: the fmnist variant (805k parameters) on Fashion-MNIST for 40 epochs" in text
    assert round(count_parameters(VisionTransformer(vit_config("fmnist"))) / 1000) == 805
    assert (TrainConfig().model, TrainConfig().data, TrainConfig().epochs) == ("fmnist", "fashion-mnist", 40)
    assert "on Ctrl-C, which then exits with status 130; the same command with --resume continues from there" in text


def test_quick_makes_one_short_epoch_unless_told_otherwise():
    assert parse("--quick") == TrainConfig(epochs=1, max_steps_per_epoch=100)
    assert parse("--quick", "--epochs", "3") == TrainConfig(epochs=3, max_steps_per_epoch=100)
    assert parse("--max-steps-per-epoch", "7", "--quick") == TrainConfig(epochs=1, max_steps_per_epoch=7)


@pytest.mark.parametrize("config", [TrainConfig(), EVERY_FIELD_CHANGED,
                                    TrainConfig(epochs=1, max_steps_per_epoch=100, out_dir="my runs/it's", lr=1 / 3)])
def test_command_line_makes_the_same_config(config):
    words = shlex.split(command_line(config))
    assert words[:2] == ["vitserve", "train"] and parse(*words[2:]) == config


def test_command_line_names_only_what_differs_from_the_defaults():
    assert command_line(TrainConfig()) == "vitserve train"
    assert command_line(parse("--quick", "--out", "runs/q", "--resume", "--no-hflip", "--image-size", "32x40")) == (
        "vitserve train --image-size 32x40 --epochs 1 --no-hflip --out runs/q --resume --max-steps-per-epoch 100")


def train_error(capsys, *argv: str) -> str:
    """The one line `vitserve train` prints for a user's error, after checking that it exits 1 without a traceback."""
    assert main(["train", *argv, "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.splitlines()) == 1 and "Traceback" not in captured.err, captured.err
    return captured.err.strip()


@pytest.mark.parametrize("argv, message", [
    (["--epochs", "0"], "--epochs 0: must be at least 1"),
    (["--batch-size", "-4"], "--batch-size -4: must be at least 1"),
    (["--val-fraction", "0"], "--val-fraction 0.0: must be between 0 and 1"),
    (["--val-fraction", "1"], "--val-fraction 1.0: must be between 0 and 1"),
    (["--label-fraction", "0"], "--label-fraction 0.0: must be above 0 and at most 1"),
    (["--label-fraction", "1.5"], "--label-fraction 1.5: must be above 0 and at most 1"),
    (["--max-steps-per-epoch", "0"], "--max-steps-per-epoch 0: must be at least 1"),
    (["--time-limit", "0"], "--time-limit 0.0: must be above 0"),
    (["--save-every", "-1"], "--save-every -1.0: must be 0 or more"),
    (["--grid-sizes", "0,8"], "--grid-sizes 0,8: each must be at least 1"),
])
def test_a_bad_flag_value_is_one_line(argv, message, capsys, tmp_path):
    assert train_error(capsys, *argv, "--out", str(tmp_path / "run")) == f"vitserve train: error: {message}"
    assert not (tmp_path / "run").exists()


def test_data_errors_are_one_line(capsys, tmp_path):
    out = ["--out", str(tmp_path / "run"), *TINY_FLAGS]
    missing = tmp_path / "missing"
    assert train_error(capsys, "--data", str(missing), *out) == (
        f"vitserve train: error: {missing}: no such directory (an image folder has one sub-folder of images per class)")
    (tmp_path / "flat").mkdir()
    Image.new("L", (8, 8)).save(tmp_path / "flat" / "loose.png")
    assert train_error(capsys, "--data", str(tmp_path / "flat"), *out) == (
        f"vitserve train: error: {tmp_path / 'flat'} has no class sub-folders (one folder of images per class)")
    lonely = write_image_folder(tmp_path / "lonely", {"a": 4, "b": 1, "c": 1})
    assert train_error(capsys, "--data", str(lonely), *out) == (
        f"vitserve train: error: {lonely}: every class needs at least 2 images, one to train on and one to hold out "
        "for validation; too few in 'b' (1), 'c' (1)")
    empty = write_image_folder(tmp_path / "empty", {"a": 2, "b": 2})
    (empty / "c").mkdir()
    (empty / "c" / "notes.txt").write_text("no images here")
    assert train_error(capsys, "--data", str(empty), *out).startswith(
        f"vitserve train: error: {empty}: no images (.bmp, .gif, .jpeg, .jpg, .png, .tif, .tiff, .webp) in the class "
        "folder(s) 'c'")
    broken = write_image_folder(tmp_path / "broken", {"a": 2, "b": 2})
    (broken / "b" / "2.png").write_bytes(b"not a png")
    assert train_error(capsys, "--data", str(broken), *out).startswith(
        f"vitserve train: error: {broken / 'b' / '2.png'}: not a readable image (")
    assert train_error(capsys, "--data-dir", str(missing), *out) == (
        f"vitserve train: error: {missing}/train-images-idx3-ubyte[.gz] not found; install Debian's "
        "dataset-fashion-mnist or pass --data-dir")
    good = write_image_folder(tmp_path / "good", {"a": 2, "b": 2})
    assert train_error(capsys, "--data", str(good), "--init-from", str(missing), *out).startswith(
        f"vitserve train: error: {missing}/config.json not found")
    assert not (tmp_path / "run").exists()


def test_a_small_folder_trains_with_the_default_batch_size(tmp_path, capsys):
    """3 classes of 4 images: one of each held out, the batch cut to the 9 left, and a plan and next steps said."""
    data = write_image_folder(tmp_path / "data", {"a": 4, "b": 4, "c": 4})
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), *TINY_FLAGS, "--epochs", "2", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[:2] == ["batch size 9: --batch-size 128 is more than the 9 training images",
                       f"data: image folder {data}: 9 training and 3 validation images, 3 classes, 1x8x8"]
    assert re.fullmatch(r"model: tiny, [\d,]+ parameters \(1 blocks, width 16, 2 heads, 4x4 patches: a 2x2 grid\)",
                        err[2]), err[2]
    assert err[3].startswith("plan: 2 epoch(s) of 1 steps = 2 steps of 9 images; lr warm-up 1 steps to 0.001, cosine "
                             "to 1e-05; on "), err[3]
    assert err[4] == (f"files: {out}/ checkpoint/ (at each epoch's end, every 10 min and on Ctrl-C), log.csv, "
                      "steps.csv, curves.png, train_state.pt (for --resume)")
    assert [line.split(":")[0] for line in err[5:7]] == ["epoch 1/2", "epoch 2/2"]
    config = read_strict_json(out / "checkpoint" / "config.json")
    accuracy = config["metrics"]["test_accuracy"]
    assert accuracy in (0, 1 / 3, 2 / 3, 1) and config["training"]["batch_size"] == 9
    assert err[7:] == [f"checkpoint: {out}/checkpoint (held-out accuracy {100 * accuracy:.2f}% after epoch 2 (step 2))",
                       f"next: vitserve export {out}/checkpoint --out {out}/model.onnx",
                       f"      vitserve serve --model {out}/model.onnx"]
    row = json.loads(captured.out)
    assert (row["epoch"], row["step"], row["test_acc"]) == (2, 2, round(accuracy, 4))
    assert row["lr"] == 0.001  # step 1 of 2: the warm-up was step 0, the cosine starts at the peak


def test_an_empty_held_out_split_writes_null_not_nan(tmp_path, capsys, monkeypatch):
    # The CLI no longer makes an empty held-out split; if one came (a library caller's data), no NaN is written.
    data = vitserve.model.data.load_image_folder(write_image_folder(tmp_path / "data", {"a": 3, "b": 3}), (8, 8), 1, 0.0)
    monkeypatch.setattr(vitserve.model.train, "load_data", lambda cfg, size: data)
    out = tmp_path / "run"
    assert main(["train", "--data", "synthetic", *TINY_FLAGS, "--epochs", "1", "--out", str(out)]) == 0
    row = json.loads(capsys.readouterr().out, parse_constant=pytest.fail)
    assert row["test_acc"] is None and row["test_loss"] is None and row["train_loss"] > 0
    metrics = read_strict_json(out / "checkpoint" / "config.json")["metrics"]
    assert metrics == {"test_accuracy": None, "test_loss": None, "epoch": 1}


@pytest.mark.slow
def test_ctrl_c_saves_says_how_to_resume_and_exits_130(tmp_path, capsys, interrupt_at_step):
    data = write_image_folder(tmp_path / "data", {"a": 8, "b": 8})  # 7 + 7 to train on: 3 steps of 4 per epoch
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), *TINY_FLAGS, "--epochs", "2", "--batch-size", "4", "--out", str(out)]
    interrupt_at_step(5)
    assert main(argv) == 130
    err = capsys.readouterr().err.splitlines()
    assert "Ctrl-C: stopping after this step to save (Ctrl-C again: stop now, unsaved)" in err
    assert err[-2] == (f"vitserve train: interrupted at epoch 1.6667 (step 5 of 6); the checkpoint and training state "
                       f"are saved in {out}")
    resume = shlex.split(err[-1].removeprefix("continue with: "))
    assert err[-1].startswith("continue with: vitserve train ") and parse(*resume[2:]) == replace(
        parse(*argv[1:]), resume=True)
    assert read_strict_json(out / "checkpoint" / "config.json")["metrics"] == {"epoch": 1.6667, "step": 5}

    assert main(resume[1:]) == 0
    err = capsys.readouterr().err.splitlines()
    assert "resuming at epoch 2, batch 2 (step 5 of 6)" in err
    with open(out / "log.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["3", "6"]
    with open(out / "steps.csv") as f:
        assert [row["step"] for row in csv.DictReader(f)] == ["1", "2", "3", "4", "5", "6"]


def test_a_time_limit_says_how_far_it_came_and_how_to_continue(tmp_path, capsys):
    data = write_image_folder(tmp_path / "data", {"a": 8, "b": 8})
    out = tmp_path / "run"
    argv = ["train", "--data", str(data), *TINY_FLAGS, "--epochs", "2", "--batch-size", "4", "--out", str(out)]
    assert main([*argv, "--time-limit", "1e-9"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[-4] == (f"time limit reached at epoch 0.3333 of 2; continue with: vitserve train --data {data} "
                       "--model tiny --patch-size 4 --embed-dim 16 --depth 1 --num-heads 2 --mlp-dim 32 --image-size "
                       f"8x8 --channels 1 --epochs 2 --batch-size 4 --out {out} --resume --time-limit 1e-09 "
                       "--no-progress")
    assert err[-3].startswith(f"checkpoint: {out}/checkpoint (held-out accuracy ")
    assert err[-3].endswith("% after epoch 0.3333 (step 1))")
    assert main([*argv, "--resume"]) == 0
    assert "resuming at epoch 1, batch 1 (step 1 of 6)" in capsys.readouterr().err.splitlines()
    with open(out / "log.csv") as f:
        assert [row["epoch"] for row in csv.DictReader(f)] == ["0.3333", "1", "2"]


def test_the_printed_row_keeps_small_values():
    # Rounded to four decimals, the last learning rate of a run (about min_lr, 1e-05) was printed as 0.0.
    assert [_rounded(v) for v in (1.0980987e-05, 0.50543, 1234.56789, 7)] == [1.098e-05, 0.5054, 1234.5679, 7]
