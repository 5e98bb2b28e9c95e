"""`LonePathEngine` (`--engine process --lone-request-path true`): the engine process for every batch, and the same
model in this HTTP worker for a request that is alone.

Behind one engine process every worker's images batch together on one queue, whatever the split of the connections
between the workers; but a lone request pays the way there and back (ZeroMQ, shared memory, the engine's loop). This
takes that hop away from a lone request. It is an option, not `--engine auto`'s choice: on the 2-core EPYC, with
OpenVINO's threads unpinned, a session in each worker served 32 clients with more answers (1,184-1,328 req/s against
883-1,255) and one client as fast (docs/results/bench-peers.md#topology).

So a worker keeps both: the engine process (`RemoteEngine`) and a session of the same plan in the worker
(`LocalEngine`, the file's plan on one thread: service/engine/serving_plan.py). A request runs on the worker's session
only when it is alone (nothing else in flight in this worker), this worker has nothing in the engine, and the engine
reported nothing queued; everything else goes to the engine. The two answer the same image with the same bits: one
file, one plan, one thread each, and an answer never depends on its batch (tests/service/test_lone_path.py).
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.service.engine import IndexEntry, InferenceResult, ModelHandle
from vitserve.service.engine.budgets import FULL_BUDGET, BudgetAsk
from vitserve.service.engine.local import LocalEngine
from vitserve.service.engine.remote import RemoteEngine
from vitserve.service.ground.metrics import ServiceMetrics


class LonePathEngine:
    def __init__(self, remote: RemoteEngine, local: LocalEngine, metrics: ServiceMetrics):
        self.remote, self.local, self.metrics = remote, local, metrics
        self.on_ready: Callable[[bool], None] = lambda ready: None

    @property
    def ready(self) -> bool:
        return self.remote.ready  # the engine serves every request the worker's session does not take

    @property
    def provider(self) -> str:
        return self.remote.provider

    async def start(self) -> None:
        self.remote.on_ready = lambda ready: self.on_ready(ready)
        await self.remote.start()
        await self.local.start()

    async def warmed_up(self) -> bool:
        await self.local.warmed_up()
        return self.remote.ready

    def takes_alone(self, handle: ModelHandle, alone: bool, target: int | None) -> bool:
        """Whether this request runs on the worker's session: alone in the worker, nothing of the worker's in the
        engine, nothing queued there as the engine last said, and the session ready for this very version."""
        return (alone and target is None and self.local.ready and not self.remote.in_flight()
                and self.remote.predicted_wait_s(handle.name) == 0.0
                and (handle.name, handle.version) in self.local.ready_versions(handle.name))

    async def submit(self, handle: ModelHandle, pixels: np.ndarray, timeout_s: float,
                     target: int | None = None, maps_free: bool = False, alone: bool = False,
                     budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
        if self.takes_alone(handle, alone, target):
            self.metrics.lone_path_image(handle.name, handle.version)
            return await self.local.run_on(handle.name, handle.version, pixels, timeout_s, None, maps_free, alone,
                                           budget)
        return await self.remote.submit(handle, pixels, timeout_s, target, maps_free, alone, budget)

    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        return self.remote.route(name, version)

    def info(self, name: str, version: str) -> ModelInfo:
        return self.remote.info(name, version)

    def predicted_wait_s(self, name: str | None = None) -> float:
        return self.remote.predicted_wait_s(name)

    def ready_versions(self, name: str | None = None) -> list[tuple[str, str]]:
        return self.remote.ready_versions(name)

    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        return await self.remote.index(ready_only)

    def live_versions(self) -> set[tuple[str, str]]:
        return self.remote.live_versions()

    async def load(self, name: str) -> None:
        await self.remote.load(name)

    async def unload(self, name: str) -> None:
        await self.remote.unload(name)

    async def shadow_report(self, name: str) -> dict:
        return await self.remote.shadow_report(name)

    async def close(self, timeout_s: float) -> None:
        await asyncio.gather(self.local.close(timeout_s), self.remote.close(timeout_s))
