"""A plain ZeroMQ socket read from the running asyncio loop through its file descriptor (`ZMQ_FD`, libzmq's
documented way to join another event loop), for the two sockets every image crosses, the engine's ROUTER
(service/engine/server.py) and each frontend's DEALER (service/engine/remote.py), and for the frontend's SUB that
hears the engine's status every 20 ms while it works.

Not pyzmq's asyncio sockets: they make a future, a poller event and a few enum operations per message in each
direction, which were most of what an engine process spent on a lone image (docs/latency-budget.md). The owner sends
through the reader too (`send`: a plain non-blocking call), so that no send goes without the read after it.

ZeroMQ's descriptor is edge-triggered: it fires when the socket's state changes, and any call on the socket (a read
of its events, a receive, a send) may take that change without it firing again. So the reader takes messages until
the socket says it holds none, coming back on the next loop turn after `DRAIN_AT_ONCE` (the loop's other work runs
between), and reads again after every send.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import cast

import zmq

log = logging.getLogger("vitserve.engine")

# Messages taken in one go: enough to empty a socket under load, few enough that the loop's other work (answers,
# the batcher) runs between rounds.
DRAIN_AT_ONCE = 256
# libzmq's flags as plain ints: pyzmq's enum members cost a Python-level operator per test
_EVENTS, _POLLIN = int(zmq.EVENTS), int(zmq.POLLIN)


class SocketReader:
    """Calls `on_message(frames)` for every message `socket` receives, on the running loop, from `start()` to
    `stop()`, and sends on it (`send`). An exception from `on_message` is logged and its message dropped."""

    def __init__(self, socket: zmq.Socket, on_message: Callable[[list[bytes]], None]):
        self.socket, self.on_message = socket, on_message
        self._descriptor: int | None = None
        self._scheduled = False  # a read is due on the loop's next turn

    def start(self) -> None:
        self._descriptor = self.socket.fileno()  # ZMQ_FD
        asyncio.get_running_loop().add_reader(self._descriptor, self._read)
        self._read()  # what arrived before the reader was added raised no edge it will see

    def stop(self) -> None:
        if self._descriptor is not None:
            asyncio.get_running_loop().remove_reader(self._descriptor)
            self._descriptor = None

    def send(self, frames: list[bytes]) -> None:
        """Send one message without blocking (raising what pyzmq raises: `zmq.Again` when it cannot now), then read
        the socket again on the next turn, in case the send took the edge."""
        self.socket.send_multipart(frames, zmq.NOBLOCK)
        self._read_soon()

    def _read_soon(self) -> None:
        if not self._scheduled and self._descriptor is not None:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._read)

    def _read(self) -> None:
        self._scheduled = False
        if self._descriptor is None:  # stopped meanwhile
            return
        socket = self.socket
        try:
            for _ in range(DRAIN_AT_ONCE):
                if not cast(int, socket.getsockopt(_EVENTS)) & _POLLIN:
                    return
                frames = socket.recv_multipart(zmq.NOBLOCK)
                try:
                    self.on_message(frames)
                except Exception:  # one message that cannot be taken must not stop every later one
                    log.exception("a message of %d frame(s) could not be taken; dropped", len(frames))
        except zmq.Again:  # the events said a message was there; none was: wait for the next edge
            return
        except zmq.ZMQError as e:  # the socket closed (shutting down)
            log.debug("a socket read from the loop is gone: %s", e)
            return
        self._read_soon()  # more may be waiting: come back on the next turn
