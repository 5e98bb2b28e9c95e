"""`vitserve bench`: what serving costs over the bare model, measured in one run on one model and one set of inputs.

Three measurements, in this order:

1. **raw**: the ONNX Runtime session alone, made by the service's own runtime code with the server's settings,
   fed the server's own preprocessing of the same images: images/s at batch sizes 1, 8, 32 and batch-1 latency.
   The ceiling the server can approach.
2. **served**: a real `vitserve serve` (uvicorn) child process on 127.0.0.1 under closed-loop load at each
   concurrency level, with batching on (max batch size N) and off (max batch size 1), for pre-sized PNGs and
   for 640x480 JPEGs. Requests are `POST /v1/classify` with the raw image as the body and default parameters.
3. **bare** (small, HTTP-bound models): the same uvicorn options serving one FastAPI endpoint that reads the
   upload and returns a constant: the HTTP floor the served numbers should be read against.

The load generator. On a two-core machine every cycle the client spends is taken from the server whichever
process it runs in: a separate client process would not give the server another core, only move the
competition. What keeps the client from distorting the numbers is that it is cheap: a minimal HTTP/1.1
keep-alive client on asyncio streams, each request encoded once, responses read by Content-Length: about
0.15 ms of CPU per request against about 2 ms for `httpx.AsyncClient` (measured on the bench machine against
the bare endpoint). It runs in the bench process after the raw session is freed, and every level reports the CPU the server, the client and everything else
on the machine used during the measured window, so contention is shown in the table rather than guessed at.
"""
from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path


LOOPBACK = "127.0.0.1"
# --model names the bench makes itself with random weights, by running `python -m export.presets` (torch) in a
# child process: this package never imports torch. Speed does not depend on the weights.
PRESETS = ("vit-s16", "vit-fmnist-random")
DEFAULT_CACHE = Path("build/bench-models")


# ---------------------------------------------------------------------------------------------------- inputs


def make_images(kind: str, size: tuple[int, int], channels: int, count: int, seed: int = 0) -> list[bytes]:
    """`count` distinct encoded images: 'png' at `size` (height, width) with the model's channels, or 'jpeg' 640x480 RGB.

    Smooth gradients plus noise, so that the codecs do realistic work (pure noise would not compress).
    """
    import numpy as np
    from PIL import Image

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


# ---------------------------------------------------------------------------------------------------- stats


def latency_summary(latencies_s: list[float] | np.ndarray) -> dict[str, float]:
    """p50/p90/p99/mean in milliseconds; NaN when there is nothing to summarise."""
    import numpy as np

    if len(latencies_s) == 0:
        return {"p50_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "mean_ms": float(ms.mean())}


@dataclass
class CpuSnapshot:
    """CPU seconds used so far by the server process, this process, and the whole machine (busy, all cores)."""

    wall: float
    server: float
    client: float
    machine: float

    @classmethod
    def take(cls, server_pid: int | None) -> "CpuSnapshot":
        return cls(time.perf_counter(), _process_cpu_seconds(server_pid), time.process_time(), _machine_busy_seconds())

    def usage(self, later: "CpuSnapshot") -> dict[str, float]:
        """Average cores busy between two snapshots: server, client, and everything else on the machine."""
        wall = max(later.wall - self.wall, 1e-9)
        server = (later.server - self.server) / wall
        client = (later.client - self.client) / wall
        other = (later.machine - self.machine) / wall - server - client
        return {"server_cores": server, "client_cores": client, "other_cores": max(other, 0.0)}


def _process_cpu_seconds(pid: int | None) -> float:
    if pid is None:
        return 0.0
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _machine_busy_seconds() -> float:
    try:
        cpu = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    except OSError:
        return 0.0
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(v) for v in cpu[:8])
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------------------- raw ONNX Runtime


def bench_raw(run_batch, samples: np.ndarray, batch_sizes: list[int], duration_s: float,
              min_calls: int = 3, max_calls: int = 100_000) -> list[dict]:
    """Images/s and per-call latency of `run_batch(pixel_values)` at each batch size.

    Each size gets one warm-up call, then runs for `duration_s` (at least `min_calls`, at most `max_calls` calls).
    `samples` (n, C, H, W) are cycled to fill a batch, so every size sees the same images.
    """
    import numpy as np

    results = []
    for bs in batch_sizes:
        batch = np.ascontiguousarray(samples[np.arange(bs) % len(samples)])  # (bs, C, H, W)
        run_batch(batch)
        times: list[float] = []
        end = time.perf_counter() + duration_s
        while len(times) < max_calls and (len(times) < min_calls or time.perf_counter() < end):
            t = time.perf_counter()
            run_batch(batch)
            times.append(time.perf_counter() - t)
        results.append({"batch_size": bs, "calls": len(times), "images_per_s": bs * len(times) / sum(times),
                        **latency_summary(times)})
    return results


# ---------------------------------------------------------------------------------------------------- load generator


