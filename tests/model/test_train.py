"""The training loop on a tiny image folder: loss goes down, files are written, resume and fine-tuning work."""
from __future__ import annotations

import csv
import gzip
import math
import os
import signal
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

import vitserve.model.train as train_module
from vitserve.model.augment import AugmentConfig
from vitserve.model.checkpoint import load_checkpoint
from vitserve.model.data import load_image_folder
from vitserve.model.train import (TrainConfig, TrainingInterrupted, TrainLog, build_model, curve_series, load_data, lr_at,
                         steps_per_epoch, trailing_mean, train)
from training_fixtures import read_strict_json, write_image_folder
from vitserve.machine import cpu_model_name

TINY = dict(image_size=(16, 16), patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
EPOCHS, STEPS = 4, 10  # 60 training images in batches of 6


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """40 grey 16x16 PNGs per class: 'bottom' has a bright lower half, 'top' a bright upper half, plus noise."""
    root = tmp_path_factory.mktemp("data") / "folder"
    rng = np.random.default_rng(0)
    for name, rows in [("top", slice(0, 8)), ("bottom", slice(8, 16))]:
        (root / name).mkdir(parents=True)
        for i in range(40):
            image = rng.integers(0, 80, (16, 16), dtype=np.uint8)
            image[rows] += 150
            Image.fromarray(image).save(root / name / f"{i}.png")
    return root


def tiny_config(image_folder, out_dir, **changes) -> TrainConfig:
    cfg = TrainConfig(data=str(image_folder), model="tiny", model_overrides=dict(TINY), channels=1,
                      epochs=EPOCHS, batch_size=6, lr=3e-3, min_lr=1e-5, warmup_epochs=1.0,
                      augment=AugmentConfig(crop="none", hflip=True, erasing_prob=0.25),
                      val_fraction=0.25, out_dir=str(out_dir), progress=False, name="tiny-run", version="3")
    return replace(cfg, **changes)


@pytest.fixture(scope="module")
def trained(image_folder, tmp_path_factory):
    """One uninterrupted four-epoch run, shared by the tests that inspect or continue it."""
    out = tmp_path_factory.mktemp("run")
    row = train(tiny_config(image_folder, out))
    return out, row


def read_log(out_dir, name: str = "log.csv") -> list[dict]:
    with open(out_dir / name) as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def test_training_lowers_the_loss(trained):
    out, row = trained
    rows = read_log(out)
    # The head starts at zero, so before training every prediction is uniform: loss ln 2 on two classes.
    assert rows[-1]["test_loss"] < 0.75 * math.log(2)
    assert rows[-1]["train_loss"] < rows[0]["train_loss"]
    assert rows[-1]["test_acc"] >= 0.9  # the halves are easy once learned
    assert (row["epoch"], row["step"]) == (EPOCHS, EPOCHS * STEPS)


def test_untrained_model_loss_is_ln_k(image_folder, tmp_path):
    cfg = tiny_config(image_folder, tmp_path)
    splits = load_data(cfg, TINY["image_size"])
    model, _ = build_model(cfg, splits)
    with torch.no_grad():
        x = (splits.test.images.float() / 255 - 0.5) / 0.5
        loss = F.cross_entropy(model(x), splits.test.labels)
    assert loss.item() == pytest.approx(math.log(2), abs=1e-6)


def test_training_writes_log_plot_and_checkpoint(trained, image_folder):
    out, row = trained
    rows = read_log(out)
    assert list(rows[0]) == ["epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc",
                             "images_per_s", "elapsed_s"]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and [r["step"] for r in rows] == [10, 20, 30, 40]
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["elapsed_s"] < rows[3]["elapsed_s"]
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "train_state.pt").is_file()
    steps = read_log(out, "steps.csv")
    assert [s["step"] for s in steps] == list(range(1, 41)) and steps[9]["epoch"] == 1 and steps[14]["epoch"] == 1.5
    for epoch in range(4):  # an epoch's logged training loss is the mean of its steps' (equal batches)
        assert rows[epoch]["train_loss"] == pytest.approx(sum(s["train_loss"] for s in steps[10 * epoch:][:10]) / 10)

    model, meta = load_checkpoint(out / "checkpoint")
    assert meta.labels == ["bottom", "top"] and (meta.name, meta.version) == ("tiny-run", "3")
    assert meta.config.image_size == (16, 16) and meta.config.in_channels == 1 and meta.config.depth == 2
    assert (meta.mean, meta.std) == ([0.5], [0.5])
    assert meta.metrics == {"test_accuracy": row["test_acc"], "test_loss": row["test_loss"], "epoch": 4}
    assert meta.training["epochs_done"] == 4 and meta.training["train_images"] == 60
    assert meta.training["parameters"] == sum(p.numel() for p in model.parameters())
    assert meta.training["model_overrides"]["embed_dim"] == 32 and meta.training["torch"] == torch.__version__
    assert meta.training["cpu"] == cpu_model_name()  # where the times were measured: the report says so
    assert read_strict_json(out / "checkpoint" / "config.json")["training"]["epochs_done"] == 4

    # The checkpoint is the model that was evaluated: its accuracy on the validation split is the one logged.
    splits = load_image_folder(image_folder, (16, 16), 1, 0.25, 0)
    with torch.no_grad():
        logits = model((splits.test.images.float() / 255 - 0.5) / 0.5)
    assert len(splits.test) == 20
    assert (logits.argmax(1) == splits.test.labels).float().mean().item() == row["test_acc"]
    assert F.cross_entropy(logits, splits.test.labels).item() == pytest.approx(row["test_loss"], abs=1e-5)


