"""A request's time and the server's stop: the deadline its work must meet, the signal that ends every wait when
the drain runs out, the one wait that honours both (and the client going away), and a count of holders to wait for.

Plain asyncio, no transport: each transport turns the errors raised here into its own answer.
"""
from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from dataclasses import dataclass

from vitserve.service.ground.errors import ClientDisconnected, DeadlineExceeded, NotReady, ServiceError


@dataclass(frozen=True)
class Deadline:
    """The moment (time.perf_counter) a request's work must be done by."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.perf_counter() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.perf_counter())


class StopSignal:
    """Set once, when the server's drain runs out: every request still waiting is answered 503 at once. A request
    waits on it through a callback (`subscribe`), not a task of its own: the guard around a request's work is on
    the path of every answer, and with a task for the work and one waiting on this signal it cost 36.8 us a call
    on uvloop, the work alone 2 us (docs/tail-latency.md)."""

    def __init__(self) -> None:
        self._set = False
        self._callbacks: set[Callable[[], None]] = set()

    def is_set(self) -> bool:
        return self._set

    def set(self) -> None:
        if self._set:
            return
        self._set = True
        callbacks, self._callbacks = self._callbacks, set()
        for callback in callbacks:
            callback()

    def subscribe(self, callback: Callable[[], None]) -> Callable[[], None]:
        """Call `callback` when the signal is set; returns what unsubscribes it."""
        self._callbacks.add(callback)
        return functools.partial(self._callbacks.discard, callback)


async def run_within(awaitable, deadline: Deadline, stop: StopSignal, *, disconnected=None,
                     on_timeout: ServiceError | None = None):
    """Await `awaitable` in this task, cancelling it (which drops its queued work) when the deadline passes
    (DeadlineExceeded, or `on_timeout`), the `disconnected` awaitable completes (ClientDisconnected) or the
    server's drain runs out (`stop` set: NotReady).

    A timer and a callback cancel this task, as `asyncio.timeout` does; only the disconnect watch is a task
    (`StopSignal` says what the tasks cost, twice per request)."""
    if stop.is_set():
        _discard(awaitable)
        raise NotReady("the server shut down before this request finished")
    task, loop = asyncio.current_task(), asyncio.get_running_loop()
    assert task is not None, "run_within is awaited in a task: the one the timer cancels"
    cancelling = task.cancelling()
    why: list[str] = []  # the first reason this task was interrupted

    def interrupt(reason: str) -> None:
        if not why:
            why.append(reason)
            task.cancel()

    timer = loop.call_later(deadline.remaining(), interrupt, "deadline")
    unsubscribe = stop.subscribe(functools.partial(interrupt, "stop"))
    watcher = None
    if disconnected is not None:
        watcher = asyncio.ensure_future(disconnected)
        watcher.add_done_callback(functools.partial(_on_disconnect, interrupt))
    try:
        result = await awaitable
    except asyncio.CancelledError:
        if why and task.uncancel() <= cancelling:  # ours alone: else someone else cancelled this task too
            raise _interruption(why[0], on_timeout) from None
        raise
    finally:
        timer.cancel()
        unsubscribe()
        if watcher is not None:
            watcher.cancel()
    if why:  # the work swallowed our cancellation and finished anyway: its answer stands
        task.uncancel()
    return result


def _on_disconnect(interrupt, watcher: asyncio.Future) -> None:
    if watcher.cancelled():
        return
    watcher.exception()  # retrieved: a watch that failed still means the client is gone
    interrupt("disconnect")


def _interruption(reason: str, on_timeout: ServiceError | None) -> ServiceError:
    if reason == "stop":
        return NotReady("the server shut down before this request finished")
    if reason == "disconnect":
        return ClientDisconnected("client disconnected before its answer was ready")
    return on_timeout or DeadlineExceeded("the request's deadline passed before its answer was ready")


def _discard(awaitable) -> None:
    """An awaitable that will never be awaited: closed (a coroutine) or cancelled (a future), without a warning."""
    if asyncio.iscoroutine(awaitable):
        awaitable.close()
    elif asyncio.isfuture(awaitable):
        awaitable.cancel()


class InUse:
    """How many hold something now, and a wait until none does: a model version's admitted requests before it
    closes (service/engine/served_model.py), a multiplexed model's requests before Ray evicts it
    (service/ray_serve.py)."""

    def __init__(self):
        self.count = 0
        self._idle = asyncio.Event()
        self._idle.set()

    @contextlib.asynccontextmanager
    async def held(self):
        self.hold()
        try:
            yield
        finally:
            self.release()

    def hold(self) -> None:
        """One more holder; each `hold` is ended by one `release` (`held` pairs them around a block)."""
        self.count += 1
        self._idle.clear()

    def release(self) -> None:
        self.count -= 1
        if self.count == 0:
            self._idle.set()

    async def released(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until no one holds it; whether that happened."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