class HttpConnection:
    """One keep-alive HTTP/1.1 connection to a loopback server: the least client work per request."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def request(self, payload: bytes) -> tuple[int, bytes]:
        """Send one encoded request; return (status, body)."""
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(payload)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip() for k, v in (ln.split(":", 1) for ln in lines[1:] if ":" in ln)}
        if "content-length" in headers:
            body = await self.reader.readexactly(int(headers["content-length"]))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            body = await self._read_chunked()
        else:
            body = await self.reader.read()
            await self.close()
        if headers.get("connection", "").lower() == "close":
            await self.close()
        return status, body

    async def _read_chunked(self) -> bytes:
        parts = []
        for _ in range(1_000_000):  # bounded: a chunked body of a million chunks is not one we sent for
            size = int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16)
            data = await self.reader.readexactly(size + 2)
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


def encode_request(method: str, target: str, body: bytes = b"", content_type: str | None = None) -> bytes:
    head = [f"{method} {target} HTTP/1.1", f"Host: {LOOPBACK}", f"Content-Length: {len(body)}"]
    if content_type:
        head.append(f"Content-Type: {content_type}")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class _Window:
    """The measured window of one level: opens after the warm-up, closes when the timer and the count allow."""

    start: float
    end: float | None = None  # None while open
    latencies: list[float] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)

    def open_at(self, now: float) -> bool:
        return self.end is None or now < self.end

    def record(self, sent: float, done: float, status) -> None:
        if done >= self.start and self.open_at(done):
            self.latencies.append(done - sent) if status == 200 else self.errors.update([str(status)])


async def _closed_loop_client(conn: HttpConnection, payloads: list[bytes], first: int, step: int, window: _Window,
                              timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    try:
        for k in range(first, 10**9, step):  # bounded by the window's end, and by count here
            if not window.open_at(loop.time()):
                break
            sent = loop.time()
            try:
                status, _ = await asyncio.wait_for(conn.request(payloads[k % len(payloads)]), timeout_s)
            except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError) as e:
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
    window = _Window(loop.time() + warmup_s)
    last_end = window.start + max(duration_s, max_duration_s or 0)

    async def timekeeper() -> None:
        await asyncio.sleep(max(window.start - loop.time(), 0))
        if on_window:
            await on_window("start")
        await asyncio.sleep(duration_s)
        while len(window.latencies) + sum(window.errors.values()) < min_completed and loop.time() < last_end:
            await asyncio.sleep(0.05)
        window.end = loop.time()
        if on_window:
            await on_window("end")

    clients = [asyncio.create_task(_closed_loop_client(HttpConnection(host, port), payloads, i, concurrency, window,
                                                       timeout_s)) for i in range(concurrency)]
    await timekeeper()
    for task in clients:  # requests still in flight are not counted: hang up (the server drops them unrun)
        task.cancel()
    await asyncio.gather(*clients, return_exceptions=True)
    measured = window.end - window.start
    return {"concurrency": concurrency, "completed": len(window.latencies), "errors": dict(window.errors),
            "window_s": measured, "requests_per_s": len(window.latencies) / measured,
            **latency_summary(window.latencies)}


def paired_one_client(run_batch, pixels: np.ndarray, port: int, payload: bytes, pairs: int, gap_s: float,
                      timeout_s: float) -> dict:
    """One client's latency over serving, paired: a raw `run_batch(pixels)` call, then one served request of the same
    image, in turn, `pairs` times (after one warm-up pair).

    Each served latency is compared with the raw call made just before it, so both see the same machine: on a
    virtual machine whose host speed drifts between phases, medians measured minutes apart are not comparable.
    `gap_s` between the halves lets the other side's spinning ONNX Runtime threads go to sleep.
    """
    import numpy as np

    async def alternate() -> tuple[list[float], list[float]]:
        conn, raw, served = HttpConnection(LOOPBACK, port), [], []
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

    raw, served = asyncio.run(alternate())
    overhead_ms = (np.asarray(served) - np.asarray(raw)) * 1000.0
    return {"pairs": len(raw), "raw_p50_ms": latency_summary(raw)["p50_ms"],
            "served_p50_ms": latency_summary(served)["p50_ms"], "overhead_p50_ms": float(np.median(overhead_ms)),
            "overhead_p10_ms": float(np.percentile(overhead_ms, 10)),
            "overhead_p90_ms": float(np.percentile(overhead_ms, 90))}


# ---------------------------------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server in a child process on 127.0.0.1, ready when GET `ready_path` answers 200; stopped on exit."""

    def __init__(self, argv: list[str], port: int, ready_path: str, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 180.0, log_path: Path | None = None):
        self.argv, self.port, self.ready_path = argv, port, ready_path
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> "ServerProcess":
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if self.log_path:
            log.close()
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self) -> None:
        url = f"http://{LOOPBACK}:{self.port}{self.ready_path}"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} before it was ready"
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {self.startup_timeout_s:.0f} s{self._log_tail()}")

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "; its log ends:\n" + self.log_path.read_text(errors="replace")[-2000:]

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def stop(self) -> None:
        """SIGTERM (the server drains), then SIGKILL after 30 s."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __exit__(self, *exc) -> None:
        self.stop()


def scrape_metrics(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Current values of unlabelled Prometheus samples (e.g. `vitserve_batch_size_sum`); absent ones are left out."""
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return {}
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in names:
            values[name] = float(value)
    return values


# ---------------------------------------------------------------------------------------------------- the model


