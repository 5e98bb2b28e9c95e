"""What one process lets in, decided before the work it would cause: requests in flight, queued work against the
deadline, and decoded pixels held at once.

Plain asyncio, no HTTP: the routes turn `Overloaded` into 429 through the error table.
"""
from __future__ import annotations

import asyncio
import math
import threading
import time

from vitserve.service.ground.errors import Overloaded


class LoopLag:
    """How late the event loop runs a timer: its backlog. The HTTP side (parsing, routing, encoding) runs on
    the loop, so when it is the bottleneck (a fast model) the loop falls behind before the model's queue
    grows, and every request, refusals included, waits in the socket buffers behind it.

    It looks every `interval_s` while the process has requests in flight, and every `idle_interval_s` while it
    has none: an idle server woke 200 times a second per HTTP worker for it (with the engine's statuses, 7% of a
    core on two cores doing nothing). The first admitted request brings the next look forward. Busy, every 20 ms,
    not 5: a worker whose requests wait on a slow model (ViT-S/16: half a second a batch) is busy all the time and
    woke 200 times a second for this alone, most of its event loop's CPU per answer. A loop that is behind runs the
    look late by its backlog whatever the interval, so the backlog still shows within a few looks."""

    def __init__(self, interval_s: float = 0.02, idle_interval_s: float = 0.1):
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
        if self._handle is None or self._loop is None:
            return None
        return self._handle.when() - self._loop.time()

    def _schedule(self) -> None:
        assert self._loop is not None, "start() sets the loop before the first look"
        due = self._loop.time() + (self.interval_s if self.busy else self.idle_interval_s)
        self._handle = self._loop.call_at(due, self._tick, due)

    def _tick(self, due: float) -> None:
        assert self._loop is not None, "only a scheduled look ticks"
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

    def __init__(self) -> None:
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
        # the transport's open connections (HTTP's, counted by its protocol: service/http/connection.py); with one
        # connection and one request in flight, no other client of this process is between its requests
        self.connections = 0
        self.loop_lag = LoopLag()
        self.max_loop_lag_s = max_loop_lag_s
        self.overload_queue_s = overload_queue_s
        self.completions = CompletionRate()
        self.shedding_until = 0.0

    def count_connection(self, change: int) -> None:
        """A transport's connection opened (+1) or closed (-1)."""
        self.connections += change

    @property
    def alone(self) -> bool:
        """Whether a request in flight is the only one and its client the only one connected: nobody waits behind
        work it does on the event loop. Not a request beside others, nor one of several clients between their
        requests (eight clients on two workers: the first back from a batch would hold the loop while the others'
        requests wait unread)."""
        return self.in_flight <= 1 and self.connections <= 1

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


class PixelBudget:
    """A budget of decoded pixels held by requests at once, so a few huge images cannot take the memory: a
    request waits (within its deadline) until its pixels fit. `acquire` and `release` on the event loop's thread;
    `try_reserve` from any thread (a decode thread reserving its image's pixels without a trip back to the loop)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._waiters: list[asyncio.Future] = []
        self._lock = threading.Lock()  # `used` is changed from the decode threads too (try_reserve)

    def try_reserve(self, pixels: int) -> int | None:
        """Reserve `pixels` now if they fit and nobody waits for room (who would otherwise wait behind every image
        reserved this way); the amount reserved, or None."""
        pixels = min(pixels, self.capacity)
        with self._lock:
            if self._waiters or self.used + pixels > self.capacity:
                return None
            self.used += pixels
            return pixels

    async def acquire(self, pixels: int) -> int:
        """Reserve `pixels` (at most the whole budget); returns what was reserved, to give to `release`."""
        pixels = min(pixels, self.capacity)
        while True:
            with self._lock:
                if self.used + pixels <= self.capacity:
                    self.used += pixels
                    return pixels
            waiter = asyncio.get_running_loop().create_future()
            self._waiters.append(waiter)
            try:
                await waiter
            finally:
                if waiter in self._waiters:
                    self._waiters.remove(waiter)

    def release(self, pixels: int) -> None:
        with self._lock:
            self.used -= pixels
        waiters, self._waiters = self._waiters, []
        for waiter in waiters:  # each re-checks whether it fits now
            if not waiter.done():
                waiter.set_result(None)
