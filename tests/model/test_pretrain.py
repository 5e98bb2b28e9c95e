"""Masked patch prediction (paper sec. 4.6): the corruption's shares, the mean-colour targets, a falling loss, and
the command line from pre-training to a fine-tune on a share of the labels."""
from __future__ import annotations

import csv
import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitserve.model.config import AugmentConfig, TrainConfig
from vitserve.model.data import ImageDataset, labelled_share
from vitserve.model.pretrain import (KEEP, MASK, REPLACE, MaskedPatchPrediction, colour_classes, corrupt, corruption_plan,
                            mean_colour_targets)
from vitserve.model.train import train
from vitserve.model.vit import VisionTransformer, vit_config


def test_half_the_patches_are_corrupted_80_10_10_over_many_batches():
    generator = torch.Generator().manual_seed(0)
    counts, chosen_total = torch.zeros(3), 0
    for _ in range(200):
        chosen, how = corruption_plan(64, 49, generator)
        assert torch.equal(chosen.sum(dim=1), torch.full((64,), 24))  # round(49 / 2) of each image's patches
        counts += torch.bincount(how[chosen], minlength=3)
        chosen_total += int(chosen.sum())
    shares = counts / chosen_total  # 307,200 corrupted patches: a share's standard error is below 0.001
    assert shares[MASK] == pytest.approx(0.8, abs=0.005)
    assert shares[REPLACE] == pytest.approx(0.1, abs=0.005) and shares[KEEP] == pytest.approx(0.1, abs=0.005)


def test_corrupt_masks_replaces_and_keeps_as_planned():
    generator = torch.Generator().manual_seed(1)
    patches = torch.randn(8, 16, 5)
    chosen, how = corruption_plan(8, 16, generator)
    mask_token = torch.full((1, 1, 5), 7.0)
    out = corrupt(patches, chosen, how, mask_token, generator)
    untouched = ~chosen | (how == KEEP)
    assert torch.equal(out[untouched], patches[untouched])
    assert torch.equal(out[chosen & (how == MASK)], torch.full_like(out[chosen & (how == MASK)], 7.0))
    replaced = out[chosen & (how == REPLACE)]
    assert len(replaced) > 0
    every_patch = patches.reshape(-1, 5)
    assert all((every_patch == row).all(dim=1).any() for row in replaced)  # each one some patch of the batch


def test_targets_are_each_patchs_mean_colour_in_3_bits_per_channel():
    rgb = torch.zeros(1, 3, 8, 16)
    rgb[:, :, :, :8] = torch.tensor([1.0, 0.0, 0.5]).view(1, 3, 1, 1)  # left patch: red 7, green 0, blue 4
    rgb[:, 1, :4, 8:] = 1.0  # right patch: half its rows green -> mean 0.5 -> 4
    assert mean_colour_targets(rgb, 8).tolist() == [[7 * 64 + 0 * 8 + 4, 0 * 64 + 4 * 8 + 0]]
    assert mean_colour_targets(torch.full((1, 1, 4, 4), 0.99), 2).tolist() == [[7, 7, 7, 7]]
    assert mean_colour_targets(torch.full((1, 1, 4, 4), 0.124), 2).tolist() == [[0, 0, 0, 0]]
    assert mean_colour_targets(torch.full((1, 1, 4, 4), 0.126), 2).tolist() == [[1, 1, 1, 1]]
    assert (colour_classes(3), colour_classes(1)) == (512, 8)
    model = MaskedPatchPrediction(VisionTransformer(vit_config("tiny", image_size=(8, 16), patch_size=8,
                                                               embed_dim=16, depth=1, num_heads=2, mlp_dim=32)))
    logits, targets = model(torch.zeros(1, 3, 8, 16), rgb)
    assert logits.shape == (1, 512) and targets.tolist()[0] in mean_colour_targets(rgb, 8).tolist()[0]


def test_a_share_of_the_labels_keeps_every_class_in_proportion():
    labels = torch.tensor([0] * 50 + [1] * 30 + [2] * 3)
    data = ImageDataset(torch.arange(len(labels)).view(-1, 1, 1, 1).to(torch.uint8), labels, ["a", "b", "c"])
    share = labelled_share(data, 0.1, seed=4)
    assert torch.bincount(share.labels).tolist() == [5, 3, 1]  # at least one of each class
    assert torch.equal(share.labels, labels[share.images.flatten().long()])  # images keep their labels
    assert torch.equal(labelled_share(data, 0.1, seed=4).images, share.images)  # the seed decides


@pytest.fixture(scope="module")
def colour_folder(tmp_path_factory):
    """24 RGB 16x16 images per class of flat colour blocks: the patch colours are learnable from their context."""
    root = tmp_path_factory.mktemp("colours")
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir()
        for i in range(24):
            blocks = rng.integers(0, 256, (2, 2, 3), dtype=np.uint8)
            Image.fromarray(np.kron(blocks, np.ones((8, 8, 1), np.uint8))).save(root / name / f"{i}.png")
    return root


@pytest.mark.slow
def test_pre_training_loss_falls_and_its_checkpoint_fine_tunes(colour_folder, tmp_path):
    cfg = TrainConfig(data=str(colour_folder), model="tiny", channels=3, pretrain="masked-patch",
                      model_overrides=dict(image_size=(16, 16), patch_size=4, embed_dim=32, depth=2, num_heads=2,
                                           mlp_dim=64),
                      epochs=40, batch_size=8, lr=3e-3, warmup_epochs=1.0, label_smoothing=0.0,
                      augment=AugmentConfig(crop="none", hflip=False, erasing_prob=0.0), val_fraction=0.25,
                      out_dir=str(tmp_path / "pre"), progress=False, seed=0)
    train(cfg)
    with open(tmp_path / "pre" / "steps.csv") as f:
        losses = [float(row["train_loss"]) for row in csv.DictReader(f)]
    assert np.mean(losses[-10:]) < 0.8 * np.mean(losses[:10]), (losses[:10], losses[-10:])
    config = json.loads((tmp_path / "pre" / "checkpoint" / "config.json").read_text())
    assert "test_accuracy" not in config["metrics"] and 0 <= config["metrics"]["masked_patch_accuracy"] <= 1
    fine = TrainConfig(data=str(colour_folder), init_from=str(tmp_path / "pre" / "checkpoint"), epochs=1,
                       batch_size=8, label_fraction=0.5, out_dir=str(tmp_path / "fine"), progress=False,
                       augment=AugmentConfig(crop="none"), val_fraction=0.25)
    row = train(fine)
    assert 0 <= row["test_acc"] <= 1
    assert "test_accuracy" in json.loads((tmp_path / "fine" / "checkpoint" / "config.json").read_text())["metrics"]