def resolve_model(model: str, cache_dir: Path) -> Path:
    """An ONNX path as given, or for a preset name the cached export, made on first use in a child process."""
    if model not in PRESETS:
        path = Path(model)
        if not path.is_file():
            raise SystemExit(f"vitserve bench: no model file {path} (or use a preset: {', '.join(PRESETS)})")
        return path
    path = cache_dir / f"{model}.onnx"
    if not path.is_file():
        print(f"exporting random-weight {model} to {path} (needs torch: pip install -e '.[export]') ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial.onnx")
        subprocess.run([sys.executable, "-m", "export.presets", model, str(tmp)], check=True, timeout=1800)
        tmp.replace(path)
    return path


# ---------------------------------------------------------------------------------------------------- one run


@dataclass
class BenchConfig:
    model: str
    out: Path = Path("docs/bench.md")
    batch_sizes: list[int] = field(default_factory=lambda: [1, 8, 32])
    concurrency: list[int] = field(default_factory=lambda: [1, 8, 32, 64])
    inputs: list[str] = field(default_factory=lambda: ["png", "jpeg"])
    max_batch_size: int = 32  # batching on; off is 1
    max_queue_delay_ms: float | None = None  # None: the server's default
    duration_s: float = 5.0  # measured window per served level
    warmup_s: float = 1.5  # discarded before each window
    min_completed_per_client: int = 3  # a window stretches (up to max_duration_factor x) until this many per client
    max_duration_factor: float = 3.0
    raw_duration_s: float = 3.0  # per raw batch size
    pairs: int = 30  # paired one-client measurements per server (raw call, served request, in turn)
    pair_gap_s: float = 0.02
    bare: str = "auto"  # "on", "off", or "auto": only when the model is fast enough to be HTTP-bound
    bare_threshold_ms: float = 5.0  # auto: run bare when raw batch-1 p50 is below this
    time_limit_s: float = 1800.0  # the whole run; levels that would start after it are skipped
    request_timeout_s: float = 120.0
    num_images: int = 8
    seed: int = 0
    cache_dir: Path = DEFAULT_CACHE
    log_dir: Path = Path("build/bench-logs")  # the servers' logs


class Budget:
    """The run's time limit: levels check it before they start, so a run ends at most one level past it."""

    def __init__(self, limit_s: float):
        self.deadline = time.monotonic() + limit_s

    def allows(self, seconds: float) -> bool:
        return time.monotonic() + seconds <= self.deadline


def run_level(server: ServerProcess, payloads: list[bytes], concurrency: int, cfg: BenchConfig) -> dict:
    """One closed-loop level against a running server, with CPU use and batch statistics over its window."""
    names = ("vitserve_batch_size_sum", "vitserve_batch_size_count", "vitserve_inference_seconds_sum")
    edges: dict[str, tuple[CpuSnapshot, dict]] = {}

    async def on_window(edge: str) -> None:
        metrics = await asyncio.to_thread(scrape_metrics, server.port, names)
        edges[edge] = (CpuSnapshot.take(server.pid), metrics)

    result = asyncio.run(closed_loop(LOOPBACK, server.port, payloads, concurrency, cfg.warmup_s, cfg.duration_s,
                                     cfg.request_timeout_s, on_window, min_completed=cfg.min_completed_per_client
                                     * concurrency, max_duration_s=cfg.max_duration_factor * cfg.duration_s))
    (cpu0, m0), (cpu1, m1) = edges["start"], edges["end"]
    result.update(cpu0.usage(cpu1))
    batches = m1.get(names[1], 0.0) - m0.get(names[1], 0.0)
    result["mean_batch_size"] = (m1[names[0]] - m0[names[0]]) / batches if batches else float("nan")
    infer = m1.get(names[2], float("nan")) - m0.get(names[2], float("nan"))
    result["inference_busy"] = infer / (cpu1.wall - cpu0.wall)  # fraction of the window inside ORT calls
    return result


def run_levels(server: ServerProcess, payloads: dict[str, list[bytes]], cfg: BenchConfig, budget: Budget,
               **labels) -> list[dict]:
    rows = []
    for kind, requests in payloads.items():
        for c in cfg.concurrency:
            row = {**labels, "input": kind, "concurrency": c}
            if not budget.allows(cfg.warmup_s + cfg.max_duration_factor * cfg.duration_s + 5):
                rows.append({**row, "skipped": "time limit"})
                continue
            rows.append({**row, **run_level(server, requests, c, cfg)})
            print(_level_line(rows[-1]), flush=True)
            settle(server.port, requests[0], cfg.request_timeout_s)
    return rows


def settle(port: int, payload: bytes, timeout_s: float) -> None:
    """Wait out the batch a level left running (its clients hung up): one request, answered after it, FIFO."""
    async def probe() -> None:
        conn = HttpConnection(LOOPBACK, port)
        try:
            await asyncio.wait_for(conn.request(payload), timeout_s)
        except (OSError, ValueError, asyncio.IncompleteReadError, asyncio.TimeoutError):
            pass
        finally:
            await conn.close()

    asyncio.run(probe())


def _level_line(r: dict) -> str:
    return (f"  {r.get('app', 'served'):6s} batching={r.get('batching', '-'):3s} {r['input']:4s} c={r['concurrency']:<3d}"
            f" {r['requests_per_s']:8.1f} req/s  p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms"
            f"  errors {sum(r['errors'].values())}")


# ---------------------------------------------------------------------------------------------------- the report


