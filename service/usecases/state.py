"""The per-process serving state, made in the app's lifespan and reached by routes through dependencies
(service/http/dependencies.py) and by the gRPC servicer directly: the settings, the metrics, the engine, and one
object per concern beside them: `admission` (what is let in), `images` (where images are decoded:
`ImagePools`), `drain` (shutdown: service/ground/drain.py), `inspections` (the inspection cache).

`ServiceState.start` starts the engine (`service/engine/`: in this process, a bad model stops startup; or
the connection to an engine process); the service reports ready only while the engine is ready (warmed up) and
the process is not draining.
"""
from __future__ import annotations

import asyncio
import logging
import math
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from vitserve.artifact import ModelInfo
from vitserve.budgets import Rung
from vitserve.service.engine import Engine
from vitserve.service.engine.budgets import served_ladder
from vitserve.service.engine.pixels import engine_normalises
from vitserve.service.ground.drain import Drain
from vitserve.service.ground.errors import NotReady
from vitserve.service.ground.memory import return_large_frees_to_the_os
from vitserve.service.ground.metrics import ServiceMetrics, mark_process_dead
from vitserve.service.ground.settings import Settings
from vitserve.service.schemas.v1 import ResizePolicy
from vitserve.service.usecases.admission import Admission, PixelBudget
from vitserve.service.usecases.inspection import InspectionCache
from vitserve.service.usecases.preprocess import (
    PreparedImage,
    cheap_decode_pixels,
    peek_pixels,
    prepare_image,
)

log = logging.getLogger("vitserve.service")


@dataclass
class ServiceState:
    settings: Settings
    metrics: ServiceMetrics
    engine: Engine  # the session and batcher: in this process, or in an engine process every frontend feeds
    drain: Drain = field(init=False)
    admission: Admission = field(init=False)  # made by start(), before the first call
    images: ImagePools = field(init=False)  # made by start(), before the first call
    inspections: InspectionCache = field(default_factory=InspectionCache)  # GET /v1/models/{name}/inspect
    request_timeout_s: float = field(init=False)
    queue_wait_limit_s: float = field(init=False)

    def __post_init__(self) -> None:
        s = self.settings
        self.drain = Drain(s.drain_timeout_s, on_begin=lambda: self.metrics.set_worker_ready(False))
        # read by every call's admission: plain numbers, not the settings' properties
        self.request_timeout_s, self.queue_wait_limit_s = s.request_timeout_s, s.queue_wait_limit_s
        self._ladders: dict[int, tuple[ModelInfo, tuple[Rung, ...]]] = {}

    def ladder(self, info: ModelInfo) -> tuple[Rung, ...]:
        """The token budgets served for a version of `info` (service/engine/budgets.py), made once per metadata."""
        cached = self._ladders.get(id(info))
        if cached is None or cached[0] is not info:
            if len(self._ladders) > 64:  # versions come and go: bounded
                self._ladders.clear()
            cached = self._ladders[id(info)] = (info, served_ladder(info, self.settings))
        return cached[1]

    @property
    def ready(self) -> bool:
        """Serving: the engine is ready (loaded, warmed up, reachable) and this process is not shutting down."""
        return self.engine.ready and not self.drain.draining

    def require_ready(self) -> None:
        """NotReady (503, UNAVAILABLE) unless `ready`: warming up or shutting down."""
        if not self.ready:
            raise NotReady("the model is not ready (warming up or shutting down)")

    async def start(self) -> None:
        s = self.settings
        self.engine.on_ready = lambda ready: self.metrics.set_worker_ready(ready and not self.drain.draining)
        self.metrics.set_workers(s.http_workers)
        await self.engine.start()  # the engine that holds the model reports it (metrics.set_model)
        self.admission = Admission(s.max_requests_in_flight, s.max_loop_lag_ms / 1000 if s.max_loop_lag_ms else None,
                                   s.overload_queue_ms / 1000 if s.overload_queue_ms else None,
                                   min_shed_in_flight=shedding_floor(s))
        self.images = ImagePools(s, self.engine)
        self.admission.loop_lag.start()
        return_large_frees_to_the_os()
        self.drain.install_signal_handlers()

    async def stop(self) -> None:
        self.drain.end()
        self.metrics.set_worker_ready(False)
        if hasattr(self, "admission"):  # a start that failed before making it
            self.admission.loop_lag.stop()
        await self.engine.close(self.settings.drain_timeout_s)
        if hasattr(self, "images"):
            self.images.stop()
        mark_process_dead(os.getpid())


def shedding_floor(s: Settings) -> int:
    """Requests a shedding process still admits: its share of the engine's batches (the batches it keeps assembled
    or running, of max_batch_size, among the HTTP workers; all of them for its own engine, inline), since fewer
    leave the engine small batches that cost more per image (docs/reliability.md), and with degrade_under_load and
    an engine process the budget_queue_batches more past which the engine answers cheaper; 0 with
    overload_keeps_batches off."""
    if not s.overload_keeps_batches:
        return 0
    sharing = 1 if s.engine == "inline" else max(1, s.http_workers)
    # degrading under load, it lets the engine process see the backlog that makes it answer cheaper
    # (service/engine/budgets.py); a light model inline does not degrade, and a longer queue would slow its refusals
    degrades = s.degrade_under_load and s.engine != "inline"
    batches = s.batches_in_flight + (s.budget_queue_batches if degrades else 0)
    return math.ceil(s.max_batch_size * batches / sharing)


