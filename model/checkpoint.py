"""Checkpoints: a directory with `model.safetensors` and `config.json`.

config.json records everything export and serving need: the architecture, class names,
training resolution and patch size (inside the architecture), normalisation, and what
training measured. Training state for resuming lives beside it in `train_state.pt`.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from vitserve.model.vit import VisionTransformer, ViTConfig

CHECKPOINT_FORMAT = "vitserve-checkpoint"
CHECKPOINT_FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class CheckpointError(Exception):
    """A checkpoint directory is missing, incomplete or does not match its config."""


@dataclass
class CheckpointMeta:
    config: ViTConfig
    labels: list[str]
    mean: list[float]
    std: list[float]
    name: str = "vit"
    version: str = "0"
    metrics: dict = field(default_factory=dict)  # e.g. {"test_accuracy": 0.93}
    training: dict = field(default_factory=dict)  # how it was made: command, epochs, wall time, machine

    def __post_init__(self) -> None:
        if len(self.labels) != self.config.num_classes:
            raise CheckpointError(f"{len(self.labels)} labels for {self.config.num_classes} classes")
        if not (len(self.mean) == len(self.std) == self.config.in_channels):
            raise CheckpointError(f"mean/std need {self.config.in_channels} values, got {self.mean} / {self.std}")

    def to_dict(self) -> dict:
        return {"format": CHECKPOINT_FORMAT, "format_version": CHECKPOINT_FORMAT_VERSION,
                "name": self.name, "version": self.version, "architecture": self.config.to_dict(),
                "labels": self.labels, "normalization": {"mean": self.mean, "std": self.std},
                "metrics": self.metrics, "training": self.training}

    @classmethod
    def from_dict(cls, d: dict) -> CheckpointMeta:
        if d.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"not a {CHECKPOINT_FORMAT} config (format={d.get('format')!r})")
        norm = d["normalization"]
        return cls(config=ViTConfig.from_dict(d["architecture"]), labels=list(d["labels"]),
                   mean=list(norm["mean"]), std=list(norm["std"]), name=d.get("name", "vit"),
                   version=str(d.get("version", "0")), metrics=d.get("metrics", {}),
                   training=d.get("training", {}))


def weights_sha256(state_dict: dict[str, torch.Tensor]) -> str:
    """A digest of the weights' values, independent of file layout (names sorted)."""
    h = hashlib.sha256()
    for name in sorted(state_dict):
        h.update(name.encode())
        h.update(state_dict[name].detach().cpu().contiguous().float().numpy().tobytes())
    return h.hexdigest()


def strict_json(value):
    """value with every NaN or infinite float made None, so that json.dumps(..., allow_nan=False) writes JSON
    that strict readers accept (Python's json writes a bare NaN, which is not JSON)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(v) for v in value]
    return value


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def save_checkpoint(directory: str | Path, model: VisionTransformer, meta: CheckpointMeta) -> Path:
    """Writes both files beside their final names, then renames them: an interrupted save leaves the last
    complete files (both from one save but for the instant between the two renames)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    weights, config = directory / (WEIGHTS_FILE + ".tmp"), directory / (CONFIG_FILE + ".tmp")
    save_file(state, str(weights))
    # safetensors creates the file 0600; a checkpoint is shared like any other file (the user's umask decides)
    weights.chmod(0o666 & ~_umask())
    config.write_text(json.dumps(strict_json(meta.to_dict()), indent=2, allow_nan=False) + "\n")
    weights.replace(directory / WEIGHTS_FILE)
    config.replace(directory / CONFIG_FILE)
    return directory


def load_meta(directory: str | Path) -> CheckpointMeta:
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found: a checkpoint is a directory with {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        return CheckpointMeta.from_dict(json.loads(path.read_text()))
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError) as e:  # bad JSON, a missing key, an invalid architecture
        raise CheckpointError(f"{path}: {type(e).__name__}: {e}") from e


def load_checkpoint(directory: str | Path) -> tuple[VisionTransformer, CheckpointMeta]:
    """Builds the model from config.json and loads its weights strictly (eval mode)."""
    meta = load_meta(directory)
    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise CheckpointError(f"{path} not found")
    model = VisionTransformer(meta.config)
    try:
        missing, unexpected = model.load_state_dict(load_file(str(path)), strict=False)
    except RuntimeError as e:  # a tensor whose shape the config does not give
        raise CheckpointError(f"weights do not match config: {e}") from e
    if missing or unexpected:
        raise CheckpointError(f"weights do not match config: missing {missing}, unexpected {unexpected}")
    return model.eval(), meta
