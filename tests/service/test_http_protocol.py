"""The HTTP connection's limits (service/http/connection.py) against a real uvicorn over TCP, with raw sockets:
what a hostile or slow client sends, byte by byte, and what well-behaved clients beside it still get.

A tiny FastAPI app stands in for the service, so that each test controls how the app reads its body. Time
bounds are generous on the slow side (the machine may be busy) and exact on the early side (a timer never
fires before its time)."""
from __future__ import annotations

import asyncio
import json
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import ExitStack, contextmanager

import pytest
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from starlette.requests import ClientDisconnect

from vitserve.service.http.connection import HttpLimits, LimitedHttpToolsFactory, uvicorn_http_options
from vitserve.service.ground.settings import Settings
from service_fixtures import PATIENCE_S, REPO, RawConnection, free_port, trickling, wait_until

LIMITS = HttpLimits(max_header_bytes=16 * 1024, max_headers=100, header_timeout_s=1.0, body_timeout_s=1.0)
KEEP_ALIVE_S = 1
LATE_S = 5.0  # how late past its time a timer may fire on a busy machine before the test calls it hung


def make_app() -> FastAPI:
    app = FastAPI()
    app.state.disconnects = 0

    @app.get("/")
    async def hello():
        return {"hello": "world"}

    @app.post("/echo")
    async def echo(request: Request, wait_s: float = 0.0):
        await asyncio.sleep(wait_s)  # busy elsewhere before it reads the body
        try:
            body = await request.body()
        except ClientDisconnect:
            request.app.state.disconnects += 1
            return Response(status_code=499)
        return {"bytes": len(body)}

    @app.post("/refuse")
    async def refuse():  # answers from the headers alone, as a 413 or 429 does: uvicorn discards the body
        return JSONResponse({"error": {"code": "payload_too_large", "message": "no"}}, status_code=413)

    return app


