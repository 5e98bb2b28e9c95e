"""Evaluation fixtures: the shared tiny checkpoint (tests/conftest.py) as a torch model; its ONNX export
(`tiny_onnx`) comes from tests/conftest.py."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_model(tiny_checkpoint):
    from vitserve.model.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint)[0]
