"""The per-process serving state, made in the app's lifespan and reached by routes through dependencies
(service/http/dependencies.py) and by the gRPC servicer directly.

`ServiceState.start` starts the engine (`service/engine/`: in this process, a bad model stops startup; or
the connection to an engine process); the service reports ready only while the engine is ready (warmed up).

Shutdown: on SIGTERM (or SIGINT) the state stops being ready at once and gives admitted requests
`drain_timeout_s` to finish; then `stopping` is set and whatever still waits is answered 503 (JSON), before
uvicorn's own graceful timeout (a second later) would cancel it with a bare 500. `stop` then closes the engine.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from vitserve.artifact import ModelInfo
from vitserve.service.engine import Engine
from vitserve.service.engine.pixels import engine_normalises
from vitserve.service.ground.deadlines import StopSignal
from vitserve.service.ground.errors import NotReady
from vitserve.service.ground.memory import return_large_frees_to_the_os
from vitserve.service.ground.metrics import ServiceMetrics, mark_process_dead
from vitserve.service.ground.settings import Settings
from vitserve.service.usecases.admission import Admission, PixelBudget
from vitserve.service.usecases.inspection import InspectionCache
from vitserve.service.usecases.preprocess import PreparedImage, ResizePolicy, peek_pixels, prepare_image

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)

log = logging.getLogger("vitserve.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: ServiceMetrics
    engine: Engine  # the session and batcher: in this process, or in an engine process every frontend feeds
    pool: ThreadPoolExecutor | None = None  # preprocessing and PNG rendering, off the event loop
    large_pool: ThreadPoolExecutor | None = None  # images over large_image_pixels: small ones never wait for them
    admission: Admission | None = None
    pixels: PixelBudget | None = None
    stopping: StopSignal = field(default_factory=StopSignal)  # the drain ran out: answer 503 now
    drain_begun: asyncio.Event = field(default_factory=asyncio.Event)  # SIGTERM: stop taking new calls (gRPC)
    inspections: InspectionCache = field(default_factory=InspectionCache)  # GET /v1/models/{name}/inspect
    draining: bool = False
    _previous_handlers: dict = field(default_factory=dict, repr=False)

    @property
    def ready(self) -> bool:
        """Serving: the engine is ready (loaded, warmed up, reachable) and this process is not shutting down."""
        return self.engine.ready and not self.draining

    def require_ready(self) -> None:
        """NotReady (503, UNAVAILABLE) unless `ready`: warming up or shutting down."""
        if not self.ready:
            raise NotReady("the model is not ready (warming up or shutting down)")

    async def start(self) -> None:
        s = self.settings
        self.engine.on_ready = lambda ready: self.metrics.set_worker_ready(ready and not self.draining)
        self.metrics.set_workers(s.http_workers)
        await self.engine.start()  # the engine that holds the model reports it (metrics.set_model)
        self.pool = ThreadPoolExecutor(s.preprocess_threads, thread_name_prefix="preprocess")
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="preprocess-large")
        self.admission = Admission(s.max_requests_in_flight, s.max_loop_lag_ms / 1000 if s.max_loop_lag_ms else None,
                                   s.overload_queue_ms / 1000 if s.overload_queue_ms else None,
                                   min_shed_in_flight=self.shedding_floor())
        self.admission.loop_lag.start()
        self.pixels = PixelBudget(s.max_pixels_in_flight)
        return_large_frees_to_the_os()
        self._install_drain_handlers()

    def _install_drain_handlers(self) -> None:
        """Chain in front of the server's signal handlers (uvicorn's, which stop accepting and wait for the
        admitted requests): start the drain clock, then let the server do what it does."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (an embedding app's concern)
        loop = asyncio.get_running_loop()

        def on_signal(number, frame):
            loop.call_soon_threadsafe(self.begin_drain)
            previous = self._previous_handlers.get(number)
            if callable(previous):
                previous(number, frame)

        for number in SHUTDOWN_SIGNALS:
            self._previous_handlers[number] = signal.signal(number, on_signal)

    def begin_drain(self) -> None:
        """Not ready from now on; after drain_timeout_s whatever still waits is answered 503."""
        if self.draining:
            return
        self.draining = True
        self.drain_begun.set()
        self.metrics.set_worker_ready(False)
        asyncio.get_running_loop().call_later(self.settings.drain_timeout_s, self.stopping.set)

    async def stop(self) -> None:
        self.draining = True
        self.metrics.set_worker_ready(False)
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        if self.admission:
            self.admission.loop_lag.stop()
        await self.engine.close(self.settings.drain_timeout_s)
        for pool in (self.pool, self.large_pool):
            if pool:
                pool.shutdown(wait=False, cancel_futures=True)
        mark_process_dead(os.getpid())

    async def preprocess(self, data: bytes, info: ModelInfo, resize: ResizePolicy,
                         keep_source: bool) -> tuple[PreparedImage, float]:
        """Decode and prepare one image for the model `info` describes, in a pool, holding its share of the pixel
        budget while it does; returns it and the seconds it took. The header is read first: the limits, and the
        size to reserve."""
        s, loop, budget = self.settings, asyncio.get_running_loop(), self.pixels
        assert budget is not None and self.pool is not None and self.large_pool is not None, "start() made them"
        # The header read is cheap, but a hostile file's header is still parsing: not on the event loop.
        pixels = await loop.run_in_executor(self.pool, partial(peek_pixels, data, max_bytes=s.max_upload_bytes,
                                                               max_pixels=s.max_image_pixels))
        reserved = await budget.acquire(pixels)
        pool = self.large_pool if pixels > s.large_image_pixels else self.pool
        job = pool.submit(_timed, prepare_image, data, info, resize=resize, max_bytes=s.max_upload_bytes,
                          max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens, keep_source=keep_source,
                          max_render_side=s.max_rollout_image_side,
                          raw_pixels=engine_normalises(s.pixel_transport, self.engine.provider))
        # Released when the decode really ends: a request cancelled meanwhile (deadline, hang-up) cannot free
        # memory its thread still holds.
        job.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(budget.release, reserved))
        return await asyncio.wrap_future(job)

    def shedding_floor(self) -> int:
        """Requests a shedding process still admits: its share of the engine's batches (max_batches_in_flight of
        max_batch_size among the HTTP workers), since fewer leave the engine small batches that cost more per
        image (docs/reliability.md); 0 with overload_keeps_batches off."""
        s = self.settings
        if not s.overload_keeps_batches:
            return 0
        return math.ceil(s.max_batch_size * s.max_batches_in_flight / max(1, s.http_workers))

    async def in_pool(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(_timed, function, *args))


def _timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started

