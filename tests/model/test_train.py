"""The training loop on a tiny image folder: loss goes down, files are written, resume and fine-tuning work."""
from __future__ import annotations

import csv
import gzip
import json
import math
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import load_file

import model.train as train_module
from model.augment import AugmentConfig
from model.checkpoint import load_checkpoint
from model.data import load_image_folder
from model.train import TrainConfig, build_model, load_data, lr_at, steps_per_epoch, train

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


def read_log(out_dir) -> list[dict]:
    with open(out_dir / "log.csv") as f:
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

    model, meta = load_checkpoint(out / "checkpoint")
    assert meta.labels == ["bottom", "top"] and (meta.name, meta.version) == ("tiny-run", "3")
    assert meta.config.image_size == (16, 16) and meta.config.in_channels == 1 and meta.config.depth == 2
    assert (meta.mean, meta.std) == ([0.5], [0.5])
    assert meta.metrics == {"test_accuracy": row["test_acc"], "test_loss": row["test_loss"], "epoch": 4}
    assert meta.training["epochs_done"] == 4 and meta.training["train_images"] == 60
    assert meta.training["parameters"] == sum(p.numel() for p in model.parameters())
    assert meta.training["model_overrides"]["embed_dim"] == 32 and meta.training["torch"] == torch.__version__
    json.dumps(meta.to_dict())  # everything recorded is JSON

    # The checkpoint is the model that was evaluated: its accuracy on the validation split is the one logged.
    splits = load_image_folder(image_folder, (16, 16), 1, 0.25, 0)
    with torch.no_grad():
        logits = model((splits.test.images.float() / 255 - 0.5) / 0.5)
    assert len(splits.test) == 20
    assert (logits.argmax(1) == splits.test.labels).float().mean().item() == row["test_acc"]
    assert F.cross_entropy(logits, splits.test.labels).item() == pytest.approx(row["test_loss"], abs=1e-5)


class Interrupted(Exception):
    pass


def test_resume_continues_where_it_stopped(trained, image_folder, tmp_path, monkeypatch):
    """Stopped after epoch 2 of 4 and resumed, a run ends with exactly the weights of the uninterrupted run."""
    full_out, full_row = trained
    one_epoch = train_module.train_one_epoch

    def stop_at_third_epoch(*args, **kwargs):
        if args[5] == 2:  # the epoch index: the third epoch
            raise Interrupted
        return one_epoch(*args, **kwargs)

    monkeypatch.setattr(train_module, "train_one_epoch", stop_at_third_epoch)
    with pytest.raises(Interrupted):
        train(tiny_config(image_folder, tmp_path))
    assert [r["step"] for r in read_log(tmp_path)] == [10, 20]
    monkeypatch.setattr(train_module, "train_one_epoch", one_epoch)

    row = train(tiny_config(image_folder, tmp_path, resume=True))
    assert (row["epoch"], row["step"]) == (4, 40)
    rows, full_rows = read_log(tmp_path), read_log(full_out)
    assert [r["step"] for r in rows] == [10, 20, 30, 40]
    for key in ("lr", "train_loss", "train_acc", "test_loss", "test_acc"):
        assert [r[key] for r in rows] == [r[key] for r in full_rows], key
    resumed = load_file(str(tmp_path / "checkpoint" / "model.safetensors"))
    uninterrupted = load_file(str(full_out / "checkpoint" / "model.safetensors"))
    for name, value in uninterrupted.items():
        assert torch.equal(resumed[name], value), name
    assert load_checkpoint(tmp_path / "checkpoint")[1].metrics["epoch"] == 4

    # Resuming a finished run trains nothing more.
    assert train(tiny_config(image_folder, tmp_path, resume=True)) == {}
    assert len(read_log(tmp_path)) == 4


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
    assert row["lr"] == pytest.approx(lr_at(1, 2, 2, TrainConfig(lr=1e-3)))


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
