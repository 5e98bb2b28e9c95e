"""--grid-sizes: each step trains at an input grid drawn from the list (FlexiViT's random sequence length for a fixed
patch), reproducibly and across --resume; the teachers see the full image; the held-out set is scored per size."""
from __future__ import annotations

import csv
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from training_fixtures import write_image_folder

import vitserve.model.train as train_module
from vitserve.model.augment import AugmentConfig
from vitserve.model.checkpoint import load_checkpoint
from vitserve.model.config import TrainConfig, TrainingInputError
from vitserve.model.data import images_at_grid
from vitserve.model.distill import Teachers
from vitserve.model.train import TrainingInterrupted, curve_series, train

TINY = dict(image_size=(16, 16), patch_size=4, embed_dim=16, depth=1, num_heads=2, mlp_dim=32)
GRIDS = (8, 12, 16)
STEPS = 6  # steps of 8 images in the one epoch (of the 60 training images)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("data") / "folder", {"top": 40, "bottom": 40}, size=16)


def grid_config(folder, out_dir, **changes) -> TrainConfig:
    cfg = TrainConfig(data=str(folder), model="tiny", model_overrides=dict(TINY), channels=1, epochs=1,
                      batch_size=8, lr=3e-3, warmup_epochs=0.5, augment=AugmentConfig(crop="none"),
                      val_fraction=0.25, out_dir=str(out_dir), progress=False, grid_sizes=GRIDS, save_every=0,
                      max_steps_per_epoch=STEPS)
    return replace(cfg, **changes)


def step_grids(out_dir) -> list[int]:
    with open(out_dir / "steps.csv") as f:
        return [int(row["grid"]) for row in csv.DictReader(f)]


@pytest.fixture
def sides_seen(monkeypatch):
    """The input sides the model is trained on, one per training forward pass (evaluation passes left out)."""
    sides: list[int] = []
    forward = train_module.VisionTransformer.forward

    def recording_forward(self, x):
        if self.training:
            assert x.shape[-2] == x.shape[-1]
            sides.append(x.shape[-1])
        return forward(self, x)

    monkeypatch.setattr(train_module.VisionTransformer, "forward", recording_forward)
    return sides


@pytest.mark.slow
def test_each_step_trains_at_a_grid_from_the_list_and_logs_it(folder, tmp_path, sides_seen):
    train(grid_config(folder, tmp_path))
    assert len(sides_seen) == STEPS and set(sides_seen) <= set(GRIDS)
    assert len(set(sides_seen)) > 1  # seed 0 draws more than one size in six steps
    assert step_grids(tmp_path) == sides_seen


def test_without_grid_sizes_every_step_trains_at_the_training_size(folder, tmp_path, sides_seen):
    train(grid_config(folder, tmp_path, grid_sizes=()))
    assert sides_seen == [16] * STEPS
    with open(tmp_path / "log.csv") as f:
        assert "test_acc_16" not in next(csv.DictReader(f))


def test_the_draws_follow_the_seed(folder, tmp_path):
    runs = {name: grid_config(folder, tmp_path / name, seed=seed) for name, seed in [("a", 0), ("b", 0), ("c", 1)]}
    for cfg in runs.values():
        train(cfg)
    assert step_grids(tmp_path / "a") == step_grids(tmp_path / "b")
    assert step_grids(tmp_path / "a") != step_grids(tmp_path / "c")


@pytest.mark.slow
def test_a_resumed_run_draws_the_grids_the_uninterrupted_one_did(folder, tmp_path, interrupt_at_step):
    train(grid_config(folder, tmp_path / "whole"))
    interrupt_at_step(3)
    with pytest.raises(TrainingInterrupted):
        train(grid_config(folder, tmp_path / "resumed"))
    assert len(step_grids(tmp_path / "resumed")) == 3
    train(grid_config(folder, tmp_path / "resumed", resume=True))
    assert step_grids(tmp_path / "resumed") == step_grids(tmp_path / "whole")
    whole, resumed = (load_checkpoint(tmp_path / run / "checkpoint")[0].state_dict() for run in ("whole", "resumed"))
    assert all(torch.equal(whole[name], resumed[name]) for name in whole)