def targets(report: dict) -> dict:
    """The issue's ratios, from this run's rows: saturation throughput and one-client latency, served vs raw."""
    raw = {r["batch_size"]: r for r in report["raw"]}
    served = [r for r in report["served"] if "skipped" not in r and r["input"] == "png"]
    out: dict = {}
    for batching, raw_bs in (("on", report["settings"]["max_batch_size"]), ("off", 1)):
        rows = [r for r in served if r["batching"] == batching]
        if rows and raw_bs in raw:
            best = max(rows, key=lambda r: r["requests_per_s"])
            out[f"saturation_batching_{batching}"] = {
                "served_images_per_s": best["requests_per_s"], "at_concurrency": best["concurrency"],
                "raw_batch_size": raw_bs, "raw_images_per_s": raw[raw_bs]["images_per_s"],
                "ratio": best["requests_per_s"] / raw[raw_bs]["images_per_s"], "target": ">= 0.85",
                # images per CPU-second, served over raw: what serving costs, whatever else the machine runs
                "cpu_ratio": _per_cpu(best["requests_per_s"], best.get("server_cores"))
                / _per_cpu(raw[raw_bs]["images_per_s"], raw[raw_bs].get("session_cores"))}
        pair = next((r for r in report.get("paired", []) if r["batching"] == batching), None)
        one = [r for r in rows if r["concurrency"] == 1]
        if pair:  # the robust one: each served request against the raw call just before it
            out[f"one_client_latency_batching_{batching}"] = {
                "served_p50_ms": pair["served_p50_ms"], "raw_batch1_p50_ms": pair["raw_p50_ms"],
                "overhead_ms": pair["overhead_p50_ms"], "method": f"median of {pair['pairs']} paired differences",
                "target": "<= +3 ms"}
        elif one and 1 in raw:
            out[f"one_client_latency_batching_{batching}"] = {
                "served_p50_ms": one[0]["p50_ms"], "raw_batch1_p50_ms": raw[1]["p50_ms"],
                "overhead_ms": one[0]["p50_ms"] - raw[1]["p50_ms"], "method": "p50s of separate phases",
                "target": "<= +3 ms"}
    bare = {r["concurrency"]: r for r in report.get("bare", []) if "skipped" not in r and r["input"] == "png"}
    if bare:
        out["served_vs_bare"] = [
            {"concurrency": r["concurrency"], "batching": r["batching"], "served_requests_per_s": r["requests_per_s"],
             "bare_requests_per_s": bare[r["concurrency"]]["requests_per_s"],
             "ratio": r["requests_per_s"] / bare[r["concurrency"]]["requests_per_s"]}
            for r in served if r["concurrency"] in bare]
    return out


def _per_cpu(per_second: float, cores: float | None) -> float:
    return per_second / cores if cores else float("nan")


def _f(value, fmt: str = ".1f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _table(header: list[str], rows: list[list[str]], text_columns: int = 0) -> list[str]:
    """A Markdown table; the first `text_columns` are left-aligned, the numbers right-aligned."""
    align = [":---" if i < text_columns else "---:" for i in range(len(header))]
    return ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|", *("| " + " | ".join(r) + " |" for r in rows)]


def _raw_table(raw: list[dict]) -> list[str]:
    return _table(["batch size", "images/s", "latency p50 ms", "p99 ms", "calls", "images/CPU-s", "session cores",
                   "other cores"],
                  [[str(r["batch_size"]), _f(r["images_per_s"]), _f(r["p50_ms"], ".2f"), _f(r["p99_ms"], ".2f"),
                    str(r["calls"]), _f(_per_cpu(r["images_per_s"], r.get("session_cores"))),
                    _f(r.get("session_cores"), ".2f"), _f(r.get("other_cores"), ".2f")] for r in raw])


def _paired_table(rows: list[dict]) -> list[str]:
    return _table(["batching", "pairs", "raw p50 ms", "served p50 ms", "overhead p10 ms", "overhead p50 ms",
                   "overhead p90 ms"],
                  [[r["batching"], str(r["pairs"]), _f(r["raw_p50_ms"], ".2f"), _f(r["served_p50_ms"], ".2f"),
                    *(_f(r[f"overhead_{q}_ms"], "+.2f") for q in ("p10", "p50", "p90"))] for r in rows],
                  text_columns=1)


def _load_table(rows: list[dict], with_batching: bool = True) -> list[str]:
    header = (["input", "batching"] if with_batching else ["input"]) + [
        "clients", "req/s", "p50 ms", "p90 ms", "p99 ms", "errors", "window s", "req/CPU-s", "mean batch", "ORT busy",
        "server cores", "client cores", "other cores"]
    body = []
    for r in rows:
        head = [r["input"]] + ([r["batching"]] if with_batching else []) + [str(r["concurrency"])]
        if "skipped" in r:
            body.append(head + [f"skipped ({r['skipped']})"] + ["-"] * (len(header) - len(head) - 1))
            continue
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(r["errors"].items())) or "0"
        body.append(head + [_f(r["requests_per_s"]), _f(r["p50_ms"], ".2f"), _f(r["p90_ms"], ".2f"),
                            _f(r["p99_ms"], ".2f"), errors, _f(r["window_s"], ".1f"),
                            _f(_per_cpu(r["requests_per_s"], r["server_cores"])), _f(r.get("mean_batch_size"), ".2f"),
                            _f(r.get("inference_busy"), ".0%"), _f(r["server_cores"], ".2f"),
                            _f(r["client_cores"], ".2f"), _f(r["other_cores"], ".2f")])
    return _table(header, body, text_columns=2 if with_batching else 1)


