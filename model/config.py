"""What a training run is: `TrainConfig` and its `AugmentConfig`, with the stdlib alone.

Each field is a `vitserve train` flag (metadata: "help" its help text, "flag" a new name), so model/cli.py
builds the flags from here, and `vitserve` builds every command's parser on every run (`vitserve serve` too):
this module must import neither torch nor numpy. model.train and model.augment import the classes from here.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # where Debian's dataset-fashion-mnist puts the IDX files
# `vitserve train --quick`: the fields it sets unless given, a run of a minute or two on two CPU cores.
QUICK_RUN = {"epochs": 1, "max_steps_per_epoch": 100}


class TrainingInputError(ValueError):
    """A flag value or a dataset no training run can use: the user's to fix, said in one line."""


@dataclass(frozen=True)
class AugmentConfig:
    """Augmentation of training batches. Each field is a `vitserve train` flag; "help" is its help text."""

    crop: Literal["pad", "rrc", "none"] = field(default="pad", metadata={
        "help": "pad: random crop with zero padding; rrc: random-resized crop; none"})
    crop_padding: int = field(default=2, metadata={"help": "pixels of zero padding on each side for --crop pad"})
    rrc_scale: tuple[float, float] = field(default=(0.35, 1.0), metadata={
        "help": "area range of a --crop rrc crop, as fractions of the image"})
    rrc_ratio: tuple[float, float] = field(default=(3 / 4, 4 / 3), metadata={
        "help": "aspect-ratio (width / height) range of a --crop rrc crop"})
    hflip: bool = field(default=True, metadata={"help": "flip half the images left-right"})
    erasing_prob: float = field(default=0.25, metadata={
        "help": "probability that an image gets one rectangle of noise (random erasing)"})
    erasing_scale: tuple[float, float] = field(default=(0.02, 0.25), metadata={
        "help": "area range of an erased rectangle, as fractions of the image"})
    erasing_ratio: tuple[float, float] = field(default=(0.3, 3.3), metadata={
        "help": "aspect-ratio (height / width) range of an erased rectangle"})


