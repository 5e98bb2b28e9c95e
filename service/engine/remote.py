"""`RemoteEngine`: an HTTP frontend's handle on the engine processes (one per device) that `vitserve serve`
started: the same interface as `LocalEngine`, over ZeroMQ (service/engine/messages.py) and shared memory.

It routes with a `RoutingTable` over the repository index its engine sends (every version's state and the
metadata of those loaded), fetched again whenever the engine's status shows a new generation. Repository
changes (load, unload) are sent to every engine and answered once each has done it.

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
from functools import partial

import numpy as np
import zmq

from vitserve.artifact import ModelInfo
from vitserve.service.engine import IndexEntry, InferenceResult, ModelHandle
from vitserve.service.engine.budgets import FULL_BUDGET, BudgetAsk
from vitserve.service.engine.messages import (
    Cancel,
    Codec,
    Control,
    ControlReply,
    EngineStatus,
    Failure,
    RepositoryIndex,
    Result,
    Submit,
    error_of,
    status_address,
)
from vitserve.service.engine.routing import RoutingTable, VersionView
from vitserve.service.engine.shm import ArenaFull, TensorArena
from vitserve.service.engine.socket_reader import SocketReader
from vitserve.service.engine.worker_generations import WorkerViews
from vitserve.service.ground.errors import DeadlineExceeded, NotReady, ServiceError, VersionRetired
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.frontend")

RECONNECT_GRACE_S = 1.0  # how long a request waits for the connection to an engine said to be ready
CONTROL_TIMEOUT_S = 600.0  # a load can build a TensorRT engine for minutes
# How long a load or unload, done, waits for every other HTTP worker to route with its outcome: milliseconds
# normally; a worker whose event loop is stalled this long is not serving anyway.
WORKERS_AGREE_TIMEOUT_S = 10.0


@dataclass(eq=False)
class _Pending:
    future: asyncio.Future
    offset: int
    nbytes: int


@dataclass(eq=False)
class _Link:
    """One engine process, as this frontend sees it."""

    address: str
    requests: zmq.Socket  # plain: read from the loop by `reader` (service/engine/socket_reader.py)
    # plain too, read by `status_reader`: a status arrives every 20 ms while the engine works, in every HTTP worker,
    # busy or not, and through pyzmq's asyncio socket each cost a worker about as much as an answer's receive did
    status_socket: zmq.Socket
    status: EngineStatus | None = None  # None before the first, and once it went silent (`_watch`)
    # the engine process it last heard from, kept when it goes silent: a restart after a silence (the new engine
    # loads its models for longer than engine_timeout_s) is still a restart, whose generations count from 0 again
    incarnation: str | None = None
    seen_at: float = 0.0  # time.monotonic() of its last status
    sent_cost: int = 0  # input values sent since that status (its queue as this frontend knows it)
    pending: dict[int, _Pending] = field(default_factory=dict)
    controls: dict[int, asyncio.Future] = field(default_factory=dict)
    # This loop turn's Submits (with their id) and Cancels (None), sent together when the turn ends: one ZeroMQ
    # message of one frame (service/engine/messages.py), not a message and a send (a wake-up of ZeroMQ's I/O thread)
    # per image, nor a frame per image (pyzmq's per-frame calls cost as much as the rest of the image's message)
    outbox: list[tuple[int | None, Submit | Cancel]] = field(default_factory=list)
    reader: SocketReader = field(init=False)  # reads the engine's answers from `requests`, and sends on it
    status_reader: SocketReader = field(init=False)

    @property
    def ready(self) -> bool:
        return self.status is not None and self.status.ready

    def predicted_wait_s(self, model: str | None = None) -> float:
        """The queued work of `model`'s versions (None: of the least loaded model), as this frontend knows it."""
        if self.status is None:
            return 0.0
        waits: dict[str, float] = {}
        for queue in self.status.queues:
            if queue.seconds_per_cost is not None and model in (None, queue.model):
                waits[queue.model] = waits.get(queue.model, 0.0) + queue.queued_cost * queue.seconds_per_cost
        if not waits:
            return 0.0
        rate = max(q.seconds_per_cost or 0.0 for q in self.status.queues)
        return (min(waits.values()) if model is None else waits[model]) + self.sent_cost * rate