def weights(out_dir) -> dict[str, torch.Tensor]:
    return load_file(str(out_dir / "checkpoint" / "model.safetensors"))


def assert_same_run(out_dir, reference_dir) -> None:
    """Same weights, same logged training and evaluation values, step for step."""
    for name, value in weights(reference_dir).items():
        assert torch.equal(weights(out_dir)[name], value), name
    for log in ("log.csv", "steps.csv"):
        with open(out_dir / log) as f, open(reference_dir / log) as g:
            rows, reference = list(csv.DictReader(f)), list(csv.DictReader(g))
        keys = ["step", "lr", "train_loss", "train_acc"] + (["test_loss", "test_acc"] if log == "log.csv" else [])
        assert [[r[k] for k in keys] for r in rows] == [[r[k] for k in keys] for r in reference], log


@pytest.mark.slow
def test_ctrl_c_mid_epoch_saves_and_resume_continues_exactly(trained, image_folder, tmp_path, interrupt_at_step):
    """Ctrl-C in epoch 2's sixth step: that step completes and is saved; resumed, the run ends exactly as the
    uninterrupted one."""
    full_out, full_row = trained
    handler = signal.getsignal(signal.SIGINT)
    interrupt_at_step(16)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(tiny_config(image_folder, tmp_path))
    assert (stopped.value.epochs_done, stopped.value.step, stopped.value.total_steps) == (1.6, 16, 40)
    assert stopped.value.out_dir == tmp_path and isinstance(stopped.value, KeyboardInterrupt)
    assert [r["step"] for r in read_log(tmp_path)] == [10]
    assert len(read_log(tmp_path, "steps.csv")) == 16
    _, meta = load_checkpoint(tmp_path / "checkpoint")
    assert meta.metrics == {"epoch": 1.6, "step": 16} and meta.training["epochs_done"] == 1.6
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert (state["epoch"], state["batch"], state["step"]) == (1, 6, 16) and state["sums"][2] == 36
    assert signal.getsignal(signal.SIGINT) is handler  # put back after the run

    row = train(tiny_config(image_folder, tmp_path, resume=True))
    assert row == {**full_row, "images_per_s": row["images_per_s"], "elapsed_s": row["elapsed_s"]}
    assert_same_run(tmp_path, full_out)
    assert load_checkpoint(tmp_path / "checkpoint")[1].metrics["epoch"] == 4

    # Resuming a finished run trains nothing more.
    assert train(tiny_config(image_folder, tmp_path, resume=True)) == {}
    assert len(read_log(tmp_path)) == 4


@pytest.mark.slow
def test_ctrl_c_during_an_evaluation_stops_at_the_epoch_end_it_saved(trained, image_folder, tmp_path, monkeypatch):
    """Pressed while epoch 2 is evaluated, Ctrl-C stops the run there; a state saved that way, stripped of what
    states before mid-epoch saves lacked (training/vit-fmnist's has no batch, no sums), still resumes exactly."""
    full_out, _ = trained
    evaluate_and_save = train_module.evaluate_and_save

    def press_ctrl_c_during_epoch_2(run, pos, *args):
        row = evaluate_and_save(run, pos, *args)
        if pos.epoch == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return row

    monkeypatch.setattr(train_module, "evaluate_and_save", press_ctrl_c_during_epoch_2)
    with pytest.raises(TrainingInterrupted) as stopped:
        train(tiny_config(image_folder, tmp_path))
    assert (stopped.value.epochs_done, stopped.value.step) == (2, 20)
    assert [r["step"] for r in read_log(tmp_path)] == [10, 20]
    monkeypatch.setattr(train_module, "evaluate_and_save", evaluate_and_save)
    state = torch.load(tmp_path / "train_state.pt", weights_only=False)
    assert (state["epoch"], state["batch"], state["step"]) == (2, 0, 20)
    torch.save({k: v for k, v in state.items() if k not in ("batch", "sums")}, tmp_path / "train_state.pt")
    row = train(tiny_config(image_folder, tmp_path, resume=True))
    assert (row["epoch"], row["step"]) == (4, 40)
    assert_same_run(tmp_path, full_out)


