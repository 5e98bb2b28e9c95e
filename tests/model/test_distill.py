"""Knowledge distillation (`vitserve train --distill-from`): the loss, the teachers' own normalisation, a student
that learns what its teacher knows rather than its labels, and the flags."""
from __future__ import annotations

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from vitserve.model.augment import AugmentConfig
from vitserve.model.checkpoint import CheckpointMeta
from vitserve.model.config import TrainConfig, TrainingInputError
from vitserve.model.distill import Teachers, distillation_loss
from vitserve.model.train import train
from vitserve.model.vit import VisionTransformer, vit_config

TINY = dict(image_size=(16, 16), patch_size=4, embed_dim=32, depth=2, num_heads=2, mlp_dim=64)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """40 grey 16x16 PNGs per class ('top': a bright upper half, 'bottom': a bright lower half), and the same
    images with their classes swapped: what a wrong teacher learns."""
    root = tmp_path_factory.mktemp("distill")
    rng = np.random.default_rng(0)
    for name, rows in [("top", slice(0, 8)), ("bottom", slice(8, 16))]:
        (root / "right" / name).mkdir(parents=True)
        for i in range(40):
            image = rng.integers(0, 80, (16, 16), dtype=np.uint8)
            image[rows] += 150
            Image.fromarray(image).save(root / "right" / name / f"{i}.png")
    shutil.copytree(root / "right" / "top", root / "swapped" / "bottom")
    shutil.copytree(root / "right" / "bottom", root / "swapped" / "top")
    return root


def config(data, out, **changes) -> TrainConfig:
    cfg = TrainConfig(data=str(data), model="tiny", model_overrides=dict(TINY), channels=1, epochs=8, batch_size=6,
                      lr=3e-3, warmup_epochs=1.0, augment=AugmentConfig(crop="none", hflip=False, erasing_prob=0.0),
                      val_fraction=0.25, out_dir=str(out), progress=False, seed=0)
    return replace(cfg, **changes)


def test_the_loss_is_t_squared_kl_and_zero_when_the_student_agrees():
    teacher = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 3.0]])
    for t in (1.0, 4.0):
        probabilities = F.softmax(teacher / t, dim=1)
        assert distillation_loss(teacher, probabilities, t).item() == pytest.approx(0, abs=1e-6)
        student = torch.zeros(2, 3)
        by_hand = (probabilities * (probabilities.log() - F.log_softmax(student / t, 1))).sum(1).mean() * t * t
        assert distillation_loss(student, probabilities, t).item() == pytest.approx(by_hand.item(), rel=1e-6)


class Recording(torch.nn.Module):
    """A two-class teacher that keeps what it was shown."""

    def __init__(self, seen: list):
        super().__init__()
        self.seen = seen

    def forward(self, x):
        self.seen.append(x.clone())
        return torch.zeros(x.shape[0], 2)


def test_each_teacher_sees_the_pixels_under_its_own_normalisation():
    seen = []
    cfg = vit_config("tiny", **TINY, in_channels=1, num_classes=2)
    metas = [CheckpointMeta(cfg, ["a", "b"], [0.2], [0.5]), CheckpointMeta(cfg, ["a", "b"], [0.5], [0.25])]
    teachers = Teachers([Recording(seen), Recording(seen)], metas, mean=[0.5], std=[0.5])
    pixels = torch.rand(3, 1, 16, 16)
    probabilities = teachers.probabilities((pixels - 0.5) / 0.5, temperature=2.0)
    torch.testing.assert_close(seen[0], (pixels - 0.2) / 0.5)
    torch.testing.assert_close(seen[1], (pixels - 0.5) / 0.25)
    torch.testing.assert_close(probabilities, torch.full((3, 2), 0.5))