def _targets_lines(t: dict) -> list[str]:
    lines = []
    for key, v in t.items():
        if key.startswith("saturation"):
            lines.append(f"- **{key.replace('_', ' ')}**: served {v['served_images_per_s']:.1f} images/s "
                         f"(PNG, {v['at_concurrency']} clients) / raw {v['raw_images_per_s']:.1f} images/s at batch "
                         f"size {v['raw_batch_size']} = **{v['ratio']:.2f}** (target {v['target']}); per CPU-second used "
                         f"(server process vs session): {_f(v['cpu_ratio'], '.2f')}")
        elif key.startswith("one_client"):
            lines.append(f"- **{key.replace('_', ' ')}**: served p50 {v['served_p50_ms']:.2f} ms vs raw batch-1 p50 "
                         f"{v['raw_batch1_p50_ms']:.2f} ms: overhead **{v['overhead_ms']:+.2f} ms** ({v['method']}; "
                         f"target {v['target']})")
        elif key == "served_vs_bare":
            for r in v:
                lines.append(f"- served/bare requests/s, batching {r['batching']}, {r['concurrency']} clients: "
                             f"{r['served_requests_per_s']:.1f} / {r['bare_requests_per_s']:.1f} = "
                             f"**{r['ratio']:.2f}**")
    return lines


def render_markdown(report: dict, plot_name: str | None) -> str:
    m, s, env = report["model"], report["settings"], report["environment"]
    lines = [f"# `vitserve bench`: {m['name']} {m['version']} ({m['height']}x{m['width']}, {m['channels']} channel(s), "
             f"patch {m['patch_size']})", "",
             f"`{report['command']}`, {env['date']}. Model `{m['path']}` ({m['size_mb']:.1f} MB, {m['precision']}), "
             f"provider {m['provider']}; onnxruntime {env['onnxruntime']}, Python {env['python']}; "
             f"{env['cpu']} ({env['cpus']} CPUs). Load average at start {env['loadavg_start']}, at end "
             f"{env['loadavg_end']}; other processes used **{env['other_cores_mean']:.2f} cores** on average during "
             f"the measured windows (raw and served) ({'contended' if env['contended'] else 'quiet machine'}).", "",
             f"Server: `vitserve serve` in a uvicorn child process on {LOOPBACK}; batching on = max batch size "
             f"{s['max_batch_size']}, off = 1; max queue delay {s['max_queue_delay_ms']} ms; other settings "
             f"{s['server_settings'] or 'default'}. Closed loop: each client sends its next request when the last "
             f"is answered; {s['warmup_s']} s warm-up then {s['duration_s']} s measured per level (stretched, up to "
             f"{s['max_duration_factor']}x, until {s['min_completed_per_client']} answers per client). Requests: "
             f"`POST /v1/classify` with the image as the body (top_k 5, rollout grid); PNG = {m['height']}x{m['width']} "
             f"pre-sized, JPEG = 640x480 (decoded and resized by the server). The raw session gets the server's "
             f"own preprocessing of the PNGs. Load generator: {s['load_generator']}.", "",
             "## Targets (this run)", "", *_targets_lines(report["targets"]), "",
             "## Raw ONNX Runtime session (no HTTP)", "", *_raw_table(report["raw"]), "",
             "## Served", "", *_load_table(report["served"]), ""]
    if report.get("paired"):
        lines += ["## One client, paired with the raw session", "",
                  f"A raw batch-1 call, then one served PNG request of the same image, in turn "
                  f"({s['pair_gap_s'] * 1000:.0f} ms apart); *overhead* is served minus the raw call just before it.",
                  "", *_paired_table(report["paired"]), ""]
    if report.get("bare"):
        lines += ["## Bare FastAPI endpoint returning a constant (same uvicorn options)", "",
                  *_load_table(report["bare"], with_batching=False), ""]
    lines += ["Columns: *window s* is the measured window (stretched for slow models); *mean batch* comes from "
              "the server's own `vitserve_batch_size` histogram over the window; *ORT busy* is the server's "
              "`vitserve_inference_seconds` sum over the window divided by its length (above 100% when that "
              "metric counts time a batch waited for the runner thread behind another batch); *cores* are CPU "
              "seconds per second used by the server process, this load generator (raw table: the session), "
              "and everything else on the machine; *images/CPU-s* and *req/CPU-s* divide throughput by the CPU the "
              "session or the server process used, which stays comparable when other work shares the machine.", ""]
    if plot_name:
        lines += [f"![latency vs throughput]({plot_name})", ""]
    return "\n".join(lines)