@pytest.mark.slow
def test_time_limit_ends_the_run_evaluated_and_resume_continues_exactly(image_folder, tmp_path):
    """A time limit shorter than a step stops after each step: each stop is evaluated and saved, and three
    sessions of one step make the same model as one session of three."""
    reference = tmp_path / "reference"
    train(tiny_config(image_folder, reference, epochs=1, max_steps_per_epoch=3))
    out = tmp_path / "limited"
    rows = [train(tiny_config(image_folder, out, epochs=1, max_steps_per_epoch=3, time_limit=1e-9, resume=True))
            for _ in range(3)]
    assert [(r["epoch"], r["step"]) for r in rows] == [(0.3333, 1), (0.6667, 2), (1, 3)]
    assert [r["epoch"] for r in read_log(out)] == [0.3333, 0.6667, 1]
    _, meta = load_checkpoint(out / "checkpoint")
    assert meta.metrics == {"test_accuracy": rows[-1]["test_acc"], "test_loss": rows[-1]["test_loss"], "epoch": 1}
    for name, value in weights(reference).items():
        assert torch.equal(weights(out)[name], value), name
    with open(out / "steps.csv") as f, open(reference / "steps.csv") as g:
        assert list(csv.DictReader(f)) == list(csv.DictReader(g))
    assert rows[-1]["test_acc"] == read_log(reference)[-1]["test_acc"]


@pytest.mark.slow
def test_saves_every_few_minutes_within_an_epoch(image_folder, tmp_path, monkeypatch):
    saves = []
    save_state = train_module.save_state

    def record(out_dir, optimizer, generator, pos, beside=None):
        saves.append((pos.epoch, pos.batch, pos.step, dict(train_module.load_meta(out_dir / "checkpoint").metrics)))
        save_state(out_dir, optimizer, generator, pos, beside)

    monkeypatch.setattr(train_module, "save_state", record)
    train(tiny_config(image_folder, tmp_path, epochs=1, max_steps_per_epoch=3, save_every=1e-9))
    test_acc = read_log(tmp_path)[-1]["test_acc"]
    assert [s[:3] for s in saves] == [(0, 1, 1), (0, 2, 2), (1, 0, 3)]
    assert [s[3] for s in saves[:2]] == [{"epoch": 0.3333, "step": 1}, {"epoch": 0.6667, "step": 2}]
    assert saves[2][3]["test_accuracy"] == test_acc
    saves.clear()
    train(tiny_config(image_folder, tmp_path / "epoch-ends", epochs=2, max_steps_per_epoch=3, save_every=0))
    assert [s[:3] for s in saves] == [(1, 0, 3), (2, 0, 6)]


def test_a_small_folder_holds_out_one_image_per_class_and_fits_the_batch(tmp_path, capsys):
    data = write_image_folder(tmp_path / "data", {"a": 4, "b": 4, "c": 4}, size=16)
    row = train(tiny_config(data, tmp_path / "run", batch_size=128, epochs=2, val_fraction=0.1))
    assert (row["epoch"], row["step"]) == (2, 2) and row["test_acc"] in (0, 1 / 3, 2 / 3, 1)
    meta = read_strict_json(tmp_path / "run" / "checkpoint" / "config.json")
    assert meta["training"]["batch_size"] == 9 and meta["training"]["train_images"] == 9
    assert "batch size 9: --batch-size 128 is more than the 9 training images" in capsys.readouterr().err.splitlines()