def test_a_teacher_trained_at_another_resolution_sees_the_batch_resized_to_it():
    seen = []
    big = vit_config("tiny", **{**TINY, "image_size": (32, 32)}, in_channels=1, num_classes=2)
    small = vit_config("tiny", **TINY, in_channels=1, num_classes=2)
    metas = [CheckpointMeta(big, ["a", "b"], [0.0], [1.0]), CheckpointMeta(small, ["a", "b"], [0.0], [1.0])]
    teachers = Teachers([Recording(seen), Recording(seen)], metas, mean=[0.0], std=[1.0])
    pixels = torch.zeros(2, 1, 16, 16)  # a normalised batch with mean 0 and std 1: pixels in [0, 1]
    pixels[:, :, :8] = 1.0  # a bright upper half stays the upper half, within the pixels' range
    teachers.probabilities(pixels, temperature=1.0)
    assert seen[0].shape == (2, 1, 32, 32) and seen[1].shape == (2, 1, 16, 16)
    assert seen[0][:, :, :14].min() == 1.0 and seen[0][:, :, 18:].max() == 0.0
    assert seen[0][:, :, 14:18].min() < 1.0  # resized: the edge is blurred, not copied
    assert 0.0 <= seen[0].min() and seen[0].max() <= 1.0  # the bicubic overshoot clamped, as in training


@pytest.mark.slow
def test_a_student_learns_its_teachers_knowledge_not_its_labels(folders, tmp_path):
    """A teacher trained on swapped classes; a student taught by it alone (weight 1) learns the swap, although
    every label it is given is right; with the labels alone (weight 0) it learns them."""
    teacher = train(config(folders / "swapped", tmp_path / "teacher"))
    assert teacher["test_acc"] >= 0.9  # it learned the swapped classes well
    taught = train(config(folders / "right", tmp_path / "taught", distill_from=(str(tmp_path / "teacher" /
                                                                                    "checkpoint"),),
                          distill_weight=1.0, distill_temperature=1.0))
    labelled = train(config(folders / "right", tmp_path / "labelled", distill_from=(str(tmp_path / "teacher" /
                                                                                        "checkpoint"),),
                            distill_weight=0.0))
    assert taught["test_acc"] <= 0.1 and labelled["test_acc"] >= 0.9, (taught, labelled)
    record = json.loads((tmp_path / "taught" / "checkpoint" / "config.json").read_text())["training"]
    assert record["distill_from"] == [str(tmp_path / "teacher" / "checkpoint")]
    assert [t["test_accuracy"] for t in record["teachers"]] == [teacher["test_acc"]]
    assert len(record["teachers"][0]["weights_sha256"]) == 64


def test_teachers_that_cannot_teach_are_refused_in_one_line(folders, tmp_path):
    other = VisionTransformer(vit_config("tiny", **TINY, in_channels=1, num_classes=3))
    from vitserve.model.checkpoint import save_checkpoint

    save_checkpoint(tmp_path / "three", other, CheckpointMeta(other.cfg, ["a", "b", "c"], [0.5], [0.5]))
    with pytest.raises(TrainingInputError, match=r"--distill-from .*three: its classes \['a', 'b', 'c'\] are not"):
        train(config(folders / "right", tmp_path / "out", distill_from=(str(tmp_path / "three"),)))
    with pytest.raises(TrainingInputError, match="--distill-from /nowhere: not a checkpoint directory"):
        train(config(folders / "right", tmp_path / "out", distill_from=("/nowhere",)))
    with pytest.raises(TrainingInputError, match="--distill-weight 1.5: must be between 0 and 1"):
        config(folders, tmp_path, distill_weight=1.5).check()
    with pytest.raises(TrainingInputError, match="--distill-temperature 0: must be above 0"):
        config(folders, tmp_path, distill_temperature=0).check()
    with pytest.raises(TrainingInputError, match="pre-train first, then distil"):
        config(folders, tmp_path, distill_from=("t",), pretrain="masked-patch").check()


def test_the_flag_repeats_for_several_teachers_and_the_command_line_says_so():
    from vitserve.model.cli import command_line, train_config
    from vitserve.cli import build_parser

    args = build_parser().parse_args(["train", "--distill-from", "a/checkpoint", "--distill-from", "b dir",
                                      "--distill-weight", "0.7"])
    cfg = train_config(args)
    assert cfg.distill_from == ("a/checkpoint", "b dir") and cfg.distill_weight == 0.7
    assert "--distill-from a/checkpoint --distill-from 'b dir' --distill-weight 0.7" in command_line(cfg)
    assert train_config(build_parser().parse_args(["train"])).distill_from == ()
