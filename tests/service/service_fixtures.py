"""Helpers for the service tests (importable by name: test directories are not packages)."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

from service.app import create_app
from service.metrics import ServiceMetrics
from service.settings import Settings

REPO = Path(__file__).resolve().parents[2]


def settings_for(model_path: Path, **overrides) -> Settings:
    """Test settings: one thread everywhere (two shared cores), small batches, short delays."""
    values = dict(model_path=model_path, providers=["cpu"], intra_op_threads=1, inter_op_threads=1,
                  intra_op_spinning=False, preprocess_threads=1, max_batch_size=4, max_queue_delay_ms=2,
                  warmup_batch_sizes=[1])
    values.update(overrides)
    return Settings(**values)


@asynccontextmanager
async def serving(settings: Settings, model=None, *, wait_ready: bool = True, metrics: ServiceMetrics | None = None):
    """An app with its lifespan running, and an httpx client talking HTTP to it in-process."""
    app = create_app(settings, model=model, metrics=metrics)
    async with app.router.lifespan_context(app):
        state = app.state.service
        for _ in range(500):
            if state.ready or not wait_ready:
                break
            await asyncio.sleep(0.01)
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve", timeout=30) as client:
            client.app = app
            yield client


class WrappedModel:
    """The real model behind the InferenceModel contract, with knobs: slow it down or make calls fail."""

    def __init__(self, model, delay_s: float = 0.0):
        self.inner, self.info, self.provider = model, model.info, model.provider
        self.delay_s = delay_s
        self.fail_next = 0  # this many next calls raise
        self.batch_sizes: list[int] = []
        self.gate = None  # a threading.Event the next calls wait for, when set

    def run(self, pixel_values: np.ndarray):
        if self.gate is not None:
            self.gate.wait(30)
        if self.delay_s:
            time.sleep(self.delay_s)
        self.batch_sizes.append(len(pixel_values))
        if self.fail_next:
            self.fail_next -= 1
            raise RuntimeError("injected ONNX Runtime failure")
        return self.inner.run(pixel_values)


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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def uvicorn_server(model_path: Path, *flags: str, env: dict | None = None, ready_timeout_s: float = 60):
    """`vitserve serve` in a real process on a free port; yields (base_url, process); always stopped."""
    port = free_port()
    argv = [sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model_path), "--port", str(port),
            "--providers", "cpu", "--intra-op-threads", "1", "--preprocess-threads", "1", "--warmup-batch-sizes",
            "1", "--log-level", "warning", *flags]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    process = subprocess.Popen(argv, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"server exited with {process.returncode}:\n{process.stdout.read().decode()}")
            try:
                if httpx.get(f"{base_url}/v2/health/ready", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError("server did not become ready")
            time.sleep(0.1)
        yield base_url, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