def test_the_held_out_set_is_scored_at_every_grid(folder, tmp_path):
    row = train(grid_config(folder, tmp_path))
    with open(tmp_path / "log.csv") as f:
        logged = next(csv.DictReader(f))
    assert [k for k in logged if k.startswith("test_acc_")] == ["test_acc_8", "test_acc_12", "test_acc_16"]
    assert row["test_acc_16"] == row["test_acc"]  # the training size
    _, meta = load_checkpoint(tmp_path / "checkpoint")
    assert meta.metrics == {"test_accuracy": row["test_acc"], "test_loss": row["test_loss"], "epoch": 1,
                            **{f"test_accuracy_{size}": row[f"test_acc_{size}"] for size in GRIDS}}


def test_a_size_listed_twice_is_one_column_and_drawn_more_often(folder, tmp_path):
    train(grid_config(folder, tmp_path, grid_sizes=(8, 16, 16, 16, 16, 16, 16, 16), max_steps_per_epoch=None))
    with open(tmp_path / "log.csv") as f:
        assert [k for k in next(csv.DictReader(f)) if k.startswith("test_acc_")] == ["test_acc_8", "test_acc_16"]
    assert step_grids(tmp_path).count(16) > step_grids(tmp_path).count(8)


def test_a_grid_not_a_multiple_of_the_patch_is_refused_before_any_file(folder, tmp_path):
    with pytest.raises(TrainingInputError, match=r"^--grid-sizes 10: not a multiple of the patch size 4 "):
        train(grid_config(folder, tmp_path / "run", grid_sizes=(8, 10, 16)))
    assert not (tmp_path / "run").exists()


def test_the_teachers_see_the_full_image_while_the_student_sees_the_grid(folder, tmp_path, monkeypatch, sides_seen):
    train(grid_config(folder, tmp_path / "teacher", grid_sizes=(), max_steps_per_epoch=1))
    teacher_sides: list[int] = []
    probabilities = Teachers.probabilities

    def recording(self, x, temperature):
        teacher_sides.append(x.shape[-1])
        return probabilities(self, x, temperature)

    monkeypatch.setattr(Teachers, "probabilities", recording)
    sides_seen.clear()  # the teacher's own training
    train(grid_config(folder, tmp_path / "student", distill_from=(str(tmp_path / "teacher" / "checkpoint"),)))
    assert teacher_sides == [16] * STEPS and set(sides_seen) != {16}


def test_images_at_a_grid_are_what_pillow_s_bilinear_resize_makes():
    images = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (4, 1, 28, 28), dtype=np.uint8))
    for side in (12, 20):
        pillow = np.stack([np.asarray(Image.fromarray(im[0].numpy()).resize((side, side), Image.BILINEAR))
                           for im in images])[:, None]
        ours = images_at_grid(images, side).numpy()
        assert ours.shape == (4, 1, side, side) and np.abs(ours.astype(int) - pillow).max() <= 1
    assert torch.equal(images_at_grid(images, 28), images)


def test_curves_draw_the_test_accuracy_at_each_grid():
    rows = [{"epoch": e, "step": 10 * e, "train_loss": 1.0, "train_acc": 0.5, "test_loss": 1.0, "test_acc": 0.6,
             "test_acc_8": e / 8, "test_acc_16": 0.6} for e in range(1, 6)]
    _, panels = curve_series(rows, [])
    assert panels["accuracy"]["test at 8 px"] == ([1, 2, 3, 4, 5], [12.5, 25.0, 37.5, 50.0, 62.5])
    assert "test at 16 px" in panels["accuracy"] and "test at 8 px" not in panels["loss"]


@pytest.mark.slow
def test_a_run_resumed_with_another_list_keeps_scoring_its_logged_sizes(folder, tmp_path, interrupt_at_step):
    interrupt_at_step(3)
    with pytest.raises(TrainingInterrupted):
        train(grid_config(folder, tmp_path, epochs=2))
    row = train(grid_config(folder, tmp_path, epochs=2, grid_sizes=(12, 16), resume=True))
    assert set(step_grids(tmp_path)[3:]) <= {12, 16} and len(step_grids(tmp_path)) == 2 * STEPS
    with open(tmp_path / "log.csv") as f:
        rows = list(csv.DictReader(f))
    assert [k for k in rows[0] if k.startswith("test_acc_")] == ["test_acc_8", "test_acc_12", "test_acc_16"]
    assert all(r["test_acc_8"] != "" for r in rows) and float(rows[-1]["test_acc_8"]) == row["test_acc_8"]