def plot_report(report: dict, path: Path) -> bool:
    """Latency (p50 solid, p99 dashed) vs throughput per configuration, raw ORT images/s as vertical lines.

    Returns False, with a message, when matplotlib (the `train` extra) is not installed.
    """
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install matplotlib): no plot written", file=sys.stderr)
        return False
    fig, ax = plt.subplots(figsize=(8, 5))
    _plot_load_curves(ax, report["served"] + report.get("bare", []))
    for r in report["raw"]:
        ax.axvline(r["images_per_s"], color="grey", lw=0.8, ls=":")
        ax.annotate(f"raw bs {r['batch_size']}", (r["images_per_s"], 1), rotation=90, fontsize=7, color="grey",
                    xycoords=("data", "axes fraction"), va="top", ha="right")
    ax.set(xscale="log", yscale="log", xlabel="throughput (images/s = requests/s)",
           ylabel="latency (ms); p50 solid, p99 dashed",
           title=f"vitserve bench: {report['model']['name']} (point labels: concurrent clients)")
    ax.legend(fontsize=7)
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def _plot_load_curves(ax, rows: list[dict]) -> None:
    groups: dict[str, list[dict]] = {}
    for r in rows:
        if "skipped" not in r and r["completed"]:
            label = f"{r.get('app', 'served')} {r['input']}" + (f" batching {r['batching']}" if "batching" in r else "")
            groups.setdefault(label, []).append(r)
    for label, group in groups.items():
        group.sort(key=lambda r: r["concurrency"])
        x = [r["requests_per_s"] for r in group]
        (line,) = ax.plot(x, [r["p50_ms"] for r in group], marker="o", label=label)
        ax.plot(x, [r["p99_ms"] for r in group], ls="--", color=line.get_color(), alpha=0.6)
        for r in group:
            ax.annotate(str(r["concurrency"]), (r["requests_per_s"], r["p50_ms"]), fontsize=7,
                        textcoords="offset points", xytext=(3, 3))


# ---------------------------------------------------------------------------------------------------- orchestration


def server_settings(cfg: BenchConfig, overrides: dict[str, str], batching: bool) -> dict[str, str]:
    """The settings under test as `VITSERVE_*` variables: the user's overrides, batching on or off, loopback."""
    env = {f"VITSERVE_{k.upper()}": v for k, v in overrides.items()}
    env["VITSERVE_MAX_BATCH_SIZE"] = str(cfg.max_batch_size if batching else 1)
    if cfg.max_queue_delay_ms is not None:
        env["VITSERVE_MAX_QUEUE_DELAY_MS"] = str(cfg.max_queue_delay_ms)
    # a closed loop never has more than `concurrency` requests queued; deadlines must not cut the measurement
    env.setdefault("VITSERVE_REQUEST_TIMEOUT_MS", str(cfg.request_timeout_s * 1000))
    env.setdefault("VITSERVE_MAX_QUEUE_SIZE", str(max(256, 2 * max(cfg.concurrency))))
    env["VITSERVE_HOST"] = LOOPBACK
    env.setdefault("VITSERVE_LOG_LEVEL", "warning")
    return env


def load_raw_model(model_path: Path, overrides: dict[str, str]):
    """The server's own session: `service.runtime.OnnxModel` with the same settings the server gets."""
    from service.runtime import OnnxModel
    from service.settings import Settings

    env = {k.removeprefix("VITSERVE_").lower(): v for k, v in overrides.items()}
    return OnnxModel.load(Settings(**{**env, "model_path": model_path}))


def model_summary(model, path: Path) -> dict:
    info = model.info
    return {"name": info.name, "version": info.version, "path": str(path), "height": info.image_size[0],
            "width": info.image_size[1], "channels": info.channels, "patch_size": info.patch_size,
            "precision": info.precision, "provider": model.provider, "size_mb": path.stat().st_size / 2**20}


def environment() -> dict:
    import onnxruntime

    cpu = "unknown CPU"
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(), "cpu": cpu, "cpus": os.cpu_count(),
            "loadavg_start": _loadavg()}


def _loadavg() -> str:
    return " / ".join(f"{v:.2f}" for v in os.getloadavg())


def served_phase(model_path: Path, payloads: dict[str, list[bytes]], cfg: BenchConfig, overrides: dict[str, str],
                 budget: Budget, pairing: tuple | None = None) -> tuple[list[dict], list[dict]]:
    """Batching on, then off: a fresh `vitserve serve` process each, every input kind and concurrency level, then
    (with `pairing` = (run_batch, pixels (1, C, H, W), the same image's request)) the paired one-client latency."""
    rows, paired = [], []
    for batching in (True, False):
        label = "on" if batching else "off"
        if cfg.max_batch_size == 1 and batching:
            continue
        port = free_port()
        argv = [sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model_path),
                "--host", LOOPBACK, "--port", str(port)]
        log_path = cfg.log_dir / f"bench-server-batching-{label}.log"
        print(f"served, batching {label} (server log: {log_path})", flush=True)
        with ServerProcess(argv, port, "/v2/health/ready", server_settings(cfg, overrides, batching),
                           log_path=log_path) as server:
            rows += run_levels(server, payloads, cfg, budget, app="served", batching=label)
            if pairing and cfg.pairs > 0 and budget.allows(cfg.pairs * 0.5):
                run_batch, pixels, payload = pairing
                paired.append({"batching": label, **paired_one_client(run_batch, pixels, server.port, payload,
                                                                     cfg.pairs, cfg.pair_gap_s, cfg.request_timeout_s)})
                p = paired[-1]
                print(f"  paired one client, batching {label}: raw p50 {p['raw_p50_ms']:.2f} ms, served p50 "
                      f"{p['served_p50_ms']:.2f} ms, overhead p50 {p['overhead_p50_ms']:+.2f} ms", flush=True)
    return rows, paired


