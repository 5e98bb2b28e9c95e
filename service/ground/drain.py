"""A process's shutdown: from SIGTERM (or SIGINT) it stops taking new calls at once, gives the admitted ones
`drain_timeout_s` to finish, then sets `stopping`, which answers whatever still waits 503 (JSON) before the web
server's own graceful timeout (a second later) would cancel it with a bare 500.

Plain asyncio and signals, no transport: HTTP reads `draining` through the state's readiness, gRPC waits on `begun`
to stop its server, the call pipeline waits on `stopping`.
"""
from __future__ import annotations

import asyncio
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from vitserve.service.ground.deadlines import StopSignal

SHUTDOWN_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass
class Drain:
    timeout_s: float
    on_begin: Callable[[], None] = lambda: None  # told once, when the drain begins (the readiness metric)
    draining: bool = False  # not taking new calls
    begun: asyncio.Event = field(default_factory=asyncio.Event)  # for those that wait for it (gRPC's server)
    stopping: StopSignal = field(default_factory=StopSignal)  # the drain ran out: answer 503 now
    _previous_handlers: dict = field(default_factory=dict, repr=False)

    def install_signal_handlers(self) -> None:
        """Chain in front of the server's signal handlers (uvicorn's, which stop accepting and wait for the
        admitted requests): start the drain clock, then let the server do what it does."""
        if threading.current_thread() is not threading.main_thread():
            return  # signal handlers can only be set from the main thread (an embedding app's concern)
        loop = asyncio.get_running_loop()

        def on_signal(number, frame):
            loop.call_soon_threadsafe(self.begin)
            previous = self._previous_handlers.get(number)
            if callable(previous):
                previous(number, frame)

        for number in SHUTDOWN_SIGNALS:
            self._previous_handlers[number] = signal.signal(number, on_signal)

    def begin(self) -> None:
        """Not taking new calls from now on; after `timeout_s` whatever still waits is answered 503."""
        if self.draining:
            return
        self.draining = True
        self.begun.set()
        self.on_begin()
        asyncio.get_running_loop().call_later(self.timeout_s, self.stopping.set)

    def end(self) -> None:
        """Stopped: not taking calls, the server's own signal handlers back in place."""
        self.draining = True
        for number, handler in self._previous_handlers.items():
            signal.signal(number, handler)
        self._previous_handlers.clear()
