"""The load: encoded test images, a minimal HTTP/1.1 client, closed-loop clients, and the paired one-client run.

On a two-core machine every cycle the client spends is taken from the server whichever process it runs in: a
separate client process would not give the server another core, only move the competition. What keeps the client
from distorting the numbers is that it is cheap: a keep-alive HTTP/1.1 client on asyncio streams, each request
encoded once, responses read by Content-Length: about 0.15 ms of CPU per request against about 2 ms for
`httpx.AsyncClient` (measured on the bench machine against the bare endpoint). It runs in the bench process after
the raw session is measured, and every level reports the CPU the server, the client and everything else on the
machine used during the measured window, so contention is shown in the table rather than guessed at.
"""
from __future__ import annotations

import asyncio
import io
import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
from PIL import Image

from vitserve.bench.config import LOOPBACK
from vitserve.bench.measure import latency_summary

# what a request can fail with on the client side: counted as an error of its level, never raised
_REQUEST_ERRORS = (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError)


def make_images(kind: str, size: tuple[int, int], channels: int, count: int, seed: int = 0) -> list[bytes]:
    """`count` distinct encoded images: 'png' at `size` (height, width) with the model's channels, or 'jpeg'
    640x480 RGB.

    Smooth gradients plus noise, so that the codecs do realistic work (pure noise would not compress).
    """
    rng = np.random.default_rng(seed)
    h, w = size if kind == "png" else (480, 640)
    mode = "L" if kind == "png" and channels == 1 else "RGB"
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    images = []
    for _ in range(count):
        fx, fy, phase = rng.uniform(0.5, 4.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi, size=3)
        base = [np.sin(2 * np.pi * (fx * xx / w + fy * yy / h) + p) for p in phase]  # 3 x (h, w)
        rgb = (np.stack(base, -1) * 80 + 128 + rng.normal(0, 12, (h, w, 3))).clip(0, 255).astype(np.uint8)
        img = Image.fromarray(rgb, "RGB").convert(mode)
        buf = io.BytesIO()
        img.save(buf, format="PNG" if kind == "png" else "JPEG", quality=90)
        images.append(buf.getvalue())
    return images


class HttpConnection:
    """One keep-alive HTTP/1.1 connection to a loopback server: the least client work per request."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, payload: bytes) -> tuple[int, bytes]:
        """Send one encoded request; return (status, body)."""
        if self.reader is None or self.writer is None:  # both are set together, on first use
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        reader = self.reader
        self.writer.write(payload)
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        if "content-length" in headers:
            body = await reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked(reader)
        else:
            body = await reader.read()
            await self.close()
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, body

    @staticmethod
    async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
        parts: list[bytes] = []
        for _ in range(1_000_000):  # bounded: a chunked body of a million chunks is not one we sent for
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await reader.readexactly(size + 2)
            if size == 0:
                return b"".join(parts)
            parts.append(data[:-2])
        raise ValueError("chunked body too long")

    async def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            try:
                await self.writer.wait_closed()
            except OSError:
                pass
        self.reader = self.writer = None


def encode_request(method: str, target: str, body: bytes = b"", content_type: str | None = None,
                   headers: dict[str, str] | None = None) -> bytes:
    """A complete HTTP/1.1 request, encoded once so that sending it costs the client nothing more; `headers` are
    sent as given, after the Content-Type."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {LOOPBACK}", f"Content-Length: {len(body)}"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    head += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Window:
    """The measured window of one level: opens after the warm-up, closes when the timer and the count allow."""

    start: float
    end: float | None = None  # None while open
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def open_at(self, now: float) -> bool:
        return self.end is None or now < self.end

    def record(self, sent: float, done: float, status: int | str) -> None:
        if done >= self.start and self.open_at(done):
            self.latencies.append(done - sent) if status == 200 else self.errors.update([str(status)])

    @property
    def answered(self) -> int:
        return len(self.latencies) + sum(self.errors.values())


