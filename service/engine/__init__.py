"""The inference engine: the ONNX Runtime session and the dynamic batcher, in the HTTP process (`LocalEngine`)
or in a process of its own that every HTTP frontend feeds (`EngineProcess` serving, `RemoteEngine` calling)."""
from __future__ import annotations

from typing import Callable, Protocol

import numpy as np

from service.batcher import BatchResult
from vitserve.artifact import ModelInfo


class Engine(Protocol):
    """What the HTTP side needs of an engine, wherever it runs."""

    ready: bool  # loaded, warmed up and reachable
    on_ready: Callable[[bool], None]  # called when `ready` changes

    @property
    def info(self) -> ModelInfo: ...

    @property
    def provider(self) -> str: ...

    async def start(self) -> None: ...

    async def submit(self, pixels: np.ndarray, timeout_s: float) -> BatchResult:
        """Run one image (C, H, W) in some batch; its result, or its own ServiceError."""

    def predicted_wait_s(self) -> float:
        """How long the work queued now would take to run (admission's estimate)."""

    async def close(self, timeout_s: float) -> None: ...
