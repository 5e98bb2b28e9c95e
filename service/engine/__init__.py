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

    async def submit(self, pixels: np.ndarray, timeout_s: float, target: int | None = None) -> BatchResult:
        """Run one image (C, H, W) in some batch; its result, or its own ServiceError. The result's output is
        (logits, rollout), or with a `target` (the class to explain, -1 the top-1) the relevance path's
        (logits, rollout, relevance), which runs in batches of its own."""

    def predicted_wait_s(self) -> float:
        """How long the work queued now would take to run (admission's estimate)."""

    async def close(self, timeout_s: float) -> None: ...