def test_an_image_folder_defaults_to_the_variants_resolution(tmp_path, trained):
    data = write_image_folder(tmp_path / "data", {"a": 2, "b": 2}, size=40)
    assert load_data(TrainConfig(data=str(data), model="fmnist"), None).train.images.shape[-2:] == (28, 28)
    assert load_data(TrainConfig(data=str(data), model="Ti/16"), None).train.images.shape[-2:] == (224, 224)
    out, _ = trained
    from_checkpoint = TrainConfig(data=str(data), init_from=str(out / "checkpoint"))
    assert load_data(from_checkpoint, None).train.images.shape[-2:] == (16, 16)
    assert load_data(TrainConfig(data=str(data)), (8, 12)).train.images.shape[-2:] == (8, 12)


def test_one_epoch_curves_are_drawn_per_step(image_folder, tmp_path):
    train(tiny_config(image_folder, tmp_path, epochs=1))
    log = TrainLog(tmp_path, resume_step=10**9)
    assert len(log.rows) == 1 and len(log.steps) == 10
    x_name, panels = curve_series(log.rows, log.steps)
    assert x_name == "step" and list(panels) == ["loss", "accuracy"]
    assert panels["loss"] == {"train": ([s["step"] for s in log.steps], [s["train_loss"] for s in log.steps]),
                              "test": ([10], [log.rows[0]["test_loss"]])}
    assert panels["accuracy"]["train (augmented)"][1] == pytest.approx([100 * s["train_acc"] for s in log.steps])
    assert panels["accuracy"]["test"] == ([10], [100 * log.rows[0]["test_acc"]])


def test_curves_of_many_epochs_are_drawn_per_epoch_and_long_step_curves_smoothed():
    rows = [{"epoch": e, "step": 10 * e, "train_loss": 1 / e, "train_acc": 0.5, "test_loss": 2 / e, "test_acc": 0.25}
            for e in range(1, 6)]
    steps = [{"step": s, "epoch": s / 10, "train_loss": s % 2, "train_acc": 1.0} for s in range(1, 51)]
    x_name, panels = curve_series(rows, steps)
    assert x_name == "epoch" and panels["loss"] == {"train": ([1, 2, 3, 4, 5], [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]),
                                                    "test": ([1, 2, 3, 4, 5], [2, 1, 2 / 3, 1 / 2, 2 / 5])}
    x_name, panels = curve_series(rows[:4], steps)
    assert x_name == "step" and list(panels["accuracy"]) == ["train (augmented, mean of 2 steps)", "test"]
    assert panels["loss"]["train, mean of 2 steps"] == (list(range(1, 51)), [1.0] + [0.5] * 49)
    assert trailing_mean([1, 2, 3, 4], 3) == [1, 1.5, 2, 3]


def test_lr_schedule():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-5)
    warmup, total = 10, 110
    assert lr_at(0, total, warmup, cfg) == pytest.approx(1e-4)  # linear warm-up from lr / warmup
    assert lr_at(4, total, warmup, cfg) == pytest.approx(5e-4)
    assert lr_at(9, total, warmup, cfg) == pytest.approx(1e-3)  # peak at the end of warm-up
    assert lr_at(10, total, warmup, cfg) == pytest.approx(1e-3)  # cosine starts at the peak
    assert lr_at(60, total, warmup, cfg) == pytest.approx(1e-5 + 0.5 * (1e-3 - 1e-5))  # half-way
    assert lr_at(110, total, warmup, cfg) == pytest.approx(1e-5)  # ends at min_lr
    assert lr_at(500, total, warmup, cfg) == pytest.approx(1e-5)  # and stays there
    lrs = [lr_at(s, total, warmup, cfg) for s in range(total)]
    assert all(a < b for a, b in zip(lrs[:9], lrs[1:10]))
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_logged_lr_follows_the_schedule(trained):
    out, _ = trained
    cfg = TrainConfig(lr=3e-3, min_lr=1e-5)
    # The log records the lr of each epoch's last step (steps 9, 19, 29, 39 of 40; warm-up is the first 10).
    assert [r["lr"] for r in read_log(out)] == pytest.approx([lr_at(s, 40, 10, cfg) for s in (9, 19, 29, 39)])
    assert read_log(out)[0]["lr"] == pytest.approx(3e-3)
    assert 1e-5 < read_log(out)[-1]["lr"] < 1e-4


def test_steps_per_epoch():
    cfg = TrainConfig(batch_size=8)
    assert steps_per_epoch(23, cfg, 1) == 2 and steps_per_epoch(24, cfg, 1) == 3
    assert steps_per_epoch(23, cfg, 2) == 2  # shards of 12 and 11: both ranks make 2 steps of 4
    assert steps_per_epoch(1000, replace(cfg, max_steps_per_epoch=7), 2) == 7
    with pytest.raises(ValueError, match="cannot fill one batch"):
        steps_per_epoch(5, cfg, 1)
    with pytest.raises(ValueError, match="cannot fill one batch"):
        steps_per_epoch(100, replace(cfg, batch_size=1), 2)


