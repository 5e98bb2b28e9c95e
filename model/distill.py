"""Knowledge distillation: the student learns the labels and, beside them, its teachers' softened probabilities
(Hinton, Vinyals, Dean 2015; DeiT's soft distillation, Touvron et al. 2021).

`vitserve train --distill-from CHECKPOINT` (repeated for several teachers, whose probabilities are averaged: an
ensemble's knowledge in one model of the student's size and serving cost). The loss per batch is

    (1 - w) * cross_entropy(student, labels) + w * T^2 * KL(teachers_T || student_T)

with w `--distill-weight` and T `--distill-temperature`; the T^2 keeps the soft term's gradients at the scale of
the hard term's whatever T is. The teachers see the same augmented batch as the student, each under its own
normalisation and at its own trained resolution (bicubic, as `--image-size` resizes training data: a teacher may
look at an upsampled image, the student serves at the small one); with `--grid-sizes` they see the batch at the
training size, before it is resized to the step's grid for the student (FlexiViT's setup). They are never trained
and are not saved: the checkpoint is the student alone, and records which teachers (name, version, weights hash) it
learned from.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vitserve.model.checkpoint import CheckpointError, CheckpointMeta, load_checkpoint, load_meta, weights_sha256
from vitserve.model.config import TrainingInputError


class Teachers(nn.Module):
    """Trained models whose mean softened probabilities the student learns; inputs are normalised for the
    student (`mean`, `std`) and re-normalised for each teacher."""

    # Buffers (register_buffer): the student's normalisation (1, C, 1, 1), each teacher's (teachers, 1, C, 1, 1)
    student_mean: torch.Tensor
    student_std: torch.Tensor
    means: torch.Tensor
    stds: torch.Tensor

    def __init__(self, models: Sequence[nn.Module], metas: list[CheckpointMeta], mean: list[float], std: list[float]):
        super().__init__()
        self.models = nn.ModuleList(models).eval().requires_grad_(False)
        self.metas = metas
        self.described = [{"name": meta.name, "version": meta.version,  # what the student's record keeps
                           "test_accuracy": meta.metrics.get("test_accuracy"),
                           "weights_sha256": weights_sha256(model.state_dict())} for model, meta in zip(models, metas)]
        shape = (1, -1, 1, 1)
        self.register_buffer("student_mean", torch.tensor(mean).view(shape), persistent=False)
        self.register_buffer("student_std", torch.tensor(std).view(shape), persistent=False)
        self.register_buffer("means", torch.tensor([m.mean for m in metas]).view(len(metas), *shape),
                             persistent=False)
        self.register_buffer("stds", torch.tensor([m.std for m in metas]).view(len(metas), *shape), persistent=False)

    def train(self, mode: bool = True) -> Teachers:
        return super().train(False)  # a teacher's dropout stays off whatever the student does

    @torch.no_grad()
    def probabilities(self, x: torch.Tensor, temperature: float) -> torch.Tensor:
        """(B, K): the teachers' mean of softmax(logits / temperature) for the student's normalised input x."""
        pixels = x * self.student_std + self.student_mean  # in [0, 1]: normalisation divides by 255 first
        total = torch.zeros((), device=x.device)  # float32, as each teacher's probabilities
        for model, meta, mean, std in zip(self.models, self.metas, self.means, self.stds):
            size = tuple(meta.config.image_size)
            # clamped as `model.data.resize_batch` clamps the teacher's own training images: bicubic overshoots
            seen = pixels if tuple(pixels.shape[-2:]) == size else F.interpolate(
                pixels, size=size, mode="bicubic", align_corners=False).clamp(0, 1)
            total = total + F.softmax(model((seen - mean) / std).float() / temperature, dim=1)
        return total / len(self.models)


def teacher_meta(path: str) -> CheckpointMeta:
    """The metadata of the checkpoint at `path`; TrainingInputError when there is none."""
    try:
        return load_meta(path)
    except (CheckpointError, OSError, ValueError) as e:
        raise TrainingInputError(f"--distill-from {path}: not a checkpoint directory ({e})") from None


def load_teachers(paths: tuple[str, ...], labels: list[str], channels: int, mean: list[float], std: list[float],
                  device: torch.device) -> Teachers:
    """The checkpoints at `paths` (each already found a checkpoint by `teacher_meta`, before the data were read)
    as teachers of a student with these labels (in this order) and channels; TrainingInputError names the first
    teacher that cannot teach it."""
    models, metas = [], []
    for path in paths:
        model, meta = load_checkpoint(path)
        if meta.labels != list(labels):
            raise TrainingInputError(f"--distill-from {path}: its classes {meta.labels} are not the training "
                                     f"data's {list(labels)} (the same classes, in the same order)")
        if meta.config.in_channels != channels:
            raise TrainingInputError(f"--distill-from {path}: it takes {meta.config.in_channels}-channel images, "
                                     f"the training data has {channels}")
        models.append(model)
        metas.append(meta)
    return Teachers(models, metas, mean, std).to(device)


def distillation_loss(student_logits: torch.Tensor, teacher_probabilities: torch.Tensor,
                      temperature: float) -> torch.Tensor:
    """T^2 * KL(teacher || student) at temperature T, averaged over the batch."""
    log_student = F.log_softmax(student_logits / temperature, dim=1)
    return F.kl_div(log_student, teacher_probabilities, reduction="batchmean") * temperature ** 2


__all__ = ["Teachers", "distillation_loss", "load_teachers", "teacher_meta"]
