"""Where images are decoded and prepared: off the event loop, in thread pools, each image holding its share of the
process's pixel budget while it is decoded (so that a burst of large images waits instead of exhausting memory),
and images over `large_image_pixels` in a pool of their own, so that small ones never queue behind them.
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial

from vitserve.artifact import ModelInfo
from vitserve.service.ground.settings import Settings
from vitserve.service.usecases.admission import PixelBudget
from vitserve.service.usecases.preprocess import PreparedImage, ResizePolicy, peek_pixels, prepare_image


class ImagePools:
    def __init__(self, settings: Settings, raw_pixels: Callable[[], bool]):
        self.settings = settings
        self.raw_pixels = raw_pixels  # whether the engine normalises (images then travel as uint8)
        self.pool = ThreadPoolExecutor(settings.preprocess_threads, thread_name_prefix="preprocess")
        self.large_pool = ThreadPoolExecutor(1, thread_name_prefix="preprocess-large")
        self.budget = PixelBudget(settings.max_pixels_in_flight)

    async def preprocess(self, data: bytes, info: ModelInfo, resize: ResizePolicy,
                         keep_source: bool) -> tuple[PreparedImage, float]:
        """Decode and prepare one image for the model `info` describes, holding its share of the pixel budget
        while it does; returns it and the seconds it took. The header is read first: the limits, and the size to
        reserve."""
        s, loop, budget = self.settings, asyncio.get_running_loop(), self.budget
        # The header read is cheap, but a hostile file's header is still parsing: not on the event loop.
        pixels = await loop.run_in_executor(self.pool, partial(peek_pixels, data, max_bytes=s.max_upload_bytes,
                                                               max_pixels=s.max_image_pixels))
        reserved = await budget.acquire(pixels)
        pool = self.large_pool if pixels > s.large_image_pixels else self.pool
        job = pool.submit(timed, prepare_image, data, info, resize=resize, max_bytes=s.max_upload_bytes,
                          max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens, keep_source=keep_source,
                          max_render_side=s.max_rollout_image_side, raw_pixels=self.raw_pixels())
        # Released when the decode really ends: a request cancelled meanwhile (deadline, hang-up) cannot free
        # memory its thread still holds.
        job.add_done_callback(lambda _: loop.is_closed() or loop.call_soon_threadsafe(budget.release, reserved))
        return await asyncio.wrap_future(job)

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