async def _closed_loop_client(conn: HttpConnection, payloads: list[bytes], first: int, step: int, window: Window,
                              timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        for k in range(first, 10**9, step):  # bounded by the window's end, and by count here
            if not window.open_at(loop.time()):
                break
            sent = loop.time()
            status: int | str  # the HTTP status, or the exception's name when none came
            try:
                status, _ = await asyncio.wait_for(conn.request(payloads[k % len(payloads)]), timeout_s)
            except _REQUEST_ERRORS as e:
                status = type(e).__name__
                await conn.close()
            window.record(sent, loop.time(), status)
    finally:
        await conn.close()


async def closed_loop(host: str, port: int, payloads: list[bytes], concurrency: int, warmup_s: float,
                      duration_s: float, timeout_s: float, on_window=None, min_completed: int = 0,
                      max_duration_s: float | None = None) -> dict:
    """`concurrency` clients, each sending its next request as soon as the previous one is answered.

    Requests completed inside the window (after `warmup_s`, for `duration_s`, stretched up to `max_duration_s`
    until `min_completed` requests are in, so that slow models give more than a handful) are counted; the others
    only warm the server. `on_window(edge)` is awaited at the window's "start" and "end" to take snapshots.
    """
    loop = asyncio.get_running_loop()
    window = Window(loop.time() + warmup_s)
    last_end = window.start + max(duration_s, max_duration_s or 0)

    async def timekeeper() -> float:
        await asyncio.sleep(max(window.start - loop.time(), 0))
        if on_window:
            await on_window("start")
        await asyncio.sleep(duration_s)
        while window.answered < min_completed and loop.time() < last_end:
            await asyncio.sleep(0.05)
        window.end = end = loop.time()
        if on_window:
            await on_window("end")
        return end

    clients = [asyncio.create_task(_closed_loop_client(HttpConnection(host, port), payloads, i, concurrency, window,
                                                       timeout_s)) for i in range(concurrency)]
    end = await timekeeper()
    for task in clients:  # requests still in flight are not counted: hang up (the server drops them unrun)
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    measured = end - window.start
    return {"concurrency": concurrency, "completed": len(window.latencies), "errors": dict(window.errors),
            "window_s": measured, "requests_per_s": len(window.latencies) / measured,
            **latency_summary(window.latencies)}


def settle(port: int, payload: bytes, timeout_s: float) -> None:
    """Wait out the batch a level left running (its clients hung up): one request, answered after it, FIFO."""
    async def probe() -> None:
        conn = HttpConnection(LOOPBACK, port)
        try:
            await asyncio.wait_for(conn.request(payload), timeout_s)
        except _REQUEST_ERRORS:
            pass
        finally:
            await conn.close()

    asyncio.run(probe())


def paired_one_client(run_batch, pixels: np.ndarray, port: int, payload: bytes, pairs: int, gap_s: float,
                      timeout_s: float) -> dict:
    """One client's latency over serving, paired: a raw `run_batch(pixels)` call, then one served request of the same
    image, in turn, `pairs` times (after one warm-up pair).

    Each served latency is compared with the raw call made just before it, so both see the same machine: on a
    virtual machine whose host speed drifts between phases, medians measured minutes apart are not comparable.
    `gap_s` between the halves lets the other side's spinning ONNX Runtime threads go to sleep.
    """
    raw, served = asyncio.run(_alternate(run_batch, pixels, HttpConnection(LOOPBACK, port), payload, pairs, gap_s,
                                         timeout_s))
    overhead_ms = (np.asarray(served) - np.asarray(raw)) * 1000.0
    return {"pairs": len(raw), "raw_p50_ms": latency_summary(raw)["p50_ms"],
            "served_p50_ms": latency_summary(served)["p50_ms"], "overhead_p50_ms": float(np.median(overhead_ms)),
            "overhead_p10_ms": float(np.percentile(overhead_ms, 10)),
            "overhead_p90_ms": float(np.percentile(overhead_ms, 90))}


async def _alternate(run_batch, pixels: np.ndarray, conn: HttpConnection, payload: bytes, pairs: int, gap_s: float,
                     timeout_s: float) -> tuple[list[float], list[float]]:
    """(raw seconds, served seconds) of `pairs` pairs; the first pair only warms both sides."""
    raw, served = [], []
    try:
        for i in range(pairs + 1):
            t = time.perf_counter()
            run_batch(pixels)  # blocks the loop on purpose: nothing else runs in this process meanwhile
            raw_s = time.perf_counter() - t
            await asyncio.sleep(gap_s)
            t = time.perf_counter()
            status, body = await asyncio.wait_for(conn.request(payload), timeout_s)
            served_s = time.perf_counter() - t
            if status != 200:
                raise RuntimeError(f"paired request answered {status}: {body[:200]!r}")
            await asyncio.sleep(gap_s)
            if i:
                raw.append(raw_s)
                served.append(served_s)
    finally:
        await conn.close()
    return raw, served
