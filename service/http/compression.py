"""Answers compressed for clients that ask (`Accept-Encoding: gzip` or `deflate`), where Triton compresses its own.

Which answers: on the Open Inference Protocol's paths (/v2) only a successful inference answer, as Triton (in its
src/http_server.h only `CreateInferRequest`, and the generate extension, read `GetResponseCompressionType`; every
other handler, and every error, answers plain). tritonclient's asyncio client needs exactly that: aiohttp sends
`Accept-Encoding: gzip, deflate` on every request, but the client reads bodies raw (`auto_decompress=False`) and
inflates only an infer answer, by its `Content-Encoding`; a compressed statistics, metadata or error body would
reach it as gzip bytes. vitserve's own routes (/v1, the metrics, the docs) compress any successful answer: their
clients (browsers, curl, httpx, requests, Prometheus) inflate what HTTP says they asked for.

A pure ASGI middleware around the app's routes and the infer lane (service/http/infer_lane.py), so that /v2's infer
answers (JSON, and binary tensors) and /v1's JSON are compressed alike. Starlette's GZipMiddleware does gzip
only and reads `Accept-Encoding` without its q-values (`gzip;q=0` still gets gzip), so this one is ours, over
the standard library's zlib.

What it costs is bounded whatever a client sends: only an answer between `compress_min_bytes` (smaller ones
gain less than the headers cost) and `compress_max_bytes` is compressed, at zlib's fastest level, and one over
`OFF_LOOP_BYTES` on a worker thread (zlib lets go of the GIL), so the event loop never waits on it. An answer is
as large as its request asked for, so a client gets at most that bounded work per answer it could get anyway.

Binary tensors: the whole body (JSON header and tensors) is compressed and `Inference-Header-Content-Length` still
gives the length of the uncompressed JSON, as Triton sends it and tritonclient reads it (it inflates the body,
then splits it there). `deflate` is the zlib format (RFC 9110, section 8.4.1.2), which tritonclient inflates with
`zlib.decompress`. Streamed answers (the web page's files) and answers already encoded pass as they are.
"""
from __future__ import annotations

import zlib

import anyio.to_thread

from vitserve.service.http import inference_routes
from vitserve.service.schemas.paths import is_protocol_path

CODINGS = ("gzip", "deflate")  # in the order preferred when a client weighs both the same
_WINDOW_BITS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # gzip's header and trailer; zlib's
LEVEL = 1  # zlib's fastest: on the service's JSON answers 4x faster than its default for 8% more bytes
OFF_LOOP_BYTES = 64 * 1024  # larger answers are compressed on a worker thread
_NOT_WORTH_IT = (b"image/", b"video/", b"audio/", b"application/zip", b"application/gzip")  # compressed already


def chosen_coding(accept_encoding: str | None) -> str | None:
    """gzip or deflate, whichever `Accept-Encoding` weighs highest (q-values; `*` stands for those not named),
    if above 0 and not below `identity` named explicitly; None: send the answer as it is."""
    if not accept_encoding:
        return None
    weights = {}
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        weights[coding.strip().lower()] = _quality(params)
    anything = weights.get("*", 0.0)
    best = max(CODINGS, key=lambda c: weights.get(c, anything))  # max keeps the first of equals: gzip
    weight = weights.get(best, anything)
    return best if weight > 0 and weight >= weights.get("identity", 0.0) else None


def _quality(params: str) -> float:
    """The `q` of one coding's parameters (1 when absent); a malformed one counts as 0: not that coding."""
    for param in params.split(";"):
        name, _, value = param.partition("=")
        if name.strip().lower() == "q":
            try:
                q = float(value.strip())
            except ValueError:
                return 0.0
            return q if 0.0 <= q <= 1.0 else 0.0
    return 1.0


def compressible_path(path: str) -> bool:
    """Whether answers on `path` may be compressed: on /v2 an inference route's only, any on vitserve's own."""
    if is_protocol_path(path):  # the protocol's (or no route's: an error, never compressed)
        found = inference_routes.match(path)
        return found is not None and found[0].protocol
    return True


def compress(body: bytes, coding: str) -> bytes:
    compressor = zlib.compressobj(LEVEL, zlib.DEFLATED, _WINDOW_BITS[coding])
    return compressor.compress(body) + compressor.flush()


class ResponseCompression:
    """The middleware: `min_bytes` and `max_bytes` from the settings (`max_bytes` 0: never compress)."""

    def __init__(self, app, min_bytes: int, max_bytes: int):
        self.app, self.min_bytes, self.max_bytes = app, min_bytes, max_bytes

    async def __call__(self, scope, receive, send):
        coding = None
        if scope["type"] == "http" and scope["method"] != "HEAD" and self.max_bytes:
            coding = chosen_coding(_header(scope, b"accept-encoding"))
            if coding is not None and not compressible_path(scope["path"]):  # a client that asks, on /v2
                coding = None
        if coding is None:  # the common case costs one header lookup
            return await self.app(scope, receive, send)
        held = None  # the answer's start, until its body shows whether it is compressed

        async def send_compressed(message):
            nonlocal held
            if message["type"] == "http.response.start":
                held = message
                return
            if held is None:  # the start went out already: a streamed answer's later pieces
                return await send(message)
            start, held = held, None
            body = message.get("body", b"")
            if message.get("more_body", False) or not self._worth_it(start, body):
                await send(start)
                return await send(message)
            packed = compress(body, coding) if len(body) <= OFF_LOOP_BYTES else \
                await anyio.to_thread.run_sync(compress, body, coding)
            await send({**start, "headers": _compressed_headers(start["headers"], coding, len(packed))})
            await send({**message, "body": packed})

        await self.app(scope, receive, send_compressed)

    def _worth_it(self, start: dict, body: bytes) -> bool:
        # an error never: Triton's are plain, and tritonclient (both clients) reads an error's body raw
        if not self.min_bytes <= len(body) <= self.max_bytes or start["status"] != 200:
            return False
        headers = dict(start.get("headers", ()))
        return b"content-encoding" not in headers and not headers.get(b"content-type", b"").startswith(_NOT_WORTH_IT)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def _compressed_headers(headers, coding: str, length: int) -> list[tuple[bytes, bytes]]:
    """The answer's headers with its new length and coding; caches told that the answer depends on the ask."""
    kept = [(k, v) for k, v in headers if k not in (b"content-length", b"vary")]
    vary = [v for k, v in headers if k == b"vary"]
    return kept + [(b"content-encoding", coding.encode()), (b"content-length", b"%d" % length),
                   (b"vary", b", ".join([*vary, b"Accept-Encoding"]))]
