"""Tiny ONNX models, each exported (and verified) once per session."""
from __future__ import annotations

import pytest

NONSQUARE_LABELS = ["a", "b", "c", "d"]


@pytest.fixture(scope="session")
def tiny_export(tiny_checkpoint, tmp_path_factory):
    """The shared 3-channel tiny checkpoint exported in float32, with its ExportReport."""
    from vitserve.export.onnx_export import export_onnx

    return export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("onnx") / "tiny.onnx")


@pytest.fixture(scope="session")
def nonsquare_checkpoint(tmp_path_factory):
    """1 channel, trained at 24x40 (a 3x5 grid of 8-pixel patches), 3 layers, no recorded accuracy."""
    from vitserve.export.presets import RandomModel, random_checkpoint

    spec = RandomModel("tiny", dict(image_size=(24, 40), patch_size=8, in_channels=1, embed_dim=24, depth=3,
                                    num_heads=3, mlp_dim=48, num_classes=len(NONSQUARE_LABELS)),
                       labels=list(NONSQUARE_LABELS), mean=[0.3], std=[0.4], name="wide", version="2")
    return random_checkpoint(spec, tmp_path_factory.mktemp("wide") / "checkpoint", seed=1)


@pytest.fixture(scope="session")
def nonsquare_export(nonsquare_checkpoint, tmp_path_factory):
    """The fast path alone: its tests look at logits and rollout. The relevance path (20 s more to trace) is verified
    on the tiny model, at non-square sizes among others (export/verify.py's verification_sizes)."""
    from vitserve.export.onnx_export import export_onnx

    return export_onnx(nonsquare_checkpoint, tmp_path_factory.mktemp("onnx") / "wide.onnx", relevance=False)


@pytest.fixture(scope="session")
def tiny_fp16_export(tiny_checkpoint, tmp_path_factory):
    from vitserve.export.onnx_export import export_onnx

    return export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("onnx") / "tiny-fp16.onnx", fp16=True)


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from vitserve.model.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint)[0]


@pytest.fixture(scope="session")
def calibration_folder(tmp_path_factory, labelled_folder_writer):
    """DIR/<label>/<image> for the tiny model, 40 images a label: enough for a temperature and an OOD score."""
    return labelled_folder_writer(tmp_path_factory.mktemp("calibration"), 40, seed=1)


@pytest.fixture(scope="session")
def calibrated_export(tiny_checkpoint, calibration_folder, tmp_path_factory):
    """The tiny model exported with `calibration_folder` as its labelled set: a temperature and an OOD score, both
    paths, verified."""
    from vitserve.export.onnx_export import export_onnx

    return export_onnx(tiny_checkpoint, tmp_path_factory.mktemp("onnx") / "calibrated.onnx",
                       eval_dir=calibration_folder, inspection_images=0)
