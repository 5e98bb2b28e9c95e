"""Service fixtures: the tiny checkpoint exported once per session by `export_onnx`, and one ONNX Runtime
session shared by the in-process apps. Helpers live in service_fixtures.py."""
from __future__ import annotations

from pathlib import Path

import pytest

from service_fixtures import settings_for


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_onnx(tiny_checkpoint, tmp_path_factory) -> Path:
    """The shared tiny ViT (3 classes, 32x32, patch 8) exported by `export_onnx`; export's own tests verify it."""
    from export.onnx_export import export_onnx
    out = tmp_path_factory.mktemp("onnx") / "tiny.onnx"
    export_onnx(tiny_checkpoint, out, verify=False)
    return out


@pytest.fixture(scope="session")
def tiny_model(tiny_onnx):
    """One ONNX Runtime session shared by the in-process apps (loading is what lifespan would do)."""
    from service.runtime import OnnxModel
    return OnnxModel.load(settings_for(tiny_onnx))
