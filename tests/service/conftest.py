"""Service fixtures: one ONNX Runtime session over the shared tiny model (tests/conftest.py), used by the
in-process apps. Helpers live in service_fixtures.py."""
from __future__ import annotations

import os

import pytest

from service_fixtures import settings_for


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def tiny_model(tiny_onnx):
    """One ONNX Runtime session shared by the in-process apps (loading is what lifespan would do)."""
    from vitserve.service.engine.onnx_runtime import OnnxModel
    return OnnxModel.load(settings_for(tiny_onnx))


@pytest.fixture
def private_environ(monkeypatch):
    """`serve` writes its flags into os.environ (for uvicorn's workers); keep that inside the test."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")
                                        and k != "PROMETHEUS_MULTIPROC_DIR" or k == "VITSERVE_TUNING_DIR"})
