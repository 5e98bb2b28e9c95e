"""uvicorn's httptools protocol with limits on what a client may send before the app sees its request.

uvicorn (0.54) bounds neither the request head nor the time a client takes to send it: httptools buffers a
header of any length (a 100 MB one stalled every client for 11-15 s), and a client that trickles its head or
body holds its connection forever. `LimitedHttpToolsProtocol` adds, per connection:

- a size limit: a request line and headers over `max_header_bytes` (414 when the request line alone is), or more
  than `max_headers` fields, get 431. A head still incomplete is measured as its bytes arrive, so a connection
  never buffers much more than the limit (one read at most);
- a head deadline: the request line and headers must all arrive within `header_timeout_s` of the connection
  opening (its first request) or of their first byte (later ones), else 408;
- a body gap: while the app waits for body bytes, a client silent for `body_timeout_s` gets 408. The same gap
  holds while uvicorn discards the rest of a body that the app answered without reading (a 413 or 429 decided
  from the headers); the answer is out by then, so the connection is just closed;
- a request count (`max_requests_per_connection`, off by default): the last answer says `Connection: close`, as
  nginx's `keepalive_requests`, so that a keep-alive client behind a connection-level balancer lands anew;
- a bounded pipeline: while requests wait pipelined behind the one being answered, nothing more is read
  (`_PipelineBoundFlow`), so a client that sends faster than it is answered meets TCP's backpressure.

A refusal is one `{"error": {"code", "message"}}` response with `Connection: close`, then the connection closes.
Time is kept by one event-loop timer per connection that is re-armed only when it lapses (`_expect_bytes`): no
threads, no work per byte, and no timer made or cancelled per request.

**The one adapter to uvicorn's internals.** uvicorn has no public way to hold these limits: its options bound the
head only under h11 (`h11_max_incomplete_event_size`), and neither a head deadline nor a body gap exists (asked
since 2018: uvicorn issue 157, "--timeout-request-start", "--timeout-request-complete", still open; PRs 1684 and
2019, header limits for httptools, closed unmerged; other projects do the same as this module, e.g.
xorbitsai/inference PR 5213). ASGI middleware cannot help: it runs once the head has been parsed. So this module
is the only place that reaches inside uvicorn, and `UVICORN_SURFACE` lists all it touches; tests/service/
test_uvicorn_contract.py checks that surface against the installed uvicorn (and that it is the pinned version),
and tests/service/test_http_protocol.py checks the behaviour over real sockets. Lifting the pin is: move it,
run those two, and adjust this module where the surface moved.

`uvicorn_http_options(settings)` gives the `uvicorn.run` options. uvicorn pickles its `Config` into worker
processes, so the protocol is a module-level class made by a picklable factory, not a class built on the fly.
Without httptools (a dependency, but not every platform has a wheel) uvicorn's h11 protocol serves instead, with
only h11's own head limit (`h11_max_incomplete_event_size`: answered 400, and only for a head that arrives in
several reads), no timeouts and no `max_requests_per_connection`.
"""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from vitserve.service.ground.errors import HeadersTooLarge, MalformedRequest, RequestTimeout, ServiceError, UriTooLong
from vitserve.service.ground.settings import Settings
from vitserve.service.http.errors import error_response, status_code
from vitserve.service.schemas.paths import PROTOCOL_ROOT, is_protocol_path

if TYPE_CHECKING:  # checked as it runs where httptools is installed: without it, nothing below is instantiated
    import httptools
    from uvicorn.protocols.http.flow_control import FlowControl
    from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
    from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
else:
    try:
        import httptools
        from uvicorn.protocols.http.flow_control import FlowControl
        from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol, RequestResponseCycle
        from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string
    except ImportError:  # pragma: no cover - see `uvicorn_http_options`
        httptools = None
        HttpToolsProtocol = RequestResponseCycle = FlowControl = object  # never instantiated: uvicorn runs h11


