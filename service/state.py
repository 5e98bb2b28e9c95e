"""The per-process serving state, made in the app's lifespan and reached by routes through dependencies.

`ServiceState.start` loads the model (a bad model stops startup), starts the batcher, then warms up
in the background; only after warm-up does the service report ready. `stop` drains.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from fastapi import Request

from service.batcher import DynamicBatcher
from service.errors import InferenceError, ModelLoadError, NotReady
from service.metrics import ServiceMetrics, mark_process_dead
from service.preprocess import PreparedImage, ResizePolicy, prepare_image
from service.runtime import InferenceModel, OnnxModel, warm_up
from service.settings import Settings

log = logging.getLogger("vitserve.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: ServiceMetrics
    model: InferenceModel | None = None  # given (tests) or loaded from settings.model_path at startup
    batcher: DynamicBatcher | None = None
    pool: ThreadPoolExecutor | None = None  # preprocessing and PNG rendering, off the event loop
    ready: bool = False
    _warmup: asyncio.Task | None = field(default=None, repr=False)

    async def start(self) -> None:
        if self.model is None:
            try:
                self.model = await asyncio.to_thread(OnnxModel.load, self.settings)
            except ModelLoadError as e:
                log.error("cannot start: %s", e)
                raise
        s, info = self.settings, self.model.info
        self.metrics.set_model(info.name, info.version, self.model.provider, info.opset)
        self.pool = ThreadPoolExecutor(s.preprocess_threads, thread_name_prefix="preprocess")
        self.batcher = DynamicBatcher(self.run_batch, max_batch_size=s.max_batch_size,
                                      max_queue_delay_s=s.max_queue_delay_s, max_queue_size=s.max_queue_size,
                                      max_batches_in_flight=s.max_batches_in_flight,
                                      dispatch_when_idle=s.dispatch_when_idle,
                                      observer=self.metrics)
        self.batcher.start()
        self._warmup = asyncio.create_task(self._warm_up())

    async def _warm_up(self) -> None:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(warm_up, self.model, self.settings.warmup_batch_sizes)
        except Exception:  # stay not-ready: the readiness probe fails and the orchestrator restarts us
            log.exception("warm-up failed; the service stays not ready")
            return
        self.ready = True
        self.metrics.set_ready(True)
        log.info("ready: %s %s on %s, warmed up at batch sizes %s in %.2f s", self.model.info.name,
                 self.model.info.version, self.model.provider, self.settings.warmup_batch_sizes,
                 time.perf_counter() - started)

    async def stop(self) -> None:
        self.ready = False
        self.metrics.set_ready(False)
        if self._warmup and not self._warmup.done():
            self._warmup.cancel()
        if self.batcher:
            await self.batcher.close(self.settings.drain_timeout_s)
        if self.pool:
            self.pool.shutdown(wait=False, cancel_futures=True)
        mark_process_dead(os.getpid())

    def run_batch(self, pixel_values: np.ndarray) -> list:
        """The batcher's callback (runner thread): (B, C, H, W) -> B (logits (K,), rollout (h, w)) pairs.
        An item whose outputs are not finite gets its own InferenceError; its batch-mates are unaffected."""
        logits, rollout = self.model.run(pixel_values)
        if logits.shape[0] != len(pixel_values) or rollout.shape[0] != len(pixel_values):
            raise InferenceError(f"model returned {logits.shape[0]} results for {len(pixel_values)} images")
        finite = np.isfinite(logits).all(axis=1) & np.isfinite(rollout).reshape(len(rollout), -1).all(axis=1)
        return [(logits[i], rollout[i]) if finite[i] else InferenceError("model output is not finite")
                for i in range(len(pixel_values))]

    async def preprocess(self, data: bytes, resize: ResizePolicy, keep_source: bool) -> tuple[PreparedImage, float]:
        """Decode and prepare one image in the pool; returns it and the seconds it took."""
        s = self.settings
        job = partial(_timed, prepare_image, data, self.model.info, resize=resize, max_bytes=s.max_upload_bytes,
                      max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens, keep_source=keep_source)
        return await asyncio.get_running_loop().run_in_executor(self.pool, job)

    async def in_pool(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(_timed, function, *args))


def _timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started


def get_state(request: Request) -> ServiceState:
    """Dependency: the serving state, whether or not it is ready (health and metadata routes)."""
    return request.app.state.service


def get_ready_state(request: Request) -> ServiceState:
    """Dependency: the serving state once warmed up; 503 before that and while shutting down."""
    state: ServiceState = request.app.state.service
    if not state.ready:
        raise NotReady("the model is not ready (warming up or shutting down)")
    return state