class RemoteEngine:
    def __init__(self, settings: Settings, metrics: ServiceMetrics):
        self.settings, self.metrics = settings, metrics
        self.table = RoutingTable()
        self._index: RepositoryIndex | None = None
        self._refreshing: asyncio.Task | None = None
        self.ready = False
        self.on_ready = lambda ready: None
        self.codec = Codec()
        self.arena: TensorArena | None = None
        self._ids = itertools.count()
        self._links: list[_Link] = []
        self._tasks: list[asyncio.Task] = []
        self._late: set[asyncio.Future] = set()  # sends retried while an engine reconnects (`_send_late`)
        self.views: WorkerViews | None = None

    @property
    def provider(self) -> str:
        statuses = [link.status for link in self._links if link.status is not None]
        return statuses[0].provider if statuses else "unknown"

    async def start(self) -> None:
        self.arena = TensorArena.create(self.settings.engine_arena_bytes)
        self.views = WorkerViews(self.settings.engine_addresses[0])
        # The process's one context (ZeroMQ's advice), held by pyzmq for the process's life: a context of this
        # engine's own, dropped without close() (a test's failure path), would be terminated by the garbage
        # collector while its sockets, in the same cycle, are still open: term() then waits for ever.
        plain: zmq.Context = zmq.Context.instance()
        for address in self.settings.engine_addresses:
            requests = plain.socket(zmq.DEALER)
            requests.setsockopt(zmq.LINGER, 0)
            requests.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing for an engine that is not connected
            requests.setsockopt(zmq.RCVHWM, 0)  # the engine's answers are never dropped (its ROUTER's note)
            requests.setsockopt(zmq.RECONNECT_IVL, 10)  # ms: back soon after an engine restarts
            requests.connect(address)
            status = plain.socket(zmq.SUB)
            status.setsockopt(zmq.LINGER, 0)
            status.setsockopt(zmq.SUBSCRIBE, b"")
            status.setsockopt(zmq.RECONNECT_IVL, 10)
            status.connect(status_address(address))
            link = _Link(address, requests, status)
            link.reader = SocketReader(requests, partial(self._answers, link))
            link.reader.start()
            link.status_reader = SocketReader(status, partial(self._status, link))
            link.status_reader.start()
            self._links.append(link)
        self._tasks.append(asyncio.create_task(self._watch()))
        # Hear each engine once before this worker accepts connections (uvicorn accepts after the lifespan's
        # startup): a worker that started after its engine warmed up is ready from its first request.
        heard = time.monotonic() + self.settings.engine_timeout_s
        while any(link.status is None for link in self._links) and time.monotonic() < heard:
            await asyncio.sleep(0.005)
        if any(link.status is not None for link in self._links):
            await self._refresh_index()
        log.info("frontend connected to %d engine(s), %s; arena %s of %d bytes", len(self._links),
                 "ready" if self.ready else "not ready yet", self.arena.name, self.arena.size)

    def route(self, name: str | None, version: str | None = None) -> ModelHandle:
        return self.table.route(name, version)

    def info(self, name: str, version: str) -> ModelInfo:
        return self.table.info(name, version)

    def predicted_wait_s(self, name: str | None = None) -> float:
        ready = [link.predicted_wait_s(name) for link in self._links if link.ready]
        return min(ready) if ready else 0.0

    def in_flight(self) -> bool:
        """Whether this frontend has an image in an engine that has not been answered yet."""
        return any(link.pending for link in self._links)

    def live_versions(self) -> set[tuple[str, str]]:
        return self.table.live()

    def ready_versions(self, name: str | None = None) -> list[tuple[str, str]]:
        return self.table.ready_versions(name)

    async def warmed_up(self) -> bool:
        return self.ready  # the engine process warms up on its own; its status says when it is ready

    async def submit(self, handle: ModelHandle, pixels: np.ndarray, timeout_s: float,
                     target: int | None = None, maps_free: bool = False, alone: bool = False,
                     budget: BudgetAsk = FULL_BUDGET) -> InferenceResult:
        # `alone` is not sent: the engine process has every frontend's images, and no frontend's loop to run one on
        try:
            return await self._submit(handle, pixels, timeout_s, target, maps_free, budget)
        except VersionRetired:
            if handle.pinned:
                raise
            await self._refresh_index()  # the engine has a newer index than this frontend routed with
            return await self._submit(self.table.reroute(handle), pixels, timeout_s, target, maps_free, budget)

    async def _submit(self, handle: ModelHandle, pixels: np.ndarray, timeout_s: float,
                      target: int | None, maps_free: bool, budget: BudgetAsk) -> InferenceResult:
        links = [link for link in self._links if link.ready]
        if not links:
            raise NotReady("no inference engine is ready (starting, restarting or shutting down)")
        link = min(links, key=lambda each: each.predicted_wait_s(handle.name))
        arena = self.arena
        assert arena is not None, "start() made it before the engine was ready"
        try:
            offset = await arena.put_when_free(pixels, timeout_s)
        except (TimeoutError, ArenaFull):
            raise DeadlineExceeded("no room for the image in this process's shared memory before its deadline") \
                from None
        id, future = next(self._ids), asyncio.get_running_loop().create_future()
        message = Submit(id, handle.name, handle.version, arena.name, offset, pixels.shape, pixels.dtype.str,
                         timeout_s, target, maps_free, budget.rung, budget.degradable)
        link.pending[id] = _Pending(future, offset, pixels.nbytes)
        link.sent_cost += pixels.size
        self._post(link, id, message)
        try:
            result = await future
        except asyncio.CancelledError:
            if id in link.pending:  # the engine drops it (or its result) and still answers, freeing the region
                self._post(link, None, Cancel(id))
            raise
        result.version = handle.version
        return result

    # --- the repository ---
    async def index(self, ready_only: bool = False) -> list[IndexEntry]:
        await self._refresh_index()
        rows = self._index.rows if self._index else []
        return [IndexEntry(r.model, r.version, r.state, r.reason) for r in rows
                if not ready_only or r.state == "READY"]

    async def load(self, name: str) -> None:
        await self._control_all("load", name)

    async def unload(self, name: str) -> None:
        await self._control_all("unload", name)

    async def shadow_report(self, name: str) -> dict:
        """Model `name`'s shadow comparisons, as its engine counted them (the first engine's, with several)."""
        links = [link for link in self._links if link.status is not None]
        if not links:
            raise NotReady("no inference engine is reachable")
        reply = await self._control(links[0], "shadow", name)
        if reply.code:
            raise error_of(Failure(reply.id, reply.code, reply.message))
        return reply.report

    async def _control_all(self, op: str, name: str) -> None:
        """Ask every engine; the first failure is raised (as the engine's error), after all have answered. Done,
        it answers once every HTTP worker routes with its outcome: the client's next request may reach any."""
        links = [link for link in self._links if link.status is not None]
        if not links:
            raise NotReady("no inference engine is reachable")
        first = links[0].status
        assert first is not None, "the links were chosen for their status"
        incarnation = first.incarnation
        replies = await asyncio.gather(*(self._control(link, op, name) for link in links))
        self._apply_index(replies[0].index, incarnation)
        for reply in replies:
            if reply.code:
                raise error_of(Failure(reply.id, reply.code, reply.message))
        await self._until_every_worker_has(incarnation, replies[0].index.generation, f"{op}ed {name!r}")

    async def _until_every_worker_has(self, incarnation: str, generation: int, change: str) -> None:
        """Wait until every live HTTP worker routes with `generation` (they fetch it as soon as their engine's
        status says it changed); NotReady after WORKERS_AGREE_TIMEOUT_S."""
        give_up = time.monotonic() + WORKERS_AGREE_TIMEOUT_S
        views = self.views
        assert views is not None, "start() made them"
        while lagging := views.behind(incarnation, generation):
            if time.monotonic() >= give_up:
                raise NotReady(f"{change}, but HTTP worker(s) {', '.join(map(str, lagging))} did not take the change "
                               f"in {WORKERS_AGREE_TIMEOUT_S:.0f} s and may still route as before")
            await asyncio.sleep(0.002)

    async def _control(self, link: _Link, op: str, name: str = "") -> ControlReply:
        id, future = next(self._ids), asyncio.get_running_loop().create_future()
        link.controls[id] = future
        try:
            if not await self._send(link, [self.codec.encode([Control(id, op, name)])], RECONNECT_GRACE_S):
                raise NotReady("the inference engine is not reachable")
            return await asyncio.wait_for(future, CONTROL_TIMEOUT_S)
        except TimeoutError:
            raise NotReady(f"the inference engine did not answer a repository {op} in {CONTROL_TIMEOUT_S:.0f} s") \
                from None
        finally:
            link.controls.pop(id, None)

    async def _refresh_index(self) -> None:
        """Fetch the engine's index (one fetch at a time: callers meanwhile wait for the one under way)."""
        try:
            await asyncio.shield(self._refresh_started())
        except ServiceError as e:
            log.warning("cannot fetch the repository index: %s", e)

    def _refresh_started(self) -> asyncio.Task:
        """The index fetch under way, or a new one: one at a time, whoever asks."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = asyncio.create_task(self._fetch_index())
            self._refreshing.add_done_callback(lambda done: done.cancelled() or done.exception())
        return self._refreshing

    async def _fetch_index(self) -> None:
        """The index, fetched again while the engine's status says it changed since (a fetch under way when the
        status came is older than it): a load waits for every worker to catch up."""
        links = [link for link in self._links if link.status is not None]
        while links and links[0].status is not None:
            status = links[0].status
            self._apply_index((await self._control(links[0], "index")).index, status.incarnation)
            now = links[0].status
            if now is None or self._index is None or now.generation <= self._index.generation:
                return

    def _apply_index(self, index: RepositoryIndex, incarnation: str) -> None:
        """Route with `index` (of the engine `incarnation`) from now on, and say so to the other workers."""
        if self._index is not None and index.generation < self._index.generation:
            return  # an older answer that arrived late
        loaded = {(v.model, v.version): v for v in index.loaded}
        views = {}
        for row in index.rows:
            if row.version:
                served = loaded.get((row.model, row.version))
                info = ModelInfo.from_metadata(served.metadata, served.opset) if served else None
                views[row.model, row.version] = VersionView(row.state, row.reason, info,
                                                            served.batching if served else {},
                                                            served.shadow if served else False,
                                                            served.version_policy if served else {},
                                                            served.serving if served else {})
        table = RoutingTable(views, dict(index.problems))
        retired = self.table.live() - table.live()
        self._index, self.table = index, table
        for model, version in retired:  # loaded again, it counts from zero (its series here too)
            self.metrics.retire(model, version)
        assert self.views is not None, "start() made them"
        self.views.publish(incarnation, index.generation)
        self._update_ready()

    @staticmethod
    async def _send(link: _Link, frames: list[bytes], grace_s: float) -> bool:
        """Send now, or within `grace_s` while the connection is being made: after an engine restarts, its status
        (another socket) can arrive before this socket has reconnected."""
        give_up = time.monotonic() + grace_s
        while True:
            try:
                link.reader.send(frames)
                return True
            except zmq.Again:
                if time.monotonic() >= give_up:
                    return False
                await asyncio.sleep(0.005)

    def _post(self, link: _Link, id: int | None, message: Submit | Cancel) -> None:
        """Send `message` (a Submit with its `id`, or a Cancel) with the rest of this loop turn's (`_Link.outbox`)."""
        if not link.outbox:
            asyncio.get_running_loop().call_soon(self._flush, link)
        link.outbox.append((id, message))

    def _flush(self, link: _Link) -> None:
        posted, link.outbox = link.outbox, []
        if not posted:  # failed meanwhile (`_fail_pending`)
            return
        try:
            link.reader.send([self._turn(posted)])
        except zmq.Again:  # not connected (IMMEDIATE: nothing is queued for an engine that is not): try for a while
            retry = asyncio.ensure_future(self._send_late(link, posted))
            self._late.add(retry)
            retry.add_done_callback(self._late.discard)
            return
        except zmq.ZMQError:  # the socket is closed (shutting down)
            self._fail_posted(link, posted)

    def _turn(self, posted: list[tuple[int | None, Submit | Cancel]]) -> bytes:
        return self.codec.encode([message for _, message in posted])

    async def _send_late(self, link: _Link, posted: list[tuple[int | None, Submit | Cancel]]) -> None:
        """Posted messages the socket refused: sent within the reconnection grace, or their images fail (503)."""
        posted = [(id, message) for id, message in posted if id is None or id in link.pending]  # not failed since
        if not posted:
            return
        try:
            if await self._send(link, [self._turn(posted)], RECONNECT_GRACE_S):
                return
        except zmq.ZMQError:  # the socket closed meanwhile
            pass
        self._fail_posted(link, posted)

    def _fail_posted(self, link: _Link, posted: list[tuple[int | None, Submit | Cancel]]) -> None:
        for id, _ in posted:
            pending = link.pending.pop(id, None) if id is not None else None
            if pending is not None:
                self._give_up(pending, "the inference engine is not reachable")

    def _give_up(self, pending: _Pending, message: str) -> None:
        """An image the engine will not answer: its region freed, its caller told (503)."""
        assert self.arena is not None, "an image was put in it"
        self.arena.release(pending.offset, pending.nbytes)
        if not pending.future.done():
            pending.future.set_exception(NotReady(message))

    def _answers(self, link: _Link, frames: list[bytes]) -> None:
        """A message from the engine: its answers of one turn, in one frame."""
        for frame in frames:
            try:
                answers = self.codec.from_engine.decode(frame)
            except Exception:  # a message it cannot read must not stop every later one from arriving
                log.exception("answers from the engine at %s could not be read (%d bytes); dropped", link.address,
                              len(frame))
                continue
            for answer in answers:
                try:
                    self._take_answer(link, answer)
                except Exception:  # one answer it cannot take must not stop the others
                    log.exception("an answer from the engine at %s could not be taken; dropped", link.address)

    def _take_answer(self, link: _Link, answer: Result | Failure | ControlReply) -> None:
        if isinstance(answer, ControlReply):
            control = link.controls.get(answer.id)
            if control is not None and not control.done():
                control.set_result(answer)
            return
        pending = link.pending.pop(answer.id, None)
        if pending is None:  # its engine was given up on, and the region freed already
            return
        assert self.arena is not None, "an image was put in it"
        self.arena.release(pending.offset, pending.nbytes)
        if pending.future.done():
            return
        if isinstance(answer, Result):
            outputs = tuple(np.frombuffer(t.data, "<f4").reshape(t.shape) for t in answer.outputs)
            pending.future.set_result(InferenceResult(outputs, answer.queue_s, answer.inference_s,
                                                      answer.batch_size, batch_span=answer.batch_span,
                                                      rung=answer.rung, reason=answer.reason or None))
        else:
            pending.future.set_exception(error_of(answer))

    def _status(self, link: _Link, frames: list[bytes]) -> None:
        """A status from the engine (one frame)."""
        status = self.codec.status.decode(frames[0])
        if link.incarnation is not None and status.incarnation != link.incarnation:
            log.error("the engine at %s restarted (%s -> %s): %d request(s) it held are lost", link.address,
                      link.incarnation, status.incarnation, len(link.pending))
            self._fail_pending(link, "the inference engine restarted; this request was lost: retry it")
            self._index = None  # the new engine's generations count from the start again
        link.status, link.incarnation, link.seen_at, link.sent_cost = status, status.incarnation, time.monotonic(), 0
        if self._index is None or status.generation != self._index.generation:
            self._refresh_started()
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
        for control in link.controls.values():
            if not control.done():
                control.set_exception(NotReady(message))
        for pending in link.pending.values():
            self._give_up(pending, message)
        link.pending.clear()
        link.outbox.clear()  # their regions are free again: the engine must not read them

    def _update_ready(self) -> None:
        ready = any(link.ready for link in self._links)
        if ready and not self.ready:
            # Turning ready waits for the routing table of the engine's present state: after a restart, the table
            # fetched while the new engine was still loading would refuse what it now serves. Once ready, later
            # changes (other models' loads) do not flap readiness while their table is fetched.
            generation = None if self._index is None else self._index.generation
            ready = generation is not None and any(
                link.status is not None and link.status.ready and link.status.generation == generation
                for link in self._links)
        if ready != self.ready:
            self.ready = ready
            self.on_ready(ready)

    async def close(self, timeout_s: float) -> None:
        self.ready = False
        if self.views is not None:
            self.views.withdraw()
        for task in [*self._tasks, *self._late]:
            task.cancel()
        for link in self._links:
            self._fail_pending(link, "shutting down")
        for link in self._links:
            link.reader.stop()
            link.status_reader.stop()
            link.requests.close(linger=0)
            link.status_socket.close(linger=0)
        if self.arena is not None:
            self.arena.close()