# Everything this module uses of uvicorn beyond its public options (see the docstring): the protocol's methods
# it overrides or calls, the attributes it reads or sets, and the request cycle's. Checked by
# tests/service/test_uvicorn_contract.py against the installed uvicorn.
UVICORN_SURFACE = {
    "module": ("STATUS_LINE", "HttpToolsProtocol", "RequestResponseCycle"),
    "utils": ("get_client_addr", "get_path_with_query_string"),
    "flow_control": ("FlowControl",),
    "flow_methods": ("__init__", "resume_reading", "pause_reading"),
    "protocol_methods": ("__init__", "connection_made", "connection_lost", "data_received", "on_message_begin",
                         "on_header", "on_headers_complete", "on_body", "on_message_complete", "on_response_complete",
                         "_unset_keepalive_if_required", "_should_upgrade", "handle_websocket_upgrade",
                         "_unsupported_upgrade_warning", "send_400_response", "timeout_keep_alive_handler"),
    "protocol_attributes": ("parser", "cycle", "app", "app_state", "url", "headers", "transport", "loop",
                            "timeout_keep_alive", "timeout_keep_alive_task", "server_state", "logger",
                            "limit_concurrency", "access_log", "access_logger", "flow", "pipeline"),
    "cycle_methods": ("receive",),
    "cycle_attributes": ("more_body", "body", "response_complete", "response_started", "disconnected",
                         "message_event", "keep_alive", "scope"),
}


@dataclass(frozen=True)
class HttpLimits:
    """What one client may send before the app sees its request (see the module's docstring)."""

    max_header_bytes: int = 16 * 1024
    max_headers: int = 100
    header_timeout_s: float = 10.0
    body_timeout_s: float = 10.0
    max_requests_per_connection: int = 0  # 0: a connection serves requests until its client closes it

    @classmethod
    def from_settings(cls, settings: Settings) -> HttpLimits:
        return cls(settings.max_header_bytes, settings.max_headers, settings.header_timeout_s,
                   settings.body_timeout_s, settings.max_requests_per_connection)


@dataclass(frozen=True)
class LimitedHttpToolsFactory:
    """uvicorn's `http=`: it calls this as it would a protocol class. A value, so that it pickles into worker
    processes and two option dicts built from the same settings compare equal."""

    limits: HttpLimits

    def __call__(self, config, server_state, app_state, _loop=None) -> LimitedHttpToolsProtocol:
        return LimitedHttpToolsProtocol(config, server_state, app_state, _loop, limits=self.limits)


def uvicorn_http_options(settings: Settings) -> dict:
    """The HTTP protocol options of `uvicorn.run` for these settings."""
    if httptools is None:  # pragma: no cover
        return {"http": "h11", "h11_max_incomplete_event_size": settings.max_header_bytes}
    return {"http": LimitedHttpToolsFactory(HttpLimits.from_settings(settings))}


# Chunk sizes and CRLFs between pieces of a chunked body: bytes the parser reads but does not deliver as body.
_CHUNK_FRAMING_SLACK = 4096

# Where a connection is in its current request (plain strings: this is checked several times per request).
_IDLE, _HEAD, _BODY = "between requests", "reading a head", "reading a body"


class LimitedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's `HttpToolsProtocol` plus `HttpLimits`; everything else is uvicorn's own flow."""

    def __init__(self, config, server_state, app_state, _loop=None, *, limits: HttpLimits):
        super().__init__(config, server_state, app_state, _loop)
        self.limits = limits
        self._phase = _IDLE
        self._read_bytes = 0  # of the read being parsed
        self._head_arrived = 0  # bytes read while the head was incomplete: a bound on what the parser holds
        self._head_began_in_read = False
        self._message_ended_in_read = False
        self._body_bytes = 0  # delivered by on_body, ever
        self._unparsed_in_body = 0  # bytes read since the last body byte that no on_body delivered: trailers
        self._trailer_bytes = 0
        self._refused = False  # the parser has stopped: input is dropped until the connection closes
        self._requests = 0  # begun on this connection
        # the one wait on the client at a time (head, body, or the rest of a body already answered)
        self._deadline: float | None = None
        self._on_timeout: Callable[[], None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._count_connection: Callable[[int], None] | None = None

    # the connection

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.flow = _PipelineBoundFlow(transport, self.pipeline)  # before any request cycle takes it
        self._expect_bytes(self.limits.header_timeout_s, self._head_timed_out)  # a silent client times out too
        # admission's count of the process's connections (lifespan state `count_connection`): whether a request
        # is its process's only client's
        self._count_connection = self.app_state.get("count_connection")
        if self._count_connection is not None:
            self._count_connection(1)

    def connection_lost(self, exc) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._count_connection is not None:
            self._count_connection(-1)
            self._count_connection = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        """uvicorn's own, plus the refusals the parser callbacks raise and the byte count of an incomplete head."""
        if self._refused:
            return
        self._read_bytes = len(data)
        self._head_began_in_read = self._message_ended_in_read = False
        self._unset_keepalive_if_required()
        body_before = self._body_bytes
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return
        except httptools.HttpParserError as e:
            if isinstance(e.__context__, ServiceError):  # raised by a parser callback below
                self._refuse(e.__context__)
            else:
                self.send_400_response(f"invalid HTTP request: {e}")
            return
        # httptools holds a header's bytes until the header ends, so a huge one is counted as it arrives. A read
        # that also ended an earlier message holds an unknown share of this head: it is left out (one read). That
        # earlier message may have begun in this read too: a pipelining client's read holds many whole requests.
        if self._phase is _HEAD and not (self._message_ended_in_read and self._head_began_in_read):
            self._head_arrived += len(data)
            if self._head_arrived > self.limits.max_header_bytes:
                self._refuse(HeadersTooLarge(self._too_large_message()))
        elif self._phase is _BODY:
            # Trailer fields after a chunked body are held by the parser like a head's: on_header checks each
            # one as it ends; this bounds one that never ends. Counted from the last read that brought body bytes,
            # which may also hold the head (at most max_header_bytes) and chunk framing (a few bytes).
            delivered = self._body_bytes - body_before
            unparsed = len(data) - delivered
            self._unparsed_in_body = unparsed if delivered else self._unparsed_in_body + unparsed
            if self._unparsed_in_body > 2 * self.limits.max_header_bytes + _CHUNK_FRAMING_SLACK:
                self._refuse(HeadersTooLarge(f"trailer fields exceed {self.limits.max_header_bytes} bytes"))

    # parser callbacks: a limit raises, which stops the parser, and data_received answers

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._phase = _HEAD
        self._head_arrived = 0
        self._head_began_in_read = True
        self._unset_keepalive_if_required()  # armed when an earlier body's discarded rest ended in this read
        if self._on_timeout != self._head_timed_out:  # a first request keeps the clock from connection_made
            self._expect_bytes(self.limits.header_timeout_s, self._head_timed_out)

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._phase is _BODY:  # a trailer field: it joins the head's fields, within the same limits
            self._trailer_bytes += len(name) + len(value) + 4
            if len(self.headers) >= self.limits.max_headers:
                raise HeadersTooLarge(f"more than {self.limits.max_headers} header and trailer fields")
            if self._head_size() + self._trailer_bytes > self.limits.max_header_bytes:
                raise HeadersTooLarge(f"the request line, headers and trailers exceed {self.limits.max_header_bytes} "
                                      f"bytes")
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        if len(self.headers) > self.limits.max_headers:
            raise HeadersTooLarge(f"more than {self.limits.max_headers} header fields")
        if not self._head_began_in_read or self._read_bytes > self.limits.max_header_bytes:
            self._check_head_size()  # else the whole head came in one read no longer than the limit
        refusal = self._overload_refusal()
        self._phase = _BODY
        self._unparsed_in_body = self._trailer_bytes = 0
        self._bytes_came(self._head_timed_out)
        earlier, app = self.cycle, self.app
        # uvicorn runs the app in a task: a refusal's, too. Where nothing else can answer first (uvicorn's own
        # 503 at its connection limit) and the client reads its answers, the protocol writes the 429 itself, in
        # this read's callback, and uvicorn's task finds it sent. A client that does not read gets uvicorn's
        # send, which waits for it: its refusals do not pile up in the server.
        at_once = refusal is not None and self.limit_concurrency is None and not self.flow.write_paused
        if refusal is not None:  # this request runs the refusal instead of the app (uvicorn discards its body)
            self.app = _answered if at_once else refusal.asgi
        try:
            super().on_headers_complete()
        finally:
            self.app = app
        if self.cycle is not earlier:  # else the request is upgrading (websockets): no cycle of ours
            timed = self.cycle
            timed.__class__ = _BodyTimedCycle
            assert isinstance(timed, _BodyTimedCycle)  # the class just set, for the checker
            timed.protocol = self
            self._requests += 1
            if self._requests == self.limits.max_requests_per_connection:
                self.cycle.keep_alive = False  # uvicorn adds `Connection: close` to the answer and closes after it
            if at_once:
                assert refusal is not None  # at_once is about a refusal, for the checker
                self._answer_at_once(timed, refusal)

    def _overload_refusal(self) -> _Refusal | None:
        """Under overload a 429 must cost far less than an answer, or the server cannot even refuse at twice its
        capacity: ask the app's admission (lifespan state `early_refusal`) from the request line alone and, if
        it refuses, the answer to send in the app's place (no routing, dependencies or middleware). The
        connection stays open: uvicorn discards the unread body, as for any early answer."""
        early_refusal = self.app_state.get("early_refusal")
        if early_refusal is None or (self.cycle is not None and not self.cycle.response_complete):
            return None
        path = self.url.split(b"?", 1)[0].decode("latin-1")
        refused = early_refusal(self.parser.get_method(), path)
        if refused is None:
            return None
        error, retry_after_s = refused
        return _refusal(is_protocol_path(path), status_code(error), error.code, str(error), retry_after_s)

    def _answer_at_once(self, cycle: RequestResponseCycle, refusal: _Refusal) -> None:
        """What uvicorn's `send` does for a whole answer, in one write: the head and body, the cycle marked
        answered (uvicorn then discards the body), the connection closed if it does not live on, and the
        protocol told (its keep-alive timer, the next pipelined request)."""
        self.transport.write(self._whole_answer(refusal.status, refusal.headers, refusal.body,
                                                close=not cycle.keep_alive))
        if self.access_log:  # the line uvicorn's `send` logs
            scope = cycle.scope
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), scope["method"],
                                    get_path_with_query_string(scope), scope["http_version"], refusal.status)
        cycle.response_started = cycle.response_complete = True
        cycle.message_event.set()
        if not cycle.keep_alive:
            self.transport.close()
        self.on_response_complete()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        # Already answered: uvicorn discards this; the client is still sending, so it gets another gap.
        if self.cycle is not None and self.cycle.response_complete:
            self._expect_bytes(self.limits.body_timeout_s, self._rest_of_body_timed_out)
        super().on_body(body)

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._phase = _IDLE
        self._message_ended_in_read = True
        discarded = self._on_timeout == self._rest_of_body_timed_out
        self._deadline = self._on_timeout = None  # the body is all here: no one waits for it any more
        if discarded:
            # Idle from here, as after any response: data_received disarmed uvicorn's keep-alive timer, which
            # uvicorn armed at the response and would not arm again; or the answer went out in this very read
            # (a refusal written at once) and its timer is still armed: one timer, not two.
            self._unset_keepalive_if_required()
            self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive,
                                                                self.timeout_keep_alive_handler)

    def on_response_complete(self) -> None:
        super().on_response_complete()  # may start a pipelined request: then self.cycle is that one
        if self._phase is _BODY and self.cycle.response_complete and not self.transport.is_closing():
            # answered before its body was read: uvicorn reads and discards the rest
            self._expect_bytes(self.limits.body_timeout_s, self._rest_of_body_timed_out)

    # time limits

    def _expect_bytes(self, within_s: float, on_timeout: Callable[[], None]) -> None:
        """From now the client has `within_s` to send what we wait for; else `on_timeout` runs."""
        self._deadline = self.loop.time() + within_s
        self._on_timeout = on_timeout
        if self._timer is None or self._timer.when() > self._deadline:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)

    def _bytes_came(self, on_timeout: Callable[[], None]) -> None:
        """The wait that `on_timeout` was for is over (if it is still the current one)."""
        if self._on_timeout == on_timeout:
            self._deadline = self._on_timeout = None

    def _check_deadline(self) -> None:
        """The timer: the wait it was armed for may be over, or replaced by a later one."""
        self._timer = None
        if self._deadline is None or self.transport.is_closing():
            return  # no wait now: the next one arms a timer
        if self.loop.time() < self._deadline:
            self._timer = self.loop.call_at(self._deadline, self._check_deadline)
            return
        on_timeout, self._deadline, self._on_timeout = self._on_timeout, None, None
        assert on_timeout is not None, "armed with the deadline"
        on_timeout()

    def _head_timed_out(self) -> None:
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request is still being answered (pipelining; uvicorn stops reading meanwhile): the
            # head's clock starts over.
            self._expect_bytes(self.limits.header_timeout_s, self._head_timed_out)
            return
        self._send_error_and_close(RequestTimeout(
            f"request line and headers not received within {self.limits.header_timeout_s:g} s"))

    def _body_timed_out(self) -> None:
        # the app waits for body bytes: every earlier request has been answered
        self._answer_for_the_app(RequestTimeout(f"no request body bytes for {self.limits.body_timeout_s:g} s"))

    def _answer_for_the_app(self, error: ServiceError) -> None:
        """The request's body cannot be read on: answer `error` in the app's place and close."""
        cycle = self.cycle
        if cycle.response_started:  # the app streams an answer while it reads: too late for an error
            self.transport.close()
        else:
            self._send_error_and_close(error)
        # What connection_lost will do, done now: the app's receive returns http.disconnect, its sends are dropped.
        cycle.disconnected = True
        cycle.message_event.set()

    def _rest_of_body_timed_out(self) -> None:
        self.transport.close()  # its answer is out already

    # sizes and refusals

    def _check_head_size(self) -> None:
        if len(self.url) > self.limits.max_header_bytes:
            raise UriTooLong(f"the request line exceeds {self.limits.max_header_bytes} bytes")
        if self._head_size() > self.limits.max_header_bytes:
            raise HeadersTooLarge(self._too_large_message())

    def _head_size(self) -> int:
        return len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)  # ": ", CRLF

    def _too_large_message(self) -> str:
        return f"the request line and headers exceed {self.limits.max_header_bytes} bytes"

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to input its parser refuses, in the service's JSON shape."""
        self._send_error_and_close(MalformedRequest(msg))

    def _refuse(self, error: ServiceError) -> None:
        self._refused = True
        self._bytes_came(self._head_timed_out)
        if self._phase is _BODY and self.cycle is not None and not self.cycle.response_complete:
            self._answer_for_the_app(error)  # trailers over the limit: the app still waits for the body's end
            return
        if self.cycle is not None and not self.cycle.response_complete:
            # An earlier request is still being answered: let it finish, then close (as uvicorn's shutdown does).
            self.cycle.keep_alive = False
            return
        self._send_error_and_close(error)

    def _whole_answer(self, status: int, header_lines: bytes, body: bytes, close: bool) -> bytes:
        """An answer's bytes as uvicorn's `send` writes them: the status line, uvicorn's default headers (date,
        server), these header lines, `connection: close` if it closes, the body."""
        head = [STATUS_LINE[status], *(name + b": " + value + b"\r\n" for name, value in
                                       self.server_state.default_headers), header_lines]
        if close:
            head.append(b"connection: close\r\n")
        return b"".join(head) + b"\r\n" + body

    def _send_error_and_close(self, error: ServiceError) -> None:
        # The path, when the request line got that far: a /v2 client gets the Open Inference Protocol's shape.
        url = getattr(self, "url", None) or b""
        status, body = _error_json(url.split(b"?", 1)[0].decode("latin-1"), status_code(error), error.code, str(error))
        header_lines = b"content-type: application/json\r\ncontent-length: %d\r\n" % len(body)
        client = "{}:{:d} - ".format(*self.client) if self.client else ""
        self.logger.info("%s%d %s: %s", client, status, error.code, error)
        self._refused = True
        self.transport.write(self._whole_answer(status, header_lines, body, close=True))
        self.transport.close()


