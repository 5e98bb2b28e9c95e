"""What one process lets in, decided before the work it would cause: requests in flight, queued work against the
deadline, and decoded pixels held at once.

Plain asyncio, no HTTP: the routes turn `Overloaded` into 429 through the error table.
"""
from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import gc
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from vitserve.service.core.errors import ClientDisconnected, DeadlineExceeded, NotReady, Overloaded, ServiceError


@dataclass(frozen=True)
class Deadline:
    """The moment (time.perf_counter) a request's work must be done by."""

    at: float

    @classmethod
    def after(cls, seconds: float) -> "Deadline":
        return cls(time.perf_counter() + seconds)

    def remaining(self) -> float:
        return max(0.0, self.at - time.perf_counter())


class StopSignal:
    """Set once, when the server's drain runs out: every request still waiting is answered 503 at once. A request
    waits on it through a callback (`subscribe`), not a task of its own: the guard around a request's work is on
    the path of every answer, and with a task for the work and one waiting on this signal it cost 36.8 us a call
    on uvloop, the work alone 2 us (docs/tail-latency.md)."""

    def __init__(self):
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
    cancelling, why = task.cancelling(), []

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


class LoopLag:
    """How late the event loop runs a timer: its backlog. The HTTP side (parsing, routing, encoding) runs on
    the loop, so when it is the bottleneck (a fast model) the loop falls behind before the model's queue
    grows, and every request, refusals included, waits in the socket buffers behind it.

    It looks every `interval_s` while the process has requests in flight, and every `idle_interval_s` while it
    has none: an idle server woke 200 times a second per HTTP worker for it (with the engine's statuses, 7% of a
    core on two cores doing nothing). The first admitted request brings the next look forward."""

    def __init__(self, interval_s: float = 0.005, idle_interval_s: float = 0.1):
        self.interval_s, self.idle_interval_s = interval_s, idle_interval_s
        self.lag_s = 0.0  # a moving average
        self.busy = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._schedule()

    def set_busy(self, busy: bool) -> None:
        """Whether the process has requests in flight: the interval to look at."""
        if busy == self.busy:
            return
        self.busy = busy
        if busy and self._handle is not None:  # the idle look may be up to idle_interval_s away
            self._handle.cancel()
            self._schedule()

    def next_look_in(self) -> float | None:
        """Seconds until it next looks (None when stopped)."""
        return None if self._handle is None else self._handle.when() - self._loop.time()

    def _schedule(self) -> None:
        due = self._loop.time() + (self.interval_s if self.busy else self.idle_interval_s)
        self._handle = self._loop.call_at(due, self._tick, due)

    def _tick(self, due: float) -> None:
        self.lag_s = 0.7 * self.lag_s + 0.3 * max(0.0, self._loop.time() - due)
        self._schedule()

    def stop(self) -> None:
        if self._handle:
            self._handle.cancel()
            self._handle = None


class CompletionRate:
    """Requests a process finishes per second while it has work: a moving average of the gap between one
    completion and the next (or the start of a busy spell), so idle time does not count as capacity."""

    SMOOTHING = 0.05  # a batch finishes many requests at once: average the gaps over a few batches

    def __init__(self):
        self.gap_s: float | None = None
        self._since: float | None = None

    def busy(self, now: float) -> None:
        """A request was admitted; the clock runs from now if none was in flight."""
        if self._since is None:
            self._since = now

    def completed(self, now: float, still_busy: bool) -> None:
        if self._since is not None:
            gap = now - self._since
            self.gap_s = gap if self.gap_s is None else (1 - self.SMOOTHING) * self.gap_s + self.SMOOTHING * gap
        self._since = now if still_busy else None

    def per_s(self) -> float | None:
        return 1 / self.gap_s if self.gap_s else None


