"""Fixtures shared by every test package: tiny models made once per session."""
from __future__ import annotations

import os

import pytest

# Tests run beside long jobs on two cores; one intra-op thread keeps them predictable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

TINY_LABELS = ["cat", "dog", "bird"]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A 3-class, 3-channel, 2-layer ViT on a 4x4 grid of 8-pixel patches, random weights, saved as a checkpoint."""
    from export.presets import RandomModel, random_checkpoint

    spec = RandomModel("tiny", dict(image_size=(32, 32), patch_size=8, embed_dim=32, depth=2, num_heads=2,
                                    mlp_dim=64, num_classes=len(TINY_LABELS)),
                       labels=list(TINY_LABELS), mean=[0.5] * 3, std=[0.25] * 3, name="tiny-vit", version="7",
                       metrics={"test_accuracy": 0.5})
    return random_checkpoint(spec, tmp_path_factory.mktemp("tiny") / "checkpoint")


@pytest.fixture(scope="session")
def tiny_onnx(tiny_checkpoint, tmp_path_factory):
    """The tiny ViT exported by `export_onnx` without verification (export's own tests verify it)."""
    from export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(tiny_checkpoint, out, verify=False)
    return out
