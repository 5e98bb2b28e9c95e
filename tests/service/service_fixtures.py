"""Helpers for the service tests (importable by name: test directories are not packages)."""
from __future__ import annotations

import asyncio
import io
import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Callable, NamedTuple

import httpx
import numpy as np
from PIL import Image
from prometheus_client.parser import text_string_to_metric_families

from vitserve.bench.servers import free_port  # the one port picker, below the ephemeral range
from vitserve.service.app import create_app
from vitserve.service.engine.inference_model import Capabilities
from vitserve.service.usecases.pipeline import Call
from vitserve.service.http.dependencies import client_gone
from vitserve.service.schemas.paths import is_protocol_path
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.ground.settings import Settings

REPO = Path(__file__).resolve().parents[2]
# How long a test waits for something that should take milliseconds: long enough that only a hung
# service reaches it, however loaded the machine. Tests wait on conditions, never on the clock.
PATIENCE_S = 60.0


async def until(condition: Callable[[], bool], what: str, timeout_s: float = PATIENCE_S) -> None:
    """Poll `condition` on the event loop until it holds; fail after `timeout_s` saying `what` never happened."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        await asyncio.sleep(0.005)


def wait_until(condition: Callable[[], bool], what: str, timeout_s: float = PATIENCE_S) -> None:
    """`until` for blocking code (a server in another process)."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not after {timeout_s:.0f} s"
        time.sleep(0.02)


def ready_over_http(process: subprocess.Popen, base_url: str, output: Callable[[], str]) -> Callable[[], bool]:
    """For `wait_until`: whether the server process at `base_url` answers ready; its `output` in the error when it
    exited instead."""
    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with {process.returncode}:\n{output()}")
        try:
            return httpx.get(f"{base_url}/v2/health/ready", timeout=5).status_code == 200
        except httpx.TransportError:
            return False
    return ready


def settings_for(model_path: Path, **overrides) -> Settings:
    """Test settings: one thread everywhere (two shared cores), small batches, short delays."""
    # max_loop_lag_ms off: a test's requests must not be shed because the machine running it is busy; maps_free
    # off: one graph per model, the maps-free one only where a test asks for it
    values = dict(model_path=model_path, providers=["cpu"], intra_op_threads=1, inter_op_threads=1,
                  intra_op_spinning=False, preprocess_threads=1, max_batch_size=4, max_queue_delay_ms=2,
                  warmup_batch_sizes=[1], max_loop_lag_ms=None, runtime="onnxruntime", maps_free="off")
    values.update(overrides)
    return Settings(**values)


@asynccontextmanager
async def serving(settings: Settings, model=None, *, wait_ready: bool = True, metrics: ServiceMetrics | None = None):
    """An app with its lifespan running, and an httpx client talking HTTP to it in-process."""
    app = create_app(settings, model=model, metrics=metrics)
    async with app.router.lifespan_context(app):
        if wait_ready:
            await until(lambda: app.state.service.ready, "warm-up finished")
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve", timeout=30) as client:
            client.app = app
            yield client


def only_batcher(app):
    """The batcher of the one model version an in-process app serves."""
    records = [r for r in app.state.service.engine.registry.records.values() if r.served is not None]
    assert len(records) == 1, records
    return records[0].served.batcher


