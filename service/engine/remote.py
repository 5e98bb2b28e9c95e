"""`RemoteEngine`: an HTTP frontend's handle on the engine processes (one per device) that `vitserve serve`
started: the same interface as `LocalEngine`, over ZeroMQ (service/engine/messages.py) and shared memory.

Each image is written into this process's `TensorArena` and sent as a `Submit` to the ready engine with the
shortest predicted wait; its region is freed when the engine's answer arrives. What the engines publish keeps
the frontend's view: readiness (the frontend is ready when an engine is), the queue (admission's estimate),
and the incarnation. An engine that stops publishing for `engine_timeout_s`, or that comes back as a new
incarnation (the supervisor restarted it), has lost what it held: those requests fail at once with 503
instead of waiting for their deadline.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import numpy as np
import zmq
import zmq.asyncio

from service.batcher import BatchResult
from service.engine.messages import Cancel, Codec, EngineStatus, Result, Submit, error_of, status_address
from service.engine.shm import ArenaFull, TensorArena
from service.errors import DeadlineExceeded, NotReady
from service.metrics import ServiceMetrics
from service.runtime import read_model_file_info
from service.settings import Settings
from vitserve.artifact import ModelInfo

log = logging.getLogger("vitserve.frontend")

RECONNECT_GRACE_S = 1.0  # how long a request waits for the connection to an engine said to be ready


@dataclass(eq=False)
class _Pending:
    future: asyncio.Future
    offset: int
    nbytes: int


@dataclass(eq=False)
class _Link:
    """One engine process, as this frontend sees it."""

    address: str
    requests: zmq.asyncio.Socket
    status_socket: zmq.asyncio.Socket
    status: EngineStatus | None = None
    seen_at: float = 0.0  # time.monotonic() of its last status
    sent_cost: int = 0  # input values sent since that status (its queue as this frontend knows it)
    pending: dict[int, _Pending] = field(default_factory=dict)

    @property
    def ready(self) -> bool:
        return self.status is not None and self.status.ready

    def predicted_wait_s(self) -> float:
        if self.status is None or self.status.seconds_per_cost is None:
            return 0.0
        return (self.status.queued_cost + self.sent_cost) * self.status.seconds_per_cost


class RemoteEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics):
        self.settings, self.metrics = settings, metrics
        self._info = read_model_file_info(settings.model_path)  # the labels and geometry, from the file alone
        self.ready = False
        self.on_ready = lambda ready: None
        self.codec = Codec()
        self.arena: TensorArena | None = None
        self._ids = itertools.count()
        self._links: list[_Link] = []
        self._context: zmq.asyncio.Context | None = None
        self._tasks: list[asyncio.Task] = []

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def provider(self) -> str:
        statuses = [link.status for link in self._links if link.status is not None]
        return statuses[0].provider if statuses else "unknown"

    async def start(self) -> None:
        self.arena = TensorArena.create(self.settings.engine_arena_bytes)
        self._context = zmq.asyncio.Context()
        for address in self.settings.engine_addresses:
            requests = self._context.socket(zmq.DEALER)
            requests.setsockopt(zmq.LINGER, 0)
            requests.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for an engine that is not connected
            requests.setsockopt(zmq.RECONNECT_IVL, 10)  # ms: back soon after an engine restarts
            requests.connect(address)
            status = self._context.socket(zmq.SUB)
            status.setsockopt(zmq.LINGER, 0)
            status.setsockopt(zmq.SUBSCRIBE, b"")
            status.setsockopt(zmq.RECONNECT_IVL, 10)
            status.connect(status_address(address))
            link = _Link(address, requests, status)
            self._links.append(link)
            self._tasks += [asyncio.create_task(self._answers(link)), asyncio.create_task(self._statuses(link))]
        self._tasks.append(asyncio.create_task(self._watch()))
        # Hear each engine once before this worker accepts connections (uvicorn accepts after the lifespan's
        # startup): a worker that started after its engine warmed up is ready from its first request.
        heard = time.monotonic() + self.settings.engine_timeout_s
        while any(link.status is None for link in self._links) and time.monotonic() < heard:
            await asyncio.sleep(0.005)
        log.info("frontend connected to %d engine(s), %s; arena %s of %d bytes", len(self._links),
                 "ready" if self.ready else "not ready yet", self.arena.name, self.arena.size)

    def predicted_wait_s(self) -> float:
        ready = [link.predicted_wait_s() for link in self._links if link.ready]
        return min(ready) if ready else 0.0

    async def submit(self, pixels: np.ndarray, timeout_s: float, target: int | None = None) -> BatchResult:
        links = [link for link in self._links if link.ready]
        if not links:
            raise NotReady("no inference engine is ready (starting, restarting or shutting down)")
        link = min(links, key=_Link.predicted_wait_s)
        try:
            offset = await self.arena.put_when_free(pixels, timeout_s)
        except (asyncio.TimeoutError, ArenaFull):
            raise DeadlineExceeded("no room for the image in this process's shared memory before its deadline") \
                from None
        id, future = next(self._ids), asyncio.get_running_loop().create_future()
        message = Submit(id, self.arena.name, offset, pixels.shape, pixels.dtype.str, timeout_s, target)
        if not await self._send(link, self.codec.encode(message), min(timeout_s, RECONNECT_GRACE_S)):
            self.arena.release(offset, pixels.nbytes)
            raise NotReady("the inference engine is not reachable")
        link.pending[id] = _Pending(future, offset, pixels.nbytes)
        link.sent_cost += pixels.size
        try:
            return await future
        except asyncio.CancelledError:
            if id in link.pending:  # the engine drops it (or its result) and still answers, freeing the region
                self._send_quietly(link, Cancel(id))
            raise

    @staticmethod
    async def _send(link: _Link, payload: bytes, grace_s: float) -> bool:
        """Send now, or within `grace_s` while the connection is being made: after an engine restarts, its status
        (another socket) can arrive before this socket has reconnected."""
        give_up = time.monotonic() + grace_s
        while True:
            try:
                await link.requests.send(payload, flags=zmq.NOBLOCK)
                return True
            except zmq.Again:
                if time.monotonic() >= give_up:
                    return False
                await asyncio.sleep(0.005)

    def _send_quietly(self, link: _Link, message) -> None:
        """Send without waiting (from a cancelled task, which cannot await); a failure is nobody's to report."""
        sent = link.requests.send(self.codec.encode(message), flags=zmq.NOBLOCK)
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _answers(self, link: _Link) -> None:
        while True:
            answer = self.codec.from_engine.decode(await link.requests.recv())
            pending = link.pending.pop(answer.id, None)
            if pending is None:  # its engine was given up on, and the region freed already
                continue
            self.arena.release(pending.offset, pending.nbytes)
            if pending.future.done():
                continue
            if isinstance(answer, Result):
                outputs = tuple(np.frombuffer(t.data, "<f4").reshape(t.shape) for t in answer.outputs)
                pending.future.set_result(BatchResult(outputs, answer.queue_s, answer.inference_s, answer.batch_size))
            else:
                pending.future.set_exception(error_of(answer))

    async def _statuses(self, link: _Link) -> None:
        while True:
            status = self.codec.status.decode(await link.status_socket.recv())
            if link.status is not None and status.incarnation != link.status.incarnation:
                log.error("the engine at %s restarted (%s -> %s): %d request(s) it held are lost", link.address,
                          link.status.incarnation, status.incarnation, len(link.pending))
                self._fail_pending(link, "the inference engine restarted; this request was lost: retry it")
            link.status, link.seen_at, link.sent_cost = status, time.monotonic(), 0
            self._update_ready()

    async def _watch(self) -> None:
        """Give up on engines that went silent: their requests fail now, not at their deadlines."""
        timeout = self.settings.engine_timeout_s
        while True:
            await asyncio.sleep(min(0.25, timeout / 4))
            now = time.monotonic()
            for link in self._links:
                if link.status is not None and link.status.ready and now - link.seen_at > timeout:
                    log.error("the engine at %s sent no status for %.1f s: failing its %d request(s)", link.address,
                              now - link.seen_at, len(link.pending))
                    link.status = None
                    self._fail_pending(link, "the inference engine stopped responding; this request was lost")
            self._update_ready()

    def _fail_pending(self, link: _Link, message: str) -> None:
        for pending in link.pending.values():
            self.arena.release(pending.offset, pending.nbytes)
            if not pending.future.done():
                pending.future.set_exception(NotReady(message))
        link.pending.clear()

    def _update_ready(self) -> None:
        ready = any(link.ready for link in self._links)
        if ready != self.ready:
            self.ready = ready
            self.on_ready(ready)

    async def close(self, timeout_s: float) -> None:
        self.ready = False
        for task in self._tasks:
            task.cancel()
        for link in self._links:
            self._fail_pending(link, "shutting down")
        if self._context is not None:
            self._context.destroy(linger=0)
        if self.arena is not None:
            self.arena.close()
