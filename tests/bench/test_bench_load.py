"""The load generator: test images, the HTTP client against a scripted loopback server, the closed loop."""
from __future__ import annotations

import asyncio
import io

import pytest
from PIL import Image

from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import HttpConnection, closed_loop, encode_request, make_images


def test_make_images_are_distinct_and_shaped_per_kind():
    pngs = make_images("png", (28, 20), channels=1, count=3)
    jpegs = make_images("jpeg", (28, 20), channels=1, count=2)
    assert len(set(pngs)) == 3 and len(set(jpegs)) == 2
    with Image.open(io.BytesIO(pngs[0])) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "L", (20, 28))  # size is (height, width)
    with Image.open(io.BytesIO(jpegs[0])) as img:
        assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (640, 480))
    assert make_images("png", (8, 8), 3, 2, seed=5) == make_images("png", (8, 8), 3, 2, seed=5)


def test_encode_request_is_a_complete_http_message():
    assert encode_request("POST", "/v1/classify", b"abc", "image/png") == (
        b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n"
        b"Content-Type: image/png\r\n\r\nabc")


def test_closed_loop_client_reads_fixed_length_and_chunked_answers():
    """A loopback server answering by Content-Length, then chunked, then 500: all parsed, errors counted."""
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
               b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"]
    received = []

    async def handle(reader, writer):
        for i in range(10**6):
            try:
                await reader.readuntil(b"\r\n\r\n")
                received.append(await reader.readexactly(4))
            except asyncio.IncompleteReadError:
                break
            writer.write(answers[i % 3])
            await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_server(handle, LOOPBACK, 0)
        port = server.sockets[0].getsockname()[1]
        conn = HttpConnection(LOOPBACK, port)
        request = encode_request("POST", "/", b"body")
        got = [await conn.request(request) for _ in range(3)]
        await conn.close()
        result = await closed_loop(LOOPBACK, port, [request], concurrency=2, warmup_s=0.0, duration_s=0.3,
                                   timeout_s=5)
        server.close()
        return got, result

    got, result = asyncio.run(scenario())
    assert got == [(200, b"ok"), (200, b"ok"), (500, b"")]
    assert set(received) == {b"body"}
    assert result["concurrency"] == 2 and result["completed"] > 0 and result["errors"]["500"] > 0
    assert result["window_s"] >= 0.3
    assert result["requests_per_s"] == pytest.approx(result["completed"] / result["window_s"])
