"""An engine process: one `LocalEngine` (the model registry: every version's session and batcher) fed by every
HTTP frontend.

`run_engine_process` is the process's entry point (started by `service/engine/supervisor.py`). It binds a
ZeroMQ ROUTER socket at its address for `Submit`, `Cancel` and `Control` (service/engine/messages.py) and a PUB
socket beside it for `EngineStatus`. Each submitted image is read in place from its frontend's shared-memory
arena and joins its version's batch queue, so batches fill across frontends as in one process; every `Submit`
gets exactly one `Result` or `Failure`, every `Control` one `ControlReply`. It stops when the supervisor sets
`stop` (running what is queued first), or when its parent is gone. Ctrl-C reaches every process of the
terminal's group: the engine leaves it to the supervisor.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import time
import uuid
from pathlib import Path

import numpy as np
import zmq
import zmq.asyncio

from vitserve.service.engine.budgets import BudgetAsk
from vitserve.service.engine.local import LocalEngine
from vitserve.service.engine.messages import (
    Cancel,
    Codec,
    Control,
    ControlReply,
    EngineStatus,
    Failure,
    IndexRow,
    LoadedVersion,
    RepositoryIndex,
    Result,
    Submit,
    Tensor,
    VersionQueue,
    failure_for,
    status_address,
)
from vitserve.service.engine.registry import ModelRegistry, model_source
from vitserve.service.engine.runtime import load_engine_model
from vitserve.service.engine.shm import ArenaReader
from vitserve.service.engine.socket_reader import SocketReader
from vitserve.service.ground import tracing
from vitserve.service.ground.errors import ClientDisconnected, ServiceError
from vitserve.service.ground.memory import freeze_startup_objects
from vitserve.service.ground.metrics import ServiceMetrics, mark_process_dead
from vitserve.service.ground.settings import Settings

log = logging.getLogger("vitserve.engine")

PROCESS_NAME = "vitserve-engine"  # at most 15 characters: the kernel's limit for a process's name
STATUS_INTERVAL_S = 0.02  # how often frontends hear the queue state (their admission's estimate) and liveness
# ... while the engine has work, or had some since it last said; idle, only this often (and at most a quarter of
# the frontends' engine_timeout_s, which gives up on an engine that went silent): 50 statuses a second, each
# waking every HTTP worker, were most of an idle server's CPU.
IDLE_STATUS_INTERVAL_S = 0.5
# A retiring version still runs what frontends routed to it before they heard of the change (a status interval,
# then an index request): many intervals, so a busy frontend's loop has time too.
RETIRE_GRACE_S = 0.5


def run_engine_process(settings: Settings, address: str, stop, parent_pid: int, started) -> None:
    """Entry point of a spawned engine process. `started` (a pipe's end) gets one message once the model is
    loaded: None, or the ModelLoadError's text (then the process exits 1)."""
    from vitserve.service.ground.logs import configure_logging
    configure_logging(settings.log_level)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:  # its name in ps and top (and how tests tell it from the HTTP workers)
        Path("/proc/self/comm").write_text(PROCESS_NAME)
    except OSError:
        pass
    try:
        import uvloop
        uvloop.install()
    except ImportError:
        pass
    try:
        metrics = ServiceMetrics()
        registry = ModelRegistry(model_source(settings), settings, metrics, loader=load_engine_model,
                                 retire_grace_s=RETIRE_GRACE_S)
        server = EngineServer(LocalEngine(settings, metrics, registry), address)
        tracing.configure(settings)  # the batches' spans: each ORT run is one
        asyncio.run(server.run(stop, parent_pid, started))
    except ServiceError as e:  # a bad single model file, an unreadable repository
        _report(started, str(e))
        raise SystemExit(1) from None
    finally:
        tracing.shutdown()


def _report(started, outcome: str | None) -> None:
    try:
        started.send(outcome)
    except OSError:  # the supervisor no longer listens (a restart it does not wait on)
        pass


class EngineServer:
    def __init__(self, engine: LocalEngine, address: str):
        self.engine, self.address = engine, address
        self.incarnation = uuid.uuid4().hex[:12]
        self.codec = Codec()
        self.arenas = ArenaReader()
        self.running: dict[tuple[bytes, int], asyncio.Future] = {}  # (frontend, id) -> its work (cancellable)
        self.work_arrived = asyncio.Event()  # a frontend's message since the status publisher last looked
        self.stopping = False
        # Answers not sent yet, by frontend: a batch's answers finish together and go out as one message of one
        # frame per frontend at the end of the loop's turn, instead of one message, and one wake-up of the
        # frontend's ZeroMQ thread and event loop, per image (service/engine/messages.py).
        self.outbox: dict[bytes, list[Result | Failure | ControlReply]] = {}
        self.reader: SocketReader | None = None  # the frontends' messages, from `listen`

    async def run(self, stop, parent_pid: int, started) -> None:
        # the frontends' socket is a plain one, read from the loop (service/engine/socket_reader.py)
        context, plain = zmq.asyncio.Context(), zmq.Context()
        router, publisher = plain.socket(zmq.ROUTER), context.socket(zmq.PUB)
        for socket in (router, publisher):
            socket.setsockopt(zmq.LINGER, 0)
        # No high-water mark: at the default (1,000 messages) a ROUTER drops what a slow frontend has not read, and
        # an answer dropped is an image's shared memory its frontend never frees. What waits is bounded anyway: a
        # frontend has at most max_requests_in_flight requests, and their answers go out a loop turn at a time.
        router.setsockopt(zmq.SNDHWM, 0)
        router.bind(self.address)
        publisher.bind(status_address(self.address))
        self.engine.on_ready = self.engine.metrics.set_ready
        self.engine.registry.on_change = lambda: self._status_soon(publisher)
        await self.engine.start()  # loads the models: with a single file, a ModelLoadError ends the process
        freeze_startup_objects()
        _report(started, None)
        log.info("engine %s (pid %d) listening at %s", self.incarnation, os.getpid(), self.address)
        reader = self.listen(router)
        workers = [asyncio.create_task(self._publish(publisher))]
        try:
            await self._until_stopped(stop, parent_pid)
        finally:
            self.stopping = True
            await self.engine.close(self.engine.settings.drain_timeout_s)
            if self.running:
                await asyncio.wait(list(self.running.values()), timeout=1.0)
            reader.stop()
            self._send_answers()  # the last ones, before the context goes
            await self._send_status(publisher)  # not ready: frontends stop sending at once
            for worker in workers:
                worker.cancel()
            context.destroy(linger=0)
            plain.destroy(linger=0)
            self.arenas.close()
            mark_process_dead(os.getpid())
            log.info("engine %s stopped", self.incarnation)

    @staticmethod
    async def _until_stopped(stop, parent_pid: int) -> None:
        terminated = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, terminated.set)
        while not (stop.is_set() or terminated.is_set() or os.getppid() != parent_pid):
            await asyncio.sleep(0.1)

    def listen(self, router: zmq.Socket) -> SocketReader:
        """Take the frontends' messages from `router` on the running loop from now on."""
        self.reader = SocketReader(router, lambda frames: self._take_all(frames, router))
        self.reader.start()
        return self.reader

    def _take_all(self, frames: list[bytes], router) -> None:
        """A frontend's message: its identity, then its loop turn's Submits, Cancels and Controls as one frame
        (service/engine/messages.py)."""
        frontend = frames[0]
        for payload in frames[1:]:
            try:
                messages = self.codec.to_engine.decode(payload)
            except Exception:  # a message it cannot read (a frontend of another version) must not end the loop
                log.exception("a message from frontend %r could not be read (%d bytes); dropped", frontend,
                              len(payload))
                continue
            for message in messages:
                try:
                    self._take(frontend, message, router)
                except Exception:  # one it cannot take must not cost the others
                    log.exception("a %s from frontend %r could not be taken; dropped", type(message).__name__,
                                  frontend)

    def _take(self, frontend: bytes, message: Submit | Cancel | Control, router) -> None:
        self.work_arrived.set()
        key = (frontend, message.id)
        if isinstance(message, Cancel):
            work = self.running.get(key)
            if work is not None:
                work.cancel()
        elif isinstance(message, Submit):
            self._submit(router, frontend, message)
        else:
            task = asyncio.create_task(self._control(router, frontend, message))
            self.running[key] = task
            task.add_done_callback(lambda _: self.running.pop(key, None))

    def _submit(self, router, frontend: bytes, submit: Submit) -> None:
        """One image: read in place and queued for a batch; its batch's callback answers it (`_finish`). No task
        or coroutine per image: at the engine's ceiling they were most of its time per image
        (docs/results/bench-engine-ceiling.md)."""
        key = (frontend, submit.id)
        try:
            pixels = self.arenas.array(submit.arena, submit.offset, submit.shape, submit.dtype)
            self.running[key] = self.engine.begin_on(
                submit.model, submit.version, pixels, submit.timeout_s, submit.target,
                lambda outcome: self._finish(router, frontend, submit.id, outcome), submit.maps_free,
                budget=BudgetAsk(submit.rung, submit.degradable))
        except ServiceError as e:
            self._answer(router, frontend, failure_for(submit.id, e))
        except Exception as e:  # a bug here must not hang the frontend's request
            log.exception("unexpected error on an engine request")
            self._answer(router, frontend, Failure(submit.id, "inference_failed", f"engine error: {type(e).__name__}"))

    def _finish(self, router, frontend: bytes, id: int, outcome) -> None:
        """An image's answer: its result, or its own error."""
        self.running.pop((frontend, id), None)
        reply: Failure | Result
        if isinstance(outcome, ServiceError):
            reply = failure_for(id, outcome)
        elif isinstance(outcome, asyncio.CancelledError):  # the frontend's client went away; it still waits
            reply = failure_for(id, ClientDisconnected("cancelled by the frontend"))
        elif isinstance(outcome, BaseException):
            log.error("unexpected error on an engine request", exc_info=outcome)
            reply = Failure(id, "inference_failed", f"engine error: {type(outcome).__name__}")
        else:
            reply = Result(id, [Tensor(o.shape, np.ascontiguousarray(o, "<f4").tobytes()) for o in outcome.output],
                           outcome.queue_s, outcome.inference_s, outcome.batch_size, outcome.batch_span,
                           outcome.rung, outcome.reason or "")
        self._answer(router, frontend, reply)

    def _answer(self, router, frontend: bytes, reply: Result | Failure | ControlReply) -> None:
        """Queue `reply` for `frontend`; the queue is sent when the loop's turn ends."""
        if not self.outbox:
            asyncio.get_running_loop().call_soon(self._send_answers)
        self.outbox.setdefault(frontend, []).append(reply)

    def _send_answers(self) -> None:
        """The loop turn's answers, one message of one frame per frontend, sent through the socket's reader. A
        ROUTER never blocks (no high-water mark here) and drops what is addressed to a frontend that is gone."""
        outbox, self.outbox, reader = self.outbox, {}, self.reader
        assert reader is not None, "answers come only to messages `listen` took"
        try:
            for frontend, replies in outbox.items():
                reader.send([frontend, self._encoded(replies)])
        except zmq.ZMQError as e:  # the socket closed (shutting down): nobody hears these answers any more
            log.debug("answers not sent: %s", e)

    def _encoded(self, replies: list[Result | Failure | ControlReply]) -> bytes:
        """A turn's answers as one frame. One that cannot be encoded (a bug) becomes a Failure of its own, so that
        the images answered beside it are not lost with it."""
        try:
            return self.codec.encode(replies)
        except Exception:
            log.exception("a turn's %d answers could not be encoded together; encoding them one by one", len(replies))
        kept: list[Result | Failure | ControlReply] = []
        for reply in replies:
            try:
                self.codec.encode(reply)
                kept.append(reply)
            except Exception:
                kept.append(Failure(reply.id, "internal_error", "the engine's answer could not be encoded"))
        return self.codec.encode(kept)

    async def _control(self, router, frontend: bytes, control: Control) -> None:
        """A repository request: its outcome and the index after it."""
        code = message = ""
        report = {}
        try:
            if control.op == "load":
                await self.engine.load(control.model)
            elif control.op == "unload":
                await self.engine.unload(control.model)
            elif control.op == "shadow":
                report = await self.engine.shadow_report(control.model)
        except ServiceError as e:
            code, message = e.code, str(e)
        except Exception as e:  # a bug here must not hang the frontend's request
            log.exception("unexpected error on a repository request")
            code, message = "internal_error", f"engine error: {type(e).__name__}"
        self._answer(router, frontend, ControlReply(control.id, self.repository_index(), code, message, report))

    def repository_index(self) -> RepositoryIndex:
        registry = self.engine.registry
        rows = [IndexRow(e.name, e.version, e.state, e.reason) for e in registry.index()]
        loaded = [LoadedVersion(n, v, view.info.to_metadata(), view.info.opset, view.batching, view.shadow,
                                view.version_policy, view.serving)
                  for (n, v), view in registry.table.versions.items() if view.info is not None]
        return RepositoryIndex(registry.generation, rows, loaded, dict(registry.model_problems))

    async def _publish(self, publisher) -> None:
        """The status every STATUS_INTERVAL_S while there is work, and once more after it (the emptied queue);
        idle, every IDLE_STATUS_INTERVAL_S, or STATUS_INTERVAL_S after work arrives. A frontend counts what it
        sent since the last status as queued, so work arriving must bring the next one soon."""
        idle_interval_s = min(IDLE_STATUS_INTERVAL_S, self.engine.settings.engine_timeout_s / 4)
        was_active = True
        while True:
            active = bool(self.running) or self.work_arrived.is_set()
            self.work_arrived.clear()  # what arrives from now on cuts an idle wait short
            await self._send_status(publisher)
            if active or was_active:
                await asyncio.sleep(STATUS_INTERVAL_S)
            else:
                try:
                    await asyncio.wait_for(self.work_arrived.wait(), idle_interval_s)
                    # not at once: the work that woke it is starting now, and a status wakes every HTTP worker
                    await asyncio.sleep(STATUS_INTERVAL_S)
                except TimeoutError:
                    pass
            was_active = active

    def _status_soon(self, publisher) -> None:
        """A version changed state: tell the frontends now, not at the next interval."""
        task = asyncio.ensure_future(self._send_status(publisher))
        task.add_done_callback(lambda done: done.cancelled() or done.exception())

    async def _send_status(self, publisher) -> None:
        engine, registry = self.engine, self.engine.registry
        queues = [VersionQueue(n, v, r.served.batcher.queued, r.served.batcher.queued_cost,
                               r.served.batcher.seconds_per_cost)
                  for (n, v), r in registry.records.items() if r.served is not None and r.served.batcher]
        status = EngineStatus(self.incarnation, engine.ready and not self.stopping, engine.provider,
                              registry.generation, queues, time.time())
        await publisher.send(self.codec.encode(status))