class ImagePools:
    """Where images are decoded and prepared: off the event loop, in thread pools, each image holding its share of
    the process's pixel budget while it is decoded (a burst of large images waits instead of exhausting memory),
    and images over `large_image_pixels` in a pool of their own, so that small ones never queue behind them.

    One exception: an image the caller lets go `inline` (a lone request's first: service/usecases/inference.py),
    if small and cheap to decode (`cheap_decode_pixels`: a PNG of at most 64 KiB and 65,536 pixels whose chunks
    all cost what their bytes cost, a few hundred microseconds), is decoded on the event loop. Nobody waits behind
    it there, and the trip to a pool thread and back, two thread wake-ups on an idle machine, cost as much as the
    decode itself (docs/latency-budget.md)."""

    def __init__(self, settings: Settings, engine: Engine):
        self.settings, self.engine = settings, engine  # the engine: whether it normalises (pixels travel as uint8)
        self.pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="preprocess-large")
        self.budget = PixelBudget(settings.max_pixels_in_flight)

    async def preprocess(self, data: bytes, info: ModelInfo, resize: ResizePolicy, keep_source: bool,
                         inline: bool = False) -> tuple[PreparedImage, float]:
        """Decode and prepare one image for the model `info` describes, holding its share of the pixel budget
        while it does; returns it and the seconds it took. The header is read first: the limits, and the size to
        reserve. Most images take one trip to the pool (header, reservation, decode); one that is large or must
        wait for room comes back to wait on the event loop, then goes to its pool. With `inline`, a cheap image is
        decoded on the loop instead (the class's doc)."""
        s, loop, budget = self.settings, asyncio.get_running_loop(), self.budget
        prepare = partial(prepare_image, data, info, resize=resize, max_bytes=s.max_upload_bytes,
                          max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens, keep_source=keep_source,
                          max_render_side=s.max_rollout_image_side,
                          raw_pixels=engine_normalises(s.pixel_transport, self.engine.provider))
        if inline:
            prepared = self._inline(data, prepare)
            if prepared is not None:
                return prepared
        # The header read is cheap, but a hostile file's header is still parsing: not on the event loop.
        prepared, pixels = await loop.run_in_executor(self.pool, self._at_once, loop, data, prepare)
        if prepared is not None:
            return prepared
        reserved = await budget.acquire(pixels)
        pool = self.large_pool if pixels > s.large_image_pixels else self.pool
        job = pool.submit(timed, prepare)
        # Released when the decode really ends: a request cancelled meanwhile (deadline, hang-up) cannot free
        # memory its thread still holds.
        job.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(budget.release, reserved))
        return await asyncio.wrap_future(job)

    def _inline(self, data: bytes, prepare) -> tuple[PreparedImage, float] | None:
        """On the event loop: a small image cheap to decode, prepared, holding its pixels' share of the budget
        meanwhile; None for any other (it goes to a pool)."""
        s = self.settings
        pixels = cheap_decode_pixels(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_image_pixels)
        return None if pixels is None else self._if_room(pixels, prepare, self.budget.release)

    def _at_once(self, loop, data: bytes, prepare) -> tuple[tuple[PreparedImage, float] | None, int]:
        """In the pool: the header's pixels and, for a small image whose pixels fit the budget now, the image
        prepared (and its seconds); (None, pixels) for one that must wait or go to the large pool."""
        s = self.settings
        pixels = peek_pixels(data, max_bytes=s.max_upload_bytes, max_pixels=s.max_image_pixels)
        if pixels > s.large_image_pixels:
            return None, pixels
        budget = self.budget

        def release(reserved: int) -> None:  # on the loop's thread, as `preprocess` releases
            if not loop.is_closed():
                loop.call_soon_threadsafe(budget.release, reserved)
        return self._if_room(pixels, prepare, release), pixels

    def _if_room(self, pixels: int, prepare, release) -> tuple[PreparedImage, float] | None:
        """`prepare` timed, if `pixels` fit the budget now (`PixelBudget.try_reserve`), holding them while it runs
        and handing them to `release` after; None if they do not fit."""
        reserved = self.budget.try_reserve(pixels)
        if reserved is None:
            return None
        try:
            return timed(prepare)
        finally:
            release(reserved)

    async def run(self, function, *args):
        """`function(*args)` in the pool (PNG rendering, inflating a body: real work), and the seconds it took."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, partial(timed, function, *args))

    def stop(self) -> None:
        for pool in (self.pool, self.large_pool):
            pool.shutdown(wait=False, cancel_futures=True)


def timed(function, *args, **kwargs):
    started = time.perf_counter()
    result = function(*args, **kwargs)
    return result, time.perf_counter() - started