@dataclass
class TrainConfig:
    """One training run. Each field is a `vitserve train` flag ("flag" renames one, "help" is its help text);
    AugmentConfig's fields are flags too, and model_overrides' "flags" are the ViTConfig fields offered, each
    as (its type in model.vit.ViTConfig, help text): the type is written here so that no torch is needed."""

    data: str = field(default="fashion-mnist", metadata={
        "help": "'fashion-mnist' or an ImageFolder root (one folder per class)"})
    data_dir: str = field(default=FASHION_MNIST_DIR, metadata={"help": "Fashion-MNIST IDX directory"})
    model: str = field(default="fmnist", metadata={
        "help": "variant: fmnist, tiny, small, base, large, huge, B/16, L/32, ...; a hybrid (a ResNet's feature map "
                "cut into patches): R+fmnist (the stem alone), R26+S/32, R50+B/16"})
    model_overrides: dict = field(default_factory=dict, metadata={
        "help": "ViTConfig fields that replace the variant's; only the flags given are set",
        "flags": {
            "image_size": (tuple[int, int], "training resolution H[xW], e.g. 28 or 32x40 (default: Fashion-MNIST's "
                                            "28; an image folder's is the variant's: fmnist 28, others 224, "
                                            "--init-from the checkpoint's)"),
            "patch_size": (int, "patch side in pixels (default: the variant's)"),
            "embed_dim": (int, "token width (default: the variant's)"),
            "depth": (int, "transformer blocks (default: the variant's)"),
            "num_heads": (int, "attention heads (default: the variant's)"),
            "mlp_dim": (int, "hidden width of each block's MLP (default: the variant's)"),
            "dropout": (float, "dropout after dense layers and position embeddings (default: the variant's)"),
            "attention_dropout": (float, "dropout on attention weights (default: the variant's)"),
            "representation_size": (int | None, "hidden size of the pre-training MLP head (default: the variant's)"),
            "backbone_layers": (tuple[int, ...] | None,
                                "a hybrid's bottleneck blocks per ResNet stage, e.g. 2,2; 0: the stem alone "
                                "(default: the variant's)"),
            "backbone_width": (int, "a hybrid's stem channels, a multiple of 32 (default: the variant's)"),
        }})
    channels: Literal[1, 3] = field(default=3, metadata={"help": "for image folders; Fashion-MNIST is 1"})
    epochs: int = field(default=40, metadata={
        "help": "passes over the training set (the default model: about 3 min each on two idle CPU cores)"})
    batch_size: int = field(default=128, metadata={"help": "global batch, split across processes"})
    lr: float = field(default=1e-3, metadata={"help": "peak AdamW learning rate, reached after the warm-up"})
    min_lr: float = field(default=1e-5, metadata={"help": "learning rate at the end of the cosine decay"})
    weight_decay: float = field(default=0.05, metadata={
        "help": "AdamW weight decay (none on biases, norms, position embeddings, class token)"})
    warmup_epochs: float = field(default=3.0, metadata={
        "help": "epochs of linear learning-rate warm-up, at most half the run's steps"})
    label_smoothing: float = field(default=0.1, metadata={"help": "label smoothing of the cross-entropy"})
    grad_clip: float = field(default=1.0, metadata={"help": "clip the gradient norm to this; 0: no clipping"})
    seed: int = field(default=0, metadata={"help": "seeds weights, batch order, augmentation, validation split"})
    augment: AugmentConfig = field(default_factory=AugmentConfig, metadata={
        "help": "augmentation of training batches"})
    out_dir: str = field(default="runs/train", metadata={
        "flag": "out", "metavar": "DIR",
        "help": "output directory: checkpoint/, log.csv (per epoch), steps.csv (per step), curves.png, train_state.pt "
                "(for --resume)"})
    resume: bool = field(default=False, metadata={
        "help": "continue the run in --out from its last save (an epoch's end, a periodic save or Ctrl-C)"})
    pretrain: Literal["none", "masked-patch"] = field(default="none", metadata={
        "help": "none: learn the labels; masked-patch: self-supervision by masked patch prediction (paper sec. 4.6): "
                "predict the mean colour of half the patches, corrupted, from the rest; no labels used. Then "
                "fine-tune the checkpoint with --init-from"})
    label_fraction: float = field(default=1.0, metadata={
        "help": "learn from this share of the training images' labels (stratified by class, chosen by --seed); "
                "the others are left out; the held-out split stays whole"})
    init_from: str | None = field(default=None, metadata={
        "metavar": "CHECKPOINT", "help": "fine-tune from this checkpoint (position embeddings resampled)"})
    distill_from: tuple[str, ...] = field(default=(), metadata={
        "metavar": "CHECKPOINT",
        "help": "learn also this trained checkpoint's softened probabilities (knowledge distillation: the teacher "
                "is not trained and not saved); repeat the flag for several teachers, whose probabilities are "
                "averaged"})
    distill_weight: float = field(default=0.5, metadata={
        "help": "with --distill-from: the teachers' share of the loss (the labels' is the rest)"})
    distill_temperature: float = field(default=2.0, metadata={
        "help": "with --distill-from: the temperature that softens the teachers' and the student's probabilities"})
    grid_sizes: tuple[int, ...] = field(default=(), metadata={
        "parse": "pixel-sizes", "metavar": "PX[,PX...]",
        "help": "train at a grid drawn per step from these square input sizes in pixels, each a multiple of the "
                "patch size (FlexiViT's random sequence length, for a fixed patch): the augmented batch is resized "
                "to it (antialiased bilinear, as Pillow's BILINEAR), the teachers of --distill-from still see the "
                "full image; the held-out images are scored at each size. A size listed twice is drawn twice as often. "
                "none: the training size alone"})
    val_fraction: float = field(default=0.1, metadata={
        "help": "share of an image folder held out for validation, at least one image of each class"})
    max_steps_per_epoch: int | None = field(default=None, metadata={
        "help": "end each epoch after this many optimiser steps (a shorter run: the schedule fits the steps made)"})
    time_limit: float | None = field(default=None, metadata={
        "metavar": "MINUTES", "help": "stop after this many minutes of training steps, then evaluate and save as at "
                                      "an epoch's end; --resume continues"})
    save_every: float = field(default=10.0, metadata={
        "metavar": "MINUTES", "help": "also save the checkpoint and training state this often within an epoch "
                                      "(Ctrl-C saves too); 0: at epoch ends only"})
    name: str = field(default="vit", metadata={"help": "model name recorded in the checkpoint"})
    version: str = field(default="1", metadata={"help": "model version recorded in the checkpoint"})
    threads: int | None = field(default=None, metadata={"help": "CPU threads for torch; none: torch's choice"})
    progress: bool = field(default=True, metadata={"help": "progress bar on stderr"})

    def check(self) -> None:
        """Raises TrainingInputError naming the first flag whose value no run can use."""
        limits = [("epochs", self.epochs >= 1, "at least 1"), ("batch-size", self.batch_size >= 1, "at least 1"),
                  ("lr", self.lr > 0, "above 0"), ("min-lr", self.min_lr >= 0, "0 or more"),
                  ("warmup-epochs", self.warmup_epochs >= 0, "0 or more"),
                  ("val-fraction", 0 < self.val_fraction < 1, "between 0 and 1"),
                  ("label-fraction", 0 < self.label_fraction <= 1, "above 0 and at most 1"),
                  ("distill-weight", 0 <= self.distill_weight <= 1, "between 0 and 1"),
                  ("distill-temperature", self.distill_temperature > 0, "above 0"),
                  ("max-steps-per-epoch", self.max_steps_per_epoch is None or self.max_steps_per_epoch >= 1,
                   "at least 1"),
                  ("time-limit", self.time_limit is None or self.time_limit > 0, "above 0"),
                  ("save-every", self.save_every >= 0, "0 or more"),
                  ("threads", self.threads is None or self.threads >= 1, "at least 1")]
        for flag, ok, expected in limits:
            if not ok:
                value = getattr(self, flag.replace("-", "_"))
                raise TrainingInputError(f"--{flag} {value}: must be {expected}")
        if any(size < 1 for size in self.grid_sizes):
            raise TrainingInputError(f"--grid-sizes {','.join(map(str, self.grid_sizes))}: each must be at least 1")
        if self.distill_from and self.pretrain != "none":
            raise TrainingInputError("--distill-from teaches class probabilities, and --pretrain masked-patch learns "
                                     "no classes: pre-train first, then distil while fine-tuning (--init-from)")