class Admission:
    """Counts admitted requests and refuses one at once when the process is full: `max_in_flight` requests
    already admitted, an event loop running more than `max_loop_lag_s` behind, or more queued work than the
    request's deadline allows (`predicted_wait_s` measures the batcher's queue by its observed speed, as
    BentoML's dispatcher does).

    Once it is full, more requests arrive than the process finishes, and a queue as long as `max_in_flight` only
    makes everyone wait: the admitted behind it, the refused behind the event loop's work for it, and the first
    request after the load behind what is left of it. So for `SHEDDING_HOLD_S` after it refuses one for being
    full it admits only the requests it finishes in `overload_queue_s` (its completion rate times that, at least
    `min_shed_in_flight`: what fills the engine's batches, since a smaller batch costs more per image and an
    engine starved of batches is goodput lost, docs/reliability.md). A closed loop of clients within
    `max_in_flight` never fills it, and a refusal for the
    loop's lag (a passing stall) does not lower the limit."""

    SHEDDING_HOLD_S = 1.0
    MIN_IN_FLIGHT = 2  # one running, one waiting to join the next batch

    def __init__(self, max_in_flight: int, max_loop_lag_s: float | None = None,
                 overload_queue_s: float | None = None, clock=time.perf_counter, min_shed_in_flight: int = 2):
        self.clock = clock
        self.min_shed_in_flight = max(self.MIN_IN_FLIGHT, min_shed_in_flight)
        self.max_in_flight = max_in_flight
        self.in_flight = 0
        self.loop_lag = LoopLag()
        self.max_loop_lag_s = max_loop_lag_s
        self.overload_queue_s = overload_queue_s
        self.completions = CompletionRate()
        self.shedding_until = 0.0

    def in_flight_limit(self, now: float) -> int:
        """Requests admitted at once now: `max_in_flight`, or while shedding what it finishes in
        `overload_queue_s`."""
        rate = self.completions.per_s()
        if self.overload_queue_s is None or now >= self.shedding_until or rate is None:
            return self.max_in_flight
        return min(self.max_in_flight, max(self.min_shed_in_flight, math.ceil(rate * self.overload_queue_s)))

    def refusal(self, predicted_wait_s: float, timeout_s: float) -> Overloaded | None:
        """Why a request arriving now would be refused, or None."""
        now = self.clock()
        limit = self.in_flight_limit(now)
        if self.in_flight >= limit:
            # A full process is overload, not a passing stall (a late timer): shed until it has not been for a while
            self.shedding_until = now + self.SHEDDING_HOLD_S
            why = "the limit of this process" if limit == self.max_in_flight else "all it can finish soon under load"
            return Overloaded(f"{self.in_flight} requests in flight, {why}; retry later")
        if self.max_loop_lag_s is not None and self.loop_lag.lag_s > self.max_loop_lag_s:
            return Overloaded(f"the server is {self.loop_lag.lag_s * 1000:.0f} ms behind on its connections; "
                              f"retry later")
        if predicted_wait_s > timeout_s:
            return Overloaded(f"the queued work needs about {predicted_wait_s:.2f} s, more than this server waits "
                              f"({timeout_s:.2f} s); retry later")
        return None

    def enter(self, predicted_wait_s: float, timeout_s: float) -> None:
        refused = self.refusal(predicted_wait_s, timeout_s)
        if refused:
            raise refused
        self.in_flight += 1
        self.completions.busy(self.clock())
        self.loop_lag.set_busy(True)

    def leave(self) -> None:
        self.in_flight -= 1
        self.completions.completed(self.clock(), still_busy=self.in_flight > 0)
        self.loop_lag.set_busy(self.in_flight > 0)


# glibc's malloc raises its mmap threshold after each large free (up to 32 MiB), so after one huge image its
# later large buffers come from the heap and stay with the process when freed (measured: 118 MB idle, 295 MB
# after a few 40-megapixel images). A fixed threshold keeps large buffers mmapped: freed, they go back at once.
# Not glibc's own 128 KiB: every buffer above the threshold is a fresh mapping whose pages fault in on first
# touch, and an ordinary image's buffers (224x224 RGB: 150 KB decoded, 600 KB as float32) paid that on every
# request: ViT-S/16 served one client 12.3 ms over the raw session at 128 KiB, 7.8-8.5 ms at 4 MiB
# (docs/tail-latency.md).
_M_MMAP_THRESHOLD = -3
LARGE_ALLOCATION_BYTES = 4 * 2**20


def return_large_frees_to_the_os() -> bool:
    """Fix glibc's mmap threshold (no-op elsewhere); True when it was set."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, LARGE_ALLOCATION_BYTES))
    except (OSError, AttributeError):  # not glibc
        return False


def give_freed_memory_back() -> bool:
    """Return the heap's free pages to the OS (glibc's malloc_trim; no-op elsewhere): after a model version is
    unloaded its freed weights sit in the heap's arenas, and a process that loads and unloads versions all day
    would hold its peak forever. True when it was done."""
    libc = _libc()
    return bool(libc.malloc_trim(0)) if libc is not None and hasattr(libc, "malloc_trim") else False


@functools.cache
def _libc():
    """glibc, loaded once (each CDLL is a new handle); None elsewhere."""
    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


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
        self.count += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.count -= 1
            if self.count == 0:
                self._idle.set()

    async def released(self, timeout_s: float) -> bool:
        """Wait (up to `timeout_s`) until no one holds it; whether that happened."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except asyncio.TimeoutError:
            return False
        return True


class PixelBudget:
    """A budget of decoded pixels held by requests at once, so a few huge images cannot take the memory: a
    request waits (within its deadline) until its pixels fit. Event-loop thread only."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._waiters: list[asyncio.Future] = []

    async def acquire(self, pixels: int) -> int:
        """Reserve `pixels` (at most the whole budget); returns what was reserved, to give to `release`."""
        pixels = min(pixels, self.capacity)
        while self.used + pixels > self.capacity:
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)
        self.used += pixels
        return pixels

    def release(self, pixels: int) -> None:
        self.used -= pixels
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each re-checks whether it fits now
            if not waiter.done():
                waiter.set_result(None)


def freeze_startup_objects() -> None:
    """Leave what a process holds once it is up out of every later garbage collection (`gc.freeze`).

    A worker starts with about 75,000 objects the collector tracks (FastAPI's routes, pydantic's validators,
    numpy, ONNX Runtime's bindings, the model's metadata), and each full collection walked them all again while
    every request in the process waited: 40 ms here, the worst of a worker's tail at 32 clients. Frozen, they
    are still freed by reference counting; only a cycle among them waits for `collect_cycles`. Collected first,
    so that startup's own garbage is not kept for good."""
    gc.collect()
    gc.freeze()


def collect_cycles() -> None:
    """A full collection that reaches the frozen objects too (an unloaded model's last references may sit in
    cycles among them), then what survives frozen again."""
    gc.unfreeze()
    gc.collect()
    gc.freeze()