class WrappedModel:
    """The real model behind the InferenceModel contract, with knobs the test controls: make the next call
    fail, or hold calls at a gate until the test releases them (a slow model without sleeping)."""

    def __init__(self, model):
        self.inner, self.info, self.provider = model, model.info, model.provider
        self.fail_next = 0  # this many next calls raise
        self.entered: list[int] = []  # batch size of every call that started, held or not
        self.batch_sizes: list[int] = []  # batch size of every call that got past the gate
        self.explained: list[list[int]] = []  # targets of every relevance-path call
        self.wide_batches: list[int] = []  # batch size of every call on the model loaded with every core's thread
        self.gate = threading.Event()
        self.gate.set()

    def hold(self) -> None:
        """From now on calls wait at the gate (after entering) until `release`; forgets earlier entries."""
        self.entered.clear()
        self.gate.clear()

    def release(self) -> None:
        self.gate.set()

    def run(self, pixel_values: np.ndarray):
        return self._gated(lambda: self.inner.run(pixel_values), len(pixel_values))

    @property
    def capabilities(self) -> Capabilities:
        """The inner model's plan, and its wide copy (where it has one) with `run` gated like this one's and recorded
        in `wide_batches`; float32 pixels, every batch with its maps."""
        inner = self.inner.capabilities
        wide = None if inner.wide is None else _WideView(self, inner.wide)
        return Capabilities(wide=wide, plan=inner.plan, load_stages=inner.load_stages)

    def explain(self, pixel_values: np.ndarray, targets: np.ndarray):
        """The relevance path, gated like `run`; `explained` records each call's targets."""
        self.explained.append(targets.tolist())
        return self._gated(lambda: self.inner.explain(pixel_values, targets), len(pixel_values))

    def _gated(self, call, batch: int):
        self.entered.append(batch)
        if not self.gate.wait(PATIENCE_S):
            raise RuntimeError("the test never released the gate")
        self.batch_sizes.append(batch)
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected ONNX Runtime failure")
        return call()


class _WideView:
    """A WrappedModel's inner model's wide copy, as the engine calls it."""

    def __init__(self, owner: WrappedModel, inner):
        self.owner, self.inner, self.info, self.provider = owner, inner, inner.info, inner.provider
        self.capabilities = Capabilities()  # as its owner: a WrappedModel serves every batch with its maps

    def run(self, pixel_values: np.ndarray):
        self.owner.wide_batches.append(len(pixel_values))
        return self.owner._gated(lambda: self.inner.run(pixel_values), len(pixel_values))


async def classify(client, data: bytes, content_type="image/png", **params):
    return await client.post("/v1/classify", params=params, content=data, headers={"content-type": content_type})


def assert_error(response, status: int, code: str):
    """`response` is the error `code` with `status`, in the shape of its path's protocol."""
    assert response.status_code == status, response.text
    assert error_code(response.request.url.path, response.json()) == code


def error_code(path: str, body: dict) -> str:
    """The code of an error body, checked to have the shape its protocol sends: on /v2 the Open Inference
    Protocol's `{"error": "<message>"}` (with our `code` beside it), elsewhere `{"error": {code, message}}`."""
    if is_protocol_path(path):
        assert set(body) == {"error", "code"} and isinstance(body["error"], str) and body["error"], body
        return body["code"]
    assert set(body) == {"error"} and set(body["error"]) == {"code", "message"} and body["error"]["message"], body
    return body["error"]["code"]


def image_bytes(fmt: str, size=(40, 30), color=(200, 30, 60), mode="RGB", **save) -> bytes:
    buffer = io.BytesIO()
    Image.new(mode, size, color if mode != "L" else 128).save(buffer, fmt, **save)
    return buffer.getvalue()


def png_declaring(width: int, height: int) -> bytes:
    """A PNG whose IHDR declares width x height but whose data is one tiny compressed row."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 16)) + chunk(b"IEND", b"")


def patterned_png(size=(48, 40)) -> bytes:
    """A non-constant image, so the rollout map is not flat."""
    rng = np.random.default_rng(1)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(buffer, "PNG")
    return buffer.getvalue()


def samples(text: str) -> dict[tuple, float]:
    """Exposition text -> {(sample name, sorted labels): value}."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(parsed: dict, name: str, **labels) -> float:
    """The sum of `name`'s series that have these labels (whatever their others: model and version, say), as
    PromQL's sum() would."""
    wanted = set(labels.items())
    return sum(v for (sample, sample_labels), v in parsed.items() if sample == name and wanted <= set(sample_labels))


def scrape(base_url: str) -> dict[tuple, float]:
    return samples(httpx.get(f"{base_url}/metrics", timeout=PATIENCE_S).text)