@contextmanager
def uvicorn_in_thread(app, limits: HttpLimits):
    """uvicorn with the limited protocol on a free port, in a thread; yields (port, server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(app, http=LimitedHttpToolsFactory(limits), log_level="warning",
                            timeout_keep_alive=KEEP_ALIVE_S, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn started")
        yield sock.getsockname()[1], server
    finally:
        server.should_exit = True
        thread.join(PATIENCE_S)
        sock.close()


@pytest.fixture(scope="module")
def served():
    app = make_app()
    with uvicorn_in_thread(app, LIMITS) as (port, server):
        yield port, app


def get(path: str = "/", *headers: bytes) -> bytes:
    return b"GET " + path.encode() + b" HTTP/1.1\r\nHost: test\r\n" + b"".join(h + b"\r\n" for h in headers) + b"\r\n"


def post_head(path: str, length: int) -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: test\r\nContent-Length: {length}\r\n\r\n".encode()


def assert_refused(client: RawConnection, status: int, code: str) -> None:
    answer = client.response()
    assert (answer.status, answer.error_code()) == (status, code)
    assert answer.headers["connection"] == "close"
    assert client.closed()


# sizes

def test_a_head_within_the_limits_is_served(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(get("/", b"X-Big: " + b"a" * 15_000, *(b"X-%d: 1" % i for i in range(98))))  # 100 fields
        answer = client.response()
    assert (answer.status, json.loads(answer.body)) == (200, {"hello": "world"})


def test_a_20_kb_header_gets_431_and_the_connection_closes(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(get("/", b"X-Big: " + b"a" * 20_000))
        assert_refused(client, 431, "headers_too_large")


def test_more_header_fields_than_the_limit_get_431(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(get("/", *(b"X-%d: 1" % i for i in range(100))))  # with Host: 101
        assert_refused(client, 431, "headers_too_large")


def test_a_20_kb_request_line_gets_414(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(get("/" + "a" * 20_000))
        assert_refused(client, 414, "uri_too_long")


@pytest.mark.slow
def test_a_header_that_never_ends_is_refused_once_past_the_limit():
    """httptools buffers a header until it ends: the bytes are counted as they arrive, read after read."""
    sent, piece, most = 0, b"a" * 8192, 256 * 1024
    with uvicorn_in_thread(make_app(), HttpLimits(header_timeout_s=60)) as (port, _), RawConnection(port) as client:
        client.send(b"GET / HTTP/1.1\r\nHost: test\r\nX-Endless: ")
        while sent < most and not client.answered(0.2):  # a pause per piece: the server reads them one by one
            client.send(piece)
            sent += len(piece)
        assert sent < most, f"no answer after {sent} bytes of one header"
        assert_refused(client, 431, "headers_too_large")


# time

@pytest.mark.slow
def test_a_silent_connection_gets_408_after_the_header_timeout(served):
    port, _ = served
    start = time.monotonic()
    with RawConnection(port) as client:
        assert_refused(client, 408, "request_timeout")
    assert LIMITS.header_timeout_s * 0.9 <= time.monotonic() - start < LIMITS.header_timeout_s + LATE_S


@pytest.mark.slow
def test_a_trickled_head_gets_408_after_the_header_timeout(served):
    """One byte every 0.4 s: each byte is progress, but the whole head has one deadline."""
    port, _ = served
    head = get("/")
    start = time.monotonic()
    with RawConnection(port) as client:
        for i in range(len(head)):
            if client.answered(0.4) or not client.send(head[i:i + 1]):
                break
        assert_refused(client, 408, "request_timeout")
        assert LIMITS.header_timeout_s * 0.9 <= time.monotonic() - start < LIMITS.header_timeout_s + LATE_S


@pytest.mark.slow
def test_a_stalled_body_gets_408_and_the_app_sees_a_disconnect(served):
    port, app = served
    disconnects = app.state.disconnects
    with RawConnection(port) as client:
        client.send(post_head("/echo", 100) + b"x" * 10)
        stalled = time.monotonic()
        assert_refused(client, 408, "request_timeout")
        assert LIMITS.body_timeout_s * 0.9 <= time.monotonic() - stalled < LIMITS.body_timeout_s + LATE_S
    wait_until(lambda: app.state.disconnects == disconnects + 1, "the app's receive returned http.disconnect")


@pytest.mark.slow
def test_a_body_in_pieces_closer_than_the_body_timeout_is_read_whole(served):
    """The body timeout is a gap between pieces, not a deadline for the whole body."""
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head("/echo", 6))
        for _ in range(6):  # 6 x 0.25 s: longer than the timeout in all, never one gap as long
            time.sleep(LIMITS.body_timeout_s / 4)
            client.send(b"x")
        answer = client.response()
    assert (answer.status, json.loads(answer.body)) == (200, {"bytes": 6})


@pytest.mark.slow
def test_the_body_timeout_runs_only_while_the_app_waits_for_the_body(served):
    """A 1 MB body fills uvicorn's buffer, which then stops reading, while the app is busy for twice the body
    timeout: the client, held back, is not the slow one."""
    port, _ = served
    body = b"x" * 2**20
    with RawConnection(port) as client:
        client.send(post_head(f"/echo?wait_s={2 * LIMITS.body_timeout_s}", len(body)) + body)
        answer = client.response()
    assert (answer.status, json.loads(answer.body)) == (200, {"bytes": len(body)})


@pytest.mark.slow
def test_the_rest_of_a_body_answered_early_has_the_body_timeout_too(served):
    """The app answered from the headers; uvicorn discards the body as it comes (each piece cancels its
    keep-alive timer), and a client that stops sending it is disconnected (the answer is out: no 408)."""
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head("/refuse", 100_000) + b"x" * 10)
        assert client.response().status == 413
        for _ in range(3):
            time.sleep(LIMITS.body_timeout_s / 4)
            assert client.send(b"x" * 10)
        stalled = time.monotonic()
        assert client.closed()
    assert LIMITS.body_timeout_s * 0.9 <= time.monotonic() - stalled < LIMITS.body_timeout_s + LATE_S


@pytest.mark.slow
def test_a_connection_idle_after_a_discarded_body_meets_the_keep_alive_timeout(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head("/refuse", 10))
        assert client.response().status == 413
        client.send(b"x" * 10)  # the body, after the answer: discarded
        idle = time.monotonic()
        assert client.closed()
    assert KEEP_ALIVE_S * 0.9 <= time.monotonic() - idle < KEEP_ALIVE_S + LATE_S


# uvicorn's own flow, unchanged

def test_keep_alive_requests_share_one_connection(served):
    port, _ = served
    with RawConnection(port) as client:
        for i in range(5):
            client.send(get("/") if i % 2 else post_head("/echo", i) + b"x" * i)
            answer = client.response()
            assert answer.status == 200 and "connection" not in answer.headers
            assert json.loads(answer.body) == ({"hello": "world"} if i % 2 else {"bytes": i})
        assert not client.answered(0.1)  # still open


def test_a_connection_closes_after_max_requests_per_connection_and_the_next_one_is_served():
    """As nginx's keepalive_requests: the third answer says Connection: close and the connection closes after it,
    so that a client behind a connection-level balancer lands again; a new connection is served as ever."""
    with uvicorn_in_thread(make_app(), HttpLimits(max_requests_per_connection=3)) as (port, _):
        with RawConnection(port) as client:
            for i in range(3):
                client.send(post_head("/echo", 2) + b"ab" if i == 1 else get("/"))
                answer = client.response()
                assert answer.status == 200
                assert answer.headers.get("connection") == ("close" if i == 2 else None)
            assert client.closed()
        with RawConnection(port) as client:
            client.send(get("/"))
            assert client.response().status == 200


def test_pipelined_requests_are_answered_in_order(served):
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head("/echo?wait_s=0.2", 3) + b"abc" + get("/") + post_head("/echo", 2) + b"de")
        answers = [client.response() for _ in range(3)]
    assert [(a.status, json.loads(a.body)) for a in answers] == [
        (200, {"bytes": 3}), (200, {"hello": "world"}), (200, {"bytes": 2})]


def test_a_read_of_many_pipelined_requests_ending_in_a_head_is_not_an_oversized_head(served):
    """One read can hold many whole pipelined requests and then the start of another's head, whose share of that
    read is unknown: it is not counted against the head's limit. (It was, all of it, where the read began between
    requests: a pipelining client whose read passed `max_header_bytes` got its connection closed after the
    requests before it.)"""
    port, _ = served
    whole = 2 * LIMITS.max_header_bytes // len(get("/"))  # twice the limit in whole requests
    with RawConnection(port) as client:
        client.send(get("/") * whole + get("/")[:10])
        time.sleep(0.2)  # the head's start in the read that brought the whole requests, its rest in another
        client.send(get("/")[10:])
        answers = [client.response() for _ in range(whole + 1)]
    assert [a.status for a in answers] == [200] * (whole + 1)
    assert json.loads(answers[-1].body) == {"hello": "world"}


@pytest.mark.slow
def test_a_head_trickled_behind_a_running_request_times_out_after_its_answer(served):
    """The head's clock starts over while an earlier request is being answered (uvicorn reads no further
    meanwhile); the earlier answer comes whole, then the 408."""
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head(f"/echo?wait_s={1.5 * LIMITS.header_timeout_s}", 1) + b"x" + b"GET / HTTP/1.1\r\nHo")
        first = client.response()
        assert (first.status, json.loads(first.body)) == (200, {"bytes": 1})
        assert_refused(client, 408, "request_timeout")


def test_an_oversized_head_behind_a_running_request_closes_after_its_answer(served):
    """No 431 in the middle of an earlier answer: that answer finishes, says Connection: close, and the
    connection closes."""
    port, _ = served
    with RawConnection(port) as client:
        client.send(post_head("/echo?wait_s=0.5", 1) + b"x" + get("/", b"X-Big: " + b"a" * 20_000))
        first = client.response()
        assert (first.status, first.headers["connection"], json.loads(first.body)) == (200, "close", {"bytes": 1})
        assert client.closed()


def test_trickling_clients_do_not_slow_a_normal_request():
    """50 connections trickle their heads or bodies (limits long enough to keep them all open); a normal
    request on a new connection is answered in far less than a second, however many of them."""
    patient = HttpLimits(header_timeout_s=60, body_timeout_s=60)
    with uvicorn_in_thread(make_app(), patient) as (port, server), ExitStack() as stack:
        tricklers = [stack.enter_context(RawConnection(port)) for _ in range(50)]
        for i, client in enumerate(tricklers):
            client.send(b"GET / HTTP/1.1\r\nHost: test\r\nX-Slow: " if i % 2 else post_head("/echo", 1000))
        with trickling(tricklers, b"a"):
            wait_until(lambda: len(server.server_state.connections) >= 50, "50 trickling connections open")
            for _ in range(5):
                start = time.monotonic()
                with RawConnection(port) as client:
                    client.send(get("/"))
                    assert client.response().status == 200
                assert time.monotonic() - start < 1.0
            assert len(server.server_state.connections) >= 50  # the tricklers are all still there


# wiring

def test_the_options_travel_to_worker_processes():
    """uvicorn pickles its Config into each worker; the protocol factory pickles, and compares by value."""
    settings = Settings(max_header_bytes=4096, max_headers=20, header_timeout_s=3, body_timeout_s=4,
                        max_requests_per_connection=1000)
    options = uvicorn_http_options(settings)
    assert options == uvicorn_http_options(settings)
    assert options == {"http": LimitedHttpToolsFactory(HttpLimits(4096, 20, 3.0, 4.0, 1000))}
    assert pickle.loads(pickle.dumps(options)) == options


@pytest.mark.slow
def test_two_worker_processes_enforce_the_limits(tmp_path):
    (tmp_path / "tiny_asgi.py").write_text(textwrap.dedent("""
        async def app(scope, receive, send):
            if scope["type"] == "http":
                await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
                await send({"type": "http.response.body", "body": b"ok"})
        """))
    port = free_port()
    script = textwrap.dedent(f"""
        import sys, uvicorn
        from vitserve.service.http.connection import HttpLimits, LimitedHttpToolsFactory
        sys.path.insert(0, {str(tmp_path)!r})
        uvicorn.run("tiny_asgi:app", port={port}, workers=2, log_level="warning",
                    http=LimitedHttpToolsFactory(HttpLimits(max_header_bytes=4096)))
        """)
    process = subprocess.Popen([sys.executable, "-c", script], cwd=REPO, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT)

    def serving() -> bool:
        assert process.poll() is None, process.stdout.read().decode()
        try:
            with RawConnection(port) as client:
                client.send(get("/"))
                return client.response().status == 200
        except OSError:
            return False

    try:
        wait_until(serving, "two uvicorn workers serving")
        with RawConnection(port) as client:
            client.send(get("/", b"X-Big: " + b"a" * 5000))
            assert_refused(client, 431, "headers_too_large")
    finally:
        process.terminate()
        process.wait(PATIENCE_S)


def test_overload_is_refused_from_the_request_line_without_the_app_and_the_connection_stays_open():
    """The app's admission (lifespan state `early_refusal`) refuses from the request line alone; the refusal is
    answered without routing to the app, the unread body is discarded and the connection serves on."""
    from contextlib import asynccontextmanager

    from vitserve.service.ground.errors import Overloaded

    overloaded, asked = threading.Event(), []

    def early_refusal(method: bytes, path: str):
        asked.append((method, path))
        return (Overloaded("busy"), 7) if overloaded.is_set() and path == "/echo" else None

    @asynccontextmanager
    async def lifespan(app):
        yield {"early_refusal": early_refusal}

    app = make_app()
    app.router.lifespan_context = lifespan
    calls = []
    app.middleware("http")(lambda request, call_next: calls.append(request.url.path) or call_next(request))
    with uvicorn_in_thread(app, LIMITS) as (port, _), RawConnection(port) as client:
        overloaded.set()
        client.send(post_head("/echo?x=1", 5) + b"hello")
        refused = client.response()
        assert refused.status == 429 and refused.error_code() == "overloaded"
        assert refused.headers["retry-after"] == "7" and refused.headers.get("connection") != "close"
        overloaded.clear()
        client.send(post_head("/echo", 5) + b"hello")  # the same connection
        answer = client.response()
        assert answer.status == 200 and json.loads(answer.body) == {"bytes": 5}
    assert asked == [(b"POST", "/echo"), (b"POST", "/echo")] and calls == ["/echo"]


def _refusing_protocol(refusing: list[bool], **options):
    """The limited protocol made by hand, as uvicorn makes one per connection, whose app state refuses POSTs to
    /v1/classify while `refusing[0]`; and the app it serves otherwise (200 "ok")."""
    from vitserve.service.ground.errors import Overloaded

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    def early_refusal(method: bytes, path: str):
        return (Overloaded("busy"), 3) if refusing[0] and path == "/v1/classify" else None

    config = uvicorn.Config(app, http="httptools", log_level="info", lifespan="off",
                            timeout_keep_alive=KEEP_ALIVE_S, **options)
    config.load()
    return LimitedHttpToolsFactory(LIMITS)(config, uvicorn.server.ServerState(), {"early_refusal": early_refusal},
                                           asyncio.get_running_loop())


@pytest.mark.parametrize("access_log", [True, False])
@pytest.mark.slow
def test_a_refusal_is_written_in_the_read_that_brought_its_head(access_log):
    """uvicorn would run the refusal in a task, a loop turn later, behind the admitted requests' work: the 429 is
    in the client's socket as soon as the protocol has read the request, with no turn of the loop between (and
    in the access log as uvicorn writes it). The refused request's body is discarded, the connection serves the
    next requests, and no second keep-alive timer closes it while it works (the answer and the body's end came
    in the same read)."""
    import logging

    class Lines(logging.Handler):
        def __init__(self):
            super().__init__()
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    access = logging.getLogger("uvicorn.access")  # uvicorn's: it does not propagate
    lines = Lines()
    refusing = [True]

    async def scenario() -> tuple[bytes, list[bytes]]:
        loop = asyncio.get_running_loop()
        protocol = _refusing_protocol(refusing, access_log=access_log)
        access.addHandler(lines)  # after uvicorn's Config has set up its loggers
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        try:
            await loop.connect_accepted_socket(lambda: protocol, ours)
            protocol.data_received(post_head("/v1/classify?top_k=2", 5) + b"hello")  # by hand: no loop turn after
            refused = theirs.recv(65536)
            refusing[0] = False
            answers = []
            for _ in range(4):  # past the keep-alive time, busy all along
                theirs.sendall(post_head("/v1/classify", 5) + b"hello")
                answers.append(await asyncio.wait_for(loop.sock_recv(theirs, 65536), PATIENCE_S))
                await asyncio.sleep(KEEP_ALIVE_S / 2)
            return refused, answers
        finally:
            theirs.close()
            protocol.transport.close()

    try:
        refused, answers = asyncio.run(scenario())
    finally:
        access.removeHandler(lines)
    head, _, body = refused.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 429 ") and b"\r\nretry-after: 3" in head and b"connection: close" not in head
    assert json.loads(body) == {"error": {"code": "overloaded", "message": "busy"}}
    assert b"\r\ncontent-length: %d\r\n" % len(body) in head
    assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 4 and answers[-1].endswith(b"ok")
    logged = [line for line in lines.lines if "429" in line]
    assert logged == ([' - "POST /v1/classify?top_k=2 HTTP/1.1" 429'] if access_log else [])


def test_a_refusal_waits_for_uvicorn_s_task_where_the_client_does_not_read_or_uvicorn_may_answer_503():
    """Two cases keep uvicorn's own path: a client that does not read its answers (uvicorn's send waits for it,
    so refusals cannot pile up in the server) and uvicorn's connection limit (its task may answer 503 instead).
    The refusal comes a loop turn later, the same 429; the last request a connection may carry closes it."""
    refusing = [True]

    async def refused_after_a_turn(protocol, paused: bool) -> tuple[bytes, bytes]:
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        theirs.setblocking(False)
        try:
            await loop.connect_accepted_socket(lambda: protocol, ours)
            if paused:
                protocol.flow.pause_writing()  # as the transport does when its buffer is full
            protocol.data_received(post_head("/v1/classify", 0))
            with pytest.raises(BlockingIOError):
                theirs.recv(65536)  # nothing yet: the task has not run
            if paused:
                protocol.flow.resume_writing()
            return (await asyncio.wait_for(loop.sock_recv(theirs, 65536), PATIENCE_S),
                    await asyncio.wait_for(loop.sock_recv(theirs, 65536), PATIENCE_S) if protocol.cycle.keep_alive
                    is False else b"")
        finally:
            theirs.close()
            protocol.transport.close()

    async def scenario():
        not_reading = await refused_after_a_turn(_refusing_protocol(refusing), paused=True)
        limited = await refused_after_a_turn(_refusing_protocol(refusing, limit_concurrency=100), paused=False)
        return not_reading, limited

    for answer, _ in asyncio.run(scenario()):
        assert answer.startswith(b"HTTP/1.1 429 ") and b"retry-after: 3" in answer and answer.endswith(b'"busy"}}')


def test_the_last_request_a_connection_may_carry_is_refused_with_connection_close():
    refusing = [True]

    async def scenario() -> bytes:
        loop = asyncio.get_running_loop()
        protocol = _refusing_protocol(refusing)
        protocol.limits = HttpLimits(max_requests_per_connection=1)
        ours, theirs = socket.socketpair()
        try:
            await loop.connect_accepted_socket(lambda: protocol, ours)
            protocol.data_received(post_head("/v1/classify", 0))
            answer = await asyncio.wait_for(loop.sock_recv(theirs, 65536), PATIENCE_S)
            assert await asyncio.wait_for(loop.sock_recv(theirs, 65536), PATIENCE_S) == b""  # closed
            return answer
        finally:
            theirs.close()

    answer = asyncio.run(scenario())
    assert answer.startswith(b"HTTP/1.1 429 ") and b"\r\nconnection: close\r\n" in answer


@pytest.mark.slow
def test_a_client_pipelining_faster_than_it_is_answered_is_read_no_further_than_its_queue():
    """uvicorn pauses reading when a request arrives pipelined behind another, but resumed it at every answer and
    whenever the app read: a client pipelining faster than it is answered, and never reading its answers, grew
    the server's queue without bound (218,590 requests in 6 s against an app taking 3 ms each). Now reading
    waits until the queue is answered: the queue holds at most what a few reads brought."""
    made = []

    class Recording(LimitedHttpToolsFactory):
        def __call__(self, *args, **kwargs):
            made.append(super().__call__(*args, **kwargs))
            return made[-1]

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await receive()
        await asyncio.sleep(0.003)  # the model
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"600")]})
        await send({"type": "http.response.body", "body": b"x" * 600})

    body = b"y" * 300
    request = f"POST /x HTTP/1.1\r\nHost: t\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, http=Recording(LIMITS), log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_until(lambda: server.started, "uvicorn started")
        with socket.create_connection(sock.getsockname()) as client:
            client.settimeout(0.2)
            sent, started, deepest = 0, time.monotonic(), 0
            while time.monotonic() - started < 3.0:
                try:
                    client.sendall(request * 50)
                    sent += 50
                except TimeoutError:
                    pass  # the server reads no further: the client's sends stop in the kernel's buffers
                deepest = max(deepest, len(made[0].pipeline)) if made else 0
    finally:
        server.should_exit = True
        thread.join(PATIENCE_S)
        sock.close()
    # What the client got into the socket is the kernel's buffers' business (their sizes vary by machine); what
    # the server queued is ours: at most a handful of uvloop's 256 KiB reads (about 700 here; 98,962 before).
    reads_worth = 4 * 256 * 1024 // len(request)
    assert sent and deepest <= reads_worth, (deepest, sent)


def test_the_app_counts_the_connections_open_in_its_process():
    """Lifespan state `count_connection` (admission's: a request alone on its process's only connection may run its
    work on the event loop) hears each connection open and close, once each, a refused one's too."""
    from contextlib import asynccontextmanager

    from vitserve.service.usecases.admission import Admission

    admission = Admission(max_in_flight=10)

    @asynccontextmanager
    async def lifespan(app):
        yield {"count_connection": admission.count_connection}

    app = make_app()
    app.router.lifespan_context = lifespan
    with uvicorn_in_thread(app, LIMITS) as (port, _):
        with RawConnection(port) as first:
            first.send(get("/"))
            assert first.response().status == 200 and admission.connections == 1 and admission.alone
            with RawConnection(port) as second, RawConnection(port) as refused:
                second.send(get("/"))
                refused.send(get("/" + "a" * 20_000))
                assert second.response().status == 200 and refused.response().status == 414
                wait_until(lambda: admission.connections == 2, "the refused connection closed")
                assert not admission.alone
            wait_until(lambda: admission.connections == 1, "the second closed")
        wait_until(lambda: admission.connections == 0, "all closed")