def bare_phase(payloads: dict[str, list[bytes]], cfg: BenchConfig, overrides: dict[str, str],
               budget: Budget) -> list[dict]:
    """The constant endpoint under the same uvicorn options as `vitserve serve` (see `run_bare_server`)."""
    port = free_port()
    argv = [sys.executable, "-c", "import sys; from service.bench import run_bare_server; run_bare_server()"]
    env = {**server_settings(cfg, overrides, batching=True), "VITSERVE_PORT": str(port)}
    log_path = cfg.log_dir / "bench-server-bare.log"
    print(f"bare constant endpoint (server log: {log_path})", flush=True)
    with ServerProcess(argv, port, "/v2/health/ready", env, log_path=log_path) as server:
        return run_levels(server, {"png": payloads["png"]}, cfg, budget, app="bare")


def bare_app():
    """A FastAPI app whose classify endpoint reads the upload and returns a constant: the HTTP floor."""
    from fastapi import Body, FastAPI

    app = FastAPI(title="vitserve bench: bare endpoint")
    constant = {"model": {"name": "bare", "version": "0"}, "predictions": [{"index": 0, "label": "x", "score": 1.0}]}

    @app.post("/v1/classify")
    async def classify(image: bytes = Body(media_type="image/png")) -> dict:
        return constant

    @app.get("/v2/health/ready")
    async def ready() -> dict:
        return {"ready": True}

    return app


def run_bare_server() -> None:
    """Serve `bare_app` with the uvicorn options `vitserve serve` uses (service/cli.py), settings from `VITSERVE_*`."""
    import uvicorn

    from service.settings import Settings

    s = Settings()
    uvicorn.run("service.bench:bare_app", factory=True, host=s.host, port=s.port, workers=s.workers,
                log_level=s.log_level, limit_concurrency=s.limit_concurrency,
                timeout_graceful_shutdown=int(s.drain_timeout_s) or None)


def preprocessed(model, images: list[bytes]) -> np.ndarray:
    """The server's own preprocessing of `images` (default settings, resize=fit): (n, C, H, W)."""
    import numpy as np

    from service.preprocess import prepare_image
    from service.settings import Settings

    s = Settings()
    return np.stack([prepare_image(data, model.info, resize="fit", max_bytes=s.max_upload_bytes,
                                   max_pixels=s.max_image_pixels, max_tokens=s.max_native_tokens).pixels
                     for data in images])


def raw_phase(model, samples: np.ndarray, cfg: BenchConfig) -> list[dict]:
    """The session alone, fed the server's own preprocessing of the pre-sized PNGs."""
    sizes = sorted(set(cfg.batch_sizes) | {cfg.max_batch_size})
    print(f"raw ONNX Runtime, batch sizes {sizes}", flush=True)
    rows = []
    for size in sizes:
        before = CpuSnapshot.take(None)
        rows += bench_raw(model.run, samples, [size], cfg.raw_duration_s)
        usage = before.usage(CpuSnapshot.take(None))  # "client" is this process: the session
        rows[-1].update(session_cores=usage["client_cores"], other_cores=usage["other_cores"])
        r = rows[-1]
        print(f"  raw bs {size:3d}: {r['images_per_s']:8.1f} images/s  p50 {r['p50_ms']:8.2f} ms", flush=True)
    return rows


def run_bench(cfg: BenchConfig, overrides: dict[str, str], command: str = "vitserve bench") -> dict:
    """Everything, in one run; returns the report (also what the Markdown, JSON and plot are made from)."""
    budget = Budget(cfg.time_limit_s)
    model_path = resolve_model(cfg.model, cfg.cache_dir)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    model = load_raw_model(model_path, server_settings(cfg, overrides, batching=True))
    summary = model_summary(model, model_path)
    if cfg.max_queue_delay_ms is None:
        from service.settings import Settings
        cfg.max_queue_delay_ms = Settings().max_queue_delay_ms
    images = {kind: make_images(kind, model.info.image_size, model.info.channels, cfg.num_images, cfg.seed)
              for kind in {"png", *cfg.inputs}}
    payloads = {kind: [encode_request("POST", "/v1/classify", data, f"image/{kind}") for data in images[kind]]
                for kind in cfg.inputs}
    samples = preprocessed(model, images["png"])  # (n, C, H, W)
    raw = raw_phase(model, samples, cfg)
    # The session stays for the paired one-client measurement; idle, its threads sleep and take nothing from the
    # server (the pairs leave a gap after each raw call for its spinning threads to stop).
    pairing = (model.run, samples[:1], payloads["png"][0]) if "png" in payloads else None
    served, paired = served_phase(model_path, payloads, cfg, overrides, budget, pairing)
    run_bare = cfg.bare == "on" or (cfg.bare == "auto" and raw[0]["p50_ms"] < cfg.bare_threshold_ms)
    bare = bare_phase(payloads, cfg, overrides, budget) if run_bare and "png" in payloads else []
    measured = [r for r in raw + served + bare if "skipped" not in r]  # (paired rows have no CPU columns)
    other = sum(r["other_cores"] for r in measured) / len(measured) if measured else float("nan")
    env.update(loadavg_end=_loadavg(), other_cores_mean=other, contended=bool(other > 0.25))
    settings = {**asdict(cfg), "server_settings": overrides,
                "load_generator": "asyncio keep-alive HTTP/1.1 client in the bench process"}
    report = {"command": command, "model": summary, "environment": env, "settings": settings,
              "raw": raw, "served": served, "paired": paired, "bare": bare}
    report["targets"] = targets(report)
    return report