@contextmanager
def uvicorn_server(model_path: Path, *flags: str, workers: int = 1, env: dict | None = None,
                   ready_timeout_s: float = PATIENCE_S):
    """`vitserve serve` in a real process on a free port; yields (base_url, process) once every worker is
    warmed up (the server's own count of ready workers says so); always stopped. With an engine process unless
    `flags` say `--engine` (a later flag wins)."""
    port = free_port()
    argv = [sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model_path), "--port", str(port),
            "--providers", "cpu", "--intra-op-threads", "1", "--preprocess-threads", "1", "--warmup-batch-sizes",
            "1", "--log-level", "warning", "--workers", str(workers), "--max-loop-lag-ms", "60000", "--grpc-port", "0",
            "--runtime", "onnxruntime", "--maps-free", "off", "--engine", "process", *flags]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{process.stdout.read().decode()}")
        try:
            if httpx.get(f"{base_url}/v2/health/ready", timeout=5).status_code != 200:
                return False  # the worker that answered is still warming up
            m = scrape(base_url)
            return value(m, "vitserve_http_workers") == workers and value(m, "vitserve_http_workers_ready") == workers
        except httpx.TransportError:
            return False  # not listening yet

    try:
        wait_until(ready, f"vitserve serve with {workers} worker(s) ready", ready_timeout_s)
        yield base_url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class Answer(NamedTuple):
    """One HTTP response as read off a raw socket."""

    status: int
    headers: dict[str, str]
    body: bytes

    def error_code(self) -> str:
        """The JSON error's code, after checking the error's shape."""
        assert self.headers["content-type"] == "application/json"
        error = json.loads(self.body)["error"]
        assert set(error) == {"code", "message"} and error["message"]
        return error["code"]


class RawConnection:
    """One HTTP/1.1 connection over a plain socket: for what an HTTP client library will not send."""

    def __init__(self, port: int, timeout_s: float = PATIENCE_S):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
        self.buffer = b""

    def __enter__(self) -> "RawConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.sock.close()

    def send(self, data: bytes) -> bool:
        """False when the server has closed the connection already."""
        try:
            self.sock.sendall(data)
            return True
        except (BrokenPipeError, ConnectionResetError):
            return False

    def hang_up(self, reset: bool) -> None:
        """Close: with FIN, or with RST (SO_LINGER 0), as a killed client's kernel may."""
        if reset:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.close()

    def answered(self, within_s: float = 0.0) -> bool:
        """Whether the server has sent something, or closed, within `within_s`."""
        return bool(self.buffer) or bool(select.select([self.sock], [], [], within_s)[0])

    def _read(self) -> bool:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:  # the server closed with our bytes unread: what it sent was read first
            chunk = b""
        self.buffer += chunk
        return bool(chunk)

    def response(self) -> Answer:
        while b"\r\n\r\n" not in self.buffer:
            assert self._read(), f"closed without a response (got {self.buffer!r})"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {name.strip().lower(): value.strip() for name, value in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", 0))
        while len(self.buffer) < length:
            assert self._read(), "closed in the middle of a response body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return Answer(int(status_line.split()[1]), headers, body)

    def closed(self) -> bool:
        """Waits for the server to close the connection; False if it sends anything else."""
        return not self.buffer and not self._read()


@contextmanager
def trickling(connections: list[RawConnection], piece: bytes, every_s: float = 0.2):
    """While the block runs, a thread sends `piece` on every connection every `every_s`: slow clients."""
    stop = threading.Event()

    def trickle():
        while not stop.wait(every_s):
            for connection in connections:
                connection.send(piece)

    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(PATIENCE_S)


async def run_as_call(request, work, deadline, stop, *, watch: bool = True, on_timeout=None):
    """`work` as the pipeline runs an HTTP call's work (`Call.run`): within its deadline and the server's drain,
    watching the client's connection (`request.receive`) with `watch`."""
    call = Call(SimpleNamespace(drain=SimpleNamespace(stopping=stop)), None, deadline, watch_client=lambda: client_gone(request))
    return await call.run(work, on_timeout=on_timeout, watch=watch)