def _error_json(path: str, status: int, code: str, message: str) -> tuple[int, bytes]:
    """The status and encoded body of an error answered on `path`, in its protocol's shape."""
    status, body = error_response(path, status, code, message)
    return status, json.dumps(body).encode()


class _PipelineBoundFlow(FlowControl):
    """uvicorn's flow control, except that reading stays paused while requests wait pipelined behind the one
    being answered. uvicorn pauses reading when a pipelined request arrives, but resumes it at every answer and
    whenever an app reads its request or waits for the client's disconnect, with the queue still full: a client
    that pipelines faster than it is answered, or never reads its answers, grew the queue by a read's worth of
    requests each time (218,590 requests and 690 MB in 6 s against an app taking 3 ms each). Reading resumes
    once the last queued request is answered."""

    def __init__(self, transport, pipeline):
        super().__init__(transport)
        self.pipeline = pipeline

    def resume_reading(self) -> None:
        if not self.pipeline:
            super().resume_reading()


@dataclass(frozen=True)
class _Refusal:
    """A 429 decided from the request line: its status, its own headers (and their lines), its body."""

    status: int
    header_list: tuple[tuple[bytes, bytes], ...]
    headers: bytes
    body: bytes

    async def asgi(self, scope, receive, send) -> None:
        """The refusal as an ASGI app, for uvicorn's task where the protocol does not write it itself."""
        await send({"type": "http.response.start", "status": self.status, "headers": list(self.header_list)})
        await send({"type": "http.response.body", "body": self.body})