def write_report(report: dict, out: Path) -> list[Path]:
    """The Markdown table, the JSON it was made from, and the plot (when matplotlib is there), side by side."""
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = out.with_suffix(".png")
    has_plot = plot_report(report, plot)
    out.write_text(render_markdown(report, plot.name if has_plot else None))
    data = out.with_suffix(".json")
    data.write_text(json.dumps(report, indent=1, default=str) + "\n")
    return [out, data] + ([plot] if has_plot else [])


# ---------------------------------------------------------------------------------------------------- CLI


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _setting(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"expected NAME=VALUE (a Settings field), got {text!r}")
    return name.strip().lower().removeprefix("vitserve_"), value


def add_bench_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "bench", help="raw ONNX Runtime vs served throughput and latency, in one run",
        description="Measures the raw ONNX Runtime session, then a real `vitserve serve` process under closed-loop "
                    "load (batching on and off, pre-sized PNGs and 640x480 JPEGs), and for fast models a bare "
                    "FastAPI endpoint; writes a Markdown table, its JSON and a latency/throughput plot.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="models/vit-fmnist/model.onnx",
                   help=f"an ONNX artifact, or a preset made on first use with random weights (needs torch): "
                        f"{', '.join(PRESETS)}")
    p.add_argument("--out", type=Path, default=Path("docs/bench.md"), help="Markdown report; .json and .png beside it")
    p.add_argument("--batch-sizes", type=_ints, help="raw session batch sizes (default 1,8,32)")
    p.add_argument("--concurrency", type=_ints, help="served closed-loop client counts (default 1,8,32,64)")
    p.add_argument("--inputs", type=lambda t: t.split(","), default=["png", "jpeg"], help="png and/or jpeg")
    p.add_argument("--max-batch-size", type=int, help="batching on (off is 1); default: the server's default")
    p.add_argument("--max-queue-delay-ms", type=float, help="default: the server's default")
    p.add_argument("--duration", type=float, help="measured seconds per served level (default 5)")
    p.add_argument("--warmup", type=float, help="discarded seconds before each served level (default 1.5)")
    p.add_argument("--raw-duration", type=float, help="seconds per raw batch size (default 3)")
    p.add_argument("--pairs", type=int, help="paired one-client measurements per server: a raw batch-1 call, "
                                             "then a served request, in turn (default 30; 0 = none)")
    p.add_argument("--bare", choices=("auto", "on", "off"), default="auto",
                   help="bare constant endpoint; auto = when raw batch-1 latency is under 5 ms (HTTP-bound)")
    p.add_argument("--time-limit", type=float, default=1800.0, help="seconds for the whole run; later levels skip")
    p.add_argument("--set", dest="settings", type=_setting, action="append", default=[], metavar="NAME=VALUE",
                   help="a server setting under test, e.g. --set intra_op_spinning=false (also for the raw session)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE, help="where preset models are exported")
    p.add_argument("--log-dir", type=Path, default=Path("build/bench-logs"), help="the servers' logs")
    p.add_argument("--quick", action="store_true", help="a smoke run: raw batch sizes 1,8; 1 and 8 clients; 1 s levels (flags given still win)")
    p.set_defaults(func=run_bench_command)


_QUICK = {"batch_sizes": [1, 8], "concurrency": [1, 8], "duration": 1.0, "warmup": 0.5, "raw_duration": 0.5,
          "pairs": 5}
_FULL = {"batch_sizes": [1, 8, 32], "concurrency": [1, 8, 32, 64], "duration": 5.0, "warmup": 1.5,
         "raw_duration": 3.0, "pairs": 30}


def config_from_args(args) -> BenchConfig:
    """Flags given win; the others come from the --quick or the full defaults."""
    base = _QUICK if args.quick else _FULL
    value = {k: getattr(args, k) if getattr(args, k) is not None else v for k, v in base.items()}
    bad = set(args.inputs) - {"png", "jpeg"}
    if bad:
        raise SystemExit(f"vitserve bench: unknown --inputs {sorted(bad)}; use png and/or jpeg")
    if args.max_batch_size is None:
        from service.settings import Settings
        args.max_batch_size = Settings().max_batch_size
    return BenchConfig(model=args.model, out=args.out, batch_sizes=value["batch_sizes"],
                       concurrency=value["concurrency"], inputs=args.inputs, max_batch_size=args.max_batch_size,
                       max_queue_delay_ms=args.max_queue_delay_ms, duration_s=value["duration"],
                       warmup_s=value["warmup"], raw_duration_s=value["raw_duration"], pairs=value["pairs"],
                       bare=args.bare,
                       time_limit_s=args.time_limit, cache_dir=args.cache_dir, log_dir=args.log_dir)


def run_bench_command(args) -> int:
    cfg = config_from_args(args)
    report = run_bench(cfg, dict(args.settings), command="vitserve bench " + " ".join(sys.argv[2:]))
    for path in write_report(report, cfg.out):
        print(f"wrote {path}")
    print("\n".join(_targets_lines(report["targets"])))
    return 0

