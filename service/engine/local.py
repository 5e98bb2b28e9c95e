"""`LocalEngine`: the model registry (every served version's session and batcher) in this process.

It is the whole engine of a single-process server (`--engine inline`, and the tests), and the inside of an
engine process (`service/engine/server.py`), which feeds it what every HTTP frontend submits.
`start` loads the models the server starts with (a bad single model file stops startup); `ready` turns true
once they are loaded and warmed up.
"""
from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.service.engine import IndexEntry, InferenceResult, ModelHandle
from vitserve.service.engine.budgets import FULL_BUDGET, BudgetAsk
from vitserve.service.engine.registry import ModelRegistry
from vitserve.service.ground.errors import InferenceError, VersionRetired
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.engine")


class LocalEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics, registry: ModelRegistry):
        self.settings, self.metrics, self.registry = settings, metrics, registry
        self.ready = False
        self.on_ready: Callable[[bool], None] = lambda ready: None
        self._warming: asyncio.Task | None = None

    @property
    def provider(self) -> str:
        providers = [r.served.provider for r in self.registry.records.values() if r.served and r.served.model]
        return providers[0] if providers else "unknown"

    async def start(self) -> None:
        """Load the models the server starts with (a bad single file raises ModelLoadError), then warm them up in
        the background: ready once every one that loaded is warmed up."""
        single = self.settings.model_repository is None
        await self.registry.start(self.settings.startup_models, required=single)
        self._warming = asyncio.create_task(self._warm_up(single))

    async def _warm_up(self, single: bool) -> None:
        if not await self.registry.warm_up_loading() and single:
            return  # stay not ready: the readiness probe fails and the orchestrator restarts us
        self.ready = True
        self.on_ready(True)

    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        return self.registry.route(name, version)

    def info(self, name: str, version: str) -> ModelInfo:
        return self.registry.serving(name, version).info

    async def submit(self, handle: ModelHandle, pixels: np.ndarray, timeout_s: float,
                     target: int | None = None, maps_free: bool = False, alone: bool = False,
                     budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
        try:
            return await self.run_on(handle.name, handle.version, pixels, timeout_s, target, maps_free, alone, budget)
        except VersionRetired:
            rerouted = self.registry.table.reroute(handle)
            return await self.run_on(rerouted.name, rerouted.version, pixels, timeout_s, target, maps_free, alone,
                                     budget)

    async def run_on(self, name: str, version: str, pixels: np.ndarray, timeout_s: float,
                     target: int | None, maps_free: bool = False, alone: bool = False,
                     budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
        """Run one image on exactly this version: `begin_on`, awaited."""
        answer = asyncio.get_running_loop().create_future()
        queued = self.begin_on(name, version, pixels, timeout_s, target, functools.partial(_settle, answer), maps_free,
                               alone, budget)
        try:
            return await answer
        except asyncio.CancelledError:
            queued.cancel()  # dropped from its queue if it has not run
            raise

    def begin_on(self, name: str, version: str, pixels: np.ndarray, timeout_s: float, target: int | None,
                 done: Callable[[InferenceResult | BaseException], None], maps_free: bool = False,
                 alone: bool = False, budget: BudgetAsk = FULL_BUDGET) -> asyncio.Future:
        """`run_on` with no task and no coroutine per image, for an engine process at its ceiling: the image is
        queued now (routing errors and a full queue raise here) and `done` gets its InferenceResult, or its error
        (CancelledError when the returned future was cancelled), from the batch's callback. `alone`: nothing else
        is in flight in this process (the batcher may run it on the event loop: service/engine/batcher.py)."""
        served = self.registry.serving(name, version)
        served.check_open()
        batcher = served.batcher
        assert batcher is not None, "a served version's batcher starts when it loads"
        served.requests.hold()
        try:
            future = batcher.enqueue(pixels, timeout_s, target, maps_free=maps_free, alone=alone,
                                     rung=min(budget.rung, len(served.ladder) - 1), degradable=budget.degradable)
        except BaseException:
            served.requests.release()
            raise

        def finished(future: asyncio.Future) -> None:
            served.requests.release()
            if future.cancelled():
                done(asyncio.CancelledError())
            elif (error := future.exception()) is not None:
                done(error)
            else:
                # `done` is the request's only answer (in an engine process, its frontend frees the image's shared
                # memory on it): nothing here may keep it from being called
                try:
                    result = served.result_of(future.result())
                except Exception as e:
                    log.exception("the answer of %s version %s could not be read", served.name, served.version)
                    done(InferenceError(f"the model's answer could not be read: {e}"))
                    return
                try:
                    self._offer_shadow(served, pixels, result, target)
                except Exception:  # a comparison's failure never costs the answer
                    log.exception("offering a request to %s's shadow failed", served.name)
                done(result)

        future.add_done_callback(finished)
        return future

    def _offer_shadow(self, served, pixels: np.ndarray, result: InferenceResult, target: int | None) -> None:
        shadow = self.registry.shadows.get(served.name)
        if shadow is not None and target is None:  # the relevance path is an explanation, not an answer to compare
            shadow.offer(served.version, pixels, result.output, served.info)

    async def shadow_report(self, name: str) -> dict:
        return self.registry.shadow_report(name)

    def predicted_wait_s(self, name: str | None = None) -> float:
        return self.registry.predicted_wait_s(name)

    def ready_versions(self, name: str | None = None) -> list[tuple[str, str]]:
        return self.registry.table.ready_versions(name)

    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        return self.registry.index(ready_only)

    def live_versions(self) -> set[tuple[str, str]]:
        return self.registry.live_versions()

    async def load(self, name: str) -> None:
        await self.registry.load(name)

    async def unload(self, name: str) -> None:
        await self.registry.unload(name)

    async def close(self, timeout_s: float) -> None:
        """Run what is queued (up to `timeout_s`), then stop every version."""
        self.ready = False
        if self._warming is not None and not self._warming.done():
            self._warming.cancel()
        await self.registry.close(timeout_s)

    async def warmed_up(self) -> bool:
        """Wait for the warm-up that `start` began; whether the engine is ready. (A Ray Serve replica waits for it
        before Ray routes requests to it: service/ray_serve.py.)"""
        if self._warming is not None:
            await asyncio.shield(self._warming)
        return self.ready


def _settle(answer: asyncio.Future, outcome: InferenceResult | BaseException) -> None:
    """`begin_on`'s outcome into the future `run_on` awaits (unless it was cancelled first)."""
    if answer.done():
        return
    if isinstance(outcome, BaseException):
        answer.set_exception(outcome)
    else:
        answer.set_result(outcome)