@lru_cache(maxsize=256)
def _refusal(protocol_path: bool, status: int, code: str, message: str, retry_after_s: int) -> _Refusal:
    """Made once per distinct refusal (most under overload say the same): the JSON and the header lines."""
    status, encoded = _error_json(PROTOCOL_ROOT if protocol_path else "/", status, code, message)
    header_list = ((b"content-type", b"application/json"), (b"content-length", b"%d" % len(encoded)),
                   (b"retry-after", b"%d" % retry_after_s))
    return _Refusal(status, header_list, b"".join(n + b": " + v + b"\r\n" for n, v in header_list), encoded)


async def _answered(scope, receive, send) -> None:
    """uvicorn's task for a request the protocol has answered itself: nothing left to do."""


class _BodyTimedCycle(RequestResponseCycle):
    """uvicorn's request cycle, telling its protocol when the app waits for body bytes not sent yet.

    The protocol turns the cycle uvicorn made into this class (`__class__`) rather than keeping a `receive`
    closure on it: a closure stored on the cycle it calls is a reference cycle, one more per request for the
    garbage collector to find."""

    protocol: LimitedHttpToolsProtocol

    async def receive(self):
        if not self.more_body or self.body or self.response_complete or self.disconnected:
            return await super().receive()  # it returns at once: no wait on the client
        on_timeout = self.protocol._body_timed_out
        self.protocol._expect_bytes(self.protocol.limits.body_timeout_s, on_timeout)
        try:
            return await super().receive()
        finally:
            self.protocol._bytes_came(on_timeout)