def test_max_steps_per_epoch(image_folder, tmp_path):
    row = train(tiny_config(image_folder, tmp_path, epochs=1, max_steps_per_epoch=2, lr=1e-3))
    assert (row["epoch"], row["step"]) == (1, 2)
    # The warm-up, one epoch, is capped at half the run: one step; the second step starts the cosine at the peak.
    assert row["lr"] == pytest.approx(lr_at(1, 2, 1, TrainConfig(lr=1e-3))) == pytest.approx(1e-3)
    assert [s["lr"] for s in read_log(tmp_path, "steps.csv")] == pytest.approx([1e-3, 1e-3])


def test_fine_tune_at_higher_resolution_resamples_position_embeddings(trained, image_folder):
    out, _ = trained
    source, _ = load_checkpoint(out / "checkpoint")
    cfg = tiny_config(image_folder, out, init_from=str(out / "checkpoint"),
                      model_overrides={**TINY, "image_size": (24, 24)})
    splits = load_data(cfg, (24, 24))
    assert splits.train.images.shape[-2:] == (24, 24)
    model, meta = build_model(cfg, splits)
    assert meta.config.image_size == (24, 24) and meta.config.grid_size == (6, 6)
    assert model.pos_embed.shape == (1, 37, 32)
    # Direct reference: the 4x4 grid of embeddings resized bicubically to 6x6, the class token's kept.
    grid = source.pos_embed[0, 1:].t().reshape(1, 32, 4, 4)
    resized = F.interpolate(grid, size=(6, 6), mode="bicubic", align_corners=False).reshape(32, 36).t()
    torch.testing.assert_close(model.pos_embed[0, 1:], resized, rtol=0, atol=1e-6)
    assert torch.equal(model.pos_embed[0, 0], source.pos_embed[0, 0])
    for name, value in source.state_dict().items():
        if name != "pos_embed":
            assert torch.equal(model.state_dict()[name], value), name  # same classes: the head is kept too
    x = torch.randn(2, 1, 24, 24)
    with torch.no_grad():  # the source model resamples on the fly to the same grid: same function
        torch.testing.assert_close(model.eval()(x), source(x), rtol=0, atol=1e-5)


def test_fine_tune_with_new_classes_drops_the_head(trained, image_folder, tmp_path):
    out, _ = trained
    root = tmp_path / "three"
    for i, name in enumerate(["a", "b", "c"]):
        (root / name).mkdir(parents=True)
        for j in range(4):
            Image.fromarray(np.full((16, 16), 60 * i + j, dtype=np.uint8)).save(root / name / f"{j}.png")
    cfg = tiny_config(root, tmp_path / "ft", init_from=str(out / "checkpoint"), batch_size=4, epochs=1,
                      model_overrides={**TINY, "image_size": (32, 32)})
    model, meta = build_model(cfg, load_data(cfg, (32, 32)))
    assert meta.labels == ["a", "b", "c"] and model.head.weight.shape == (3, 32)
    assert torch.equal(model.head.weight, torch.zeros(3, 32))
    row = train(cfg)
    assert row["epoch"] == 1
    _, saved = load_checkpoint(tmp_path / "ft" / "checkpoint")
    assert saved.config.image_size == (32, 32) and saved.labels == ["a", "b", "c"]


def test_load_data_fashion_mnist_resizes(tmp_path):
    def write_idx(name, array):
        header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        with gzip.open(tmp_path / f"{name}.gz", "wb") as f:
            f.write(header + array.tobytes())

    for prefix, n in [("train", 3), ("t10k", 2)]:
        write_idx(f"{prefix}-images-idx3-ubyte", np.full((n, 28, 28), 200, dtype=np.uint8))
        write_idx(f"{prefix}-labels-idx1-ubyte", np.arange(n, dtype=np.uint8))
    cfg = TrainConfig(data="fashion-mnist", data_dir=str(tmp_path))
    assert load_data(cfg, None).train.images.shape == (3, 1, 28, 28)
    splits = load_data(cfg, (32, 48))
    assert splits.train.images.shape == (3, 1, 32, 48) and splits.test.images.shape == (2, 1, 32, 48)
    assert torch.equal(splits.test.images, torch.full((2, 1, 32, 48), 200, dtype=torch.uint8))
