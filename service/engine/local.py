"""`LocalEngine`: the model's session and the dynamic batcher in this process.

It is the whole engine of a single-process server (`--engine inline`, and the tests), and the inside of an
engine process (`service/engine/process.py`), which feeds it what every HTTP frontend submits.
`start` loads the model (a bad model stops startup), starts the batcher, then warms up in the background;
`ready` turns true only after the warm-up.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Callable

import numpy as np

from service.batcher import BatchResult, DynamicBatcher
from service.errors import InferenceError, ModelLoadError
from service.metrics import ServiceMetrics
from service.runtime import InferenceModel, OnnxModel, warm_up
from service.settings import Settings
from vitserve.artifact import ModelInfo

log = logging.getLogger("vitserve.engine")


class LocalEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics, model: InferenceModel | None = None,
                 loader: Callable[[Settings], InferenceModel] = OnnxModel.load):
        self.settings, self.metrics = settings, metrics
        self.model = model  # given (tests) or loaded from settings.model_path at start, by `loader`
        self._loader = loader
        self.batcher: DynamicBatcher | None = None
        self.ready = False
        self.on_ready: Callable[[bool], None] = lambda ready: None
        self._warmup: asyncio.Task | None = None

    @property
    def info(self) -> ModelInfo:
        return self.model.info

    @property
    def provider(self) -> str:
        return self.model.provider

    async def start(self) -> None:
        if self.model is None:
            try:
                self.model = await asyncio.to_thread(self._loader, self.settings)
            except ModelLoadError as e:
                log.error("cannot start: %s", e)
                raise
        s, info = self.settings, self.model.info
        self.metrics.set_model(info.name, info.version, self.model.provider, info.opset)
        trained_cost = info.channels * info.image_size[0] * info.image_size[1]  # input values of one image
        self.batcher = DynamicBatcher(self.run_batch, max_batch_size=s.max_batch_size,
                                      max_queue_delay_s=s.max_queue_delay_s, max_queue_size=s.max_queue_size,
                                      max_batches_in_flight=s.max_batches_in_flight,
                                      dispatch_when_idle=s.dispatch_when_idle,
                                      max_batch_cost=s.max_batch_cost or s.max_batch_size * trained_cost,
                                      observer=self.metrics, max_targeted_batch_size=s.max_relevance_batch_size)
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
        self.on_ready(True)
        log.info("ready: %s %s on %s, warmed up at batch sizes %s in %.2f s", self.model.info.name,
                 self.model.info.version, self.model.provider, self.settings.warmup_batch_sizes,
                 time.perf_counter() - started)

    async def warmed_up(self) -> bool:
        """Wait for the warm-up that `start` began; whether the engine is ready. (A Ray Serve replica waits for
        it before Ray routes requests to it: service/ray_serve.py.)"""
        if self._warmup is not None:
            await asyncio.shield(self._warmup)
        return self.ready

    async def submit(self, pixels: np.ndarray, timeout_s: float, target: int | None = None) -> BatchResult:
        return await self.batcher.submit(pixels, timeout_s, target)

    def predicted_wait_s(self) -> float:
        return self.batcher.predicted_wait_s() if self.batcher else 0.0

    def run_batch(self, pixel_values: np.ndarray, targets: np.ndarray | None = None) -> list:
        """The batcher's callback (runner thread): (B, C, H, W) -> B (logits (K,), rollout (h, w)) pairs, or with
        `targets` (B,) (the class to explain per image) the relevance path's (logits, rollout, relevance (h, w)).
        An item whose outputs are not finite gets its own InferenceError; its batch-mates are unaffected."""
        if targets is None:
            outputs = self.model.run(pixel_values)
        else:
            outputs = self.model.explain(pixel_values, targets)
        if any(output.shape[0] != len(pixel_values) for output in outputs):
            raise InferenceError(f"model returned {outputs[0].shape[0]} results for {len(pixel_values)} images")
        finite = np.logical_and.reduce([np.isfinite(o.reshape(len(o), -1)).all(axis=1) for o in outputs])
        return [tuple(o[i] for o in outputs) if finite[i] else InferenceError("model output is not finite")
                for i in range(len(pixel_values))]

    async def close(self, timeout_s: float) -> None:
        """Stop the warm-up; run what is queued (up to `timeout_s`), then stop the batcher."""
        self.ready = False
        if self._warmup and not self._warmup.done():
            self._warmup.cancel()
        if self.batcher:
            await self.batcher.close(timeout_s)
