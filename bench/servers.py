"""Servers under test, each in its own process on 127.0.0.1: `vitserve serve` as a user starts it, and the bare
endpoint, started through the very function `vitserve serve` uses (`service.cli.serve_with_uvicorn`).

`python -m vitserve.bench.servers` runs the bare endpoint with settings from `VITSERVE_*` variables.
"""
from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from vitserve.bench.config import LOOPBACK, BenchConfig

READY_PATH = "/v2/health/ready"
QUIET_PORTS_FROM = 20000  # above Ray's worker ports (10002-19999)


def free_port() -> int:
    """A free port below the kernel's ephemeral range, which `bind(0)` and every outgoing connection draw from: a
    port picked there can be taken by some connection between the pick and the server's bind, seconds later when
    the server loads a model first (and Ray's metrics agent that cannot bind takes its raylet down)."""
    try:
        ephemeral_from = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_from = QUIET_PORTS_FROM
    quiet = range(QUIET_PORTS_FROM, ephemeral_from)
    for port in random.sample(quiet, k=min(200, len(quiet))):
        with socket.socket() as s:
            try:
                s.bind((LOOPBACK, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no quiet range here: the kernel's pick
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def serve_argv(model_path: Path, port: int) -> list[str]:
    """The user's own command: `vitserve serve`, in a child process, on loopback."""
    return [sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model_path), "--host", LOOPBACK,
            "--port", str(port)]


def bare_argv() -> list[str]:
    return [sys.executable, "-m", "vitserve.bench.servers"]


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
    env.setdefault("VITSERVE_GRPC_PORT", "0")  # the HTTP bench: no port 8001 to collide on
    return env


class ServerProcess:
    """A server in a child process on 127.0.0.1, ready when GET `ready_path` answers 200; stopped on exit."""

    def __init__(self, argv: list[str], port: int, ready_path: str = READY_PATH, env: dict[str, str] | None = None,
                 startup_timeout_s: float = 180.0, log_path: Path | None = None):
        self.argv, self.port, self.ready_path = argv, port, ready_path
        self.env = {**os.environ, **(env or {})}
        self.startup_timeout_s = startup_timeout_s
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> ServerProcess:
        log = open(self.log_path, "wb") if self.log_path else subprocess.DEVNULL
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL)
        if not isinstance(log, int):  # the child holds its own copy of the log file; DEVNULL is a constant
            log.close()
        try:
            self._wait_ready(self.proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        url = f"http://{LOOPBACK}:{self.port}{self.ready_path}"
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} before it was ready"
                                   f"{self._log_tail()}")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200 and self._every_worker_ready():
                        return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"server not ready after {self.startup_timeout_s:.0f} s{self._log_tail()}")

    def _every_worker_ready(self) -> bool:
        """A vitserve server is ready when its first worker is; a measurement waits for all of them, or the
        connections it opens land on the few already up (on a 16-core GPU machine 6 of 14 took the first level's).
        A server without these metrics (a peer, the bare app) counts as ready."""
        workers = scrape_metrics(self.port, WORKER_METRICS)
        return len(workers) < 2 or workers["vitserve_http_workers_ready"] >= workers["vitserve_http_workers"]

    def _log_tail(self) -> str:
        if not self.log_path or not self.log_path.exists():
            return ""
        return "; its log ends:\n" + self.log_path.read_text(errors="replace")[-2000:]

    @property
    def pid(self) -> int:
        """The server's process id, inside `with`: a server not yet started has none."""
        if self.proc is None:
            raise RuntimeError("the server is not started: use it inside `with`")
        return self.proc.pid

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


WORKER_METRICS = ("vitserve_http_workers_ready", "vitserve_http_workers")


def metric_samples(port: int) -> list:
    """Every sample of the server's /metrics now (prometheus_client's Sample: name, labels, value); none when it
    does not answer."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(f"http://{LOOPBACK}:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return []
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def scrape_metrics(port: int, names: tuple[str, ...]) -> dict[str, float]:
    """Current values of Prometheus samples (e.g. `vitserve_batch_size_sum`), summed over their labels (every
    model version's); absent ones are left out."""
    values: dict[str, float] = {}
    for sample in metric_samples(port):
        if sample.name in names:
            values[sample.name] = values.get(sample.name, 0.0) + sample.value
    return values


# The server's own account of where a level's time went (service/ground/metrics.py), differenced over the level
STAGE_METRICS = ("vitserve_batches_total", "vitserve_images_total", "vitserve_batch_seconds_total",
                 "vitserve_batch_stack_seconds_total", "vitserve_queue_wait_seconds_sum",
                 "vitserve_queue_wait_seconds_count", "vitserve_preprocess_seconds_sum",
                 "vitserve_preprocess_seconds_count", "vitserve_postprocess_seconds_sum",
                 "vitserve_postprocess_seconds_count")


def server_stages(before: dict[str, float], after: dict[str, float], wall_s: float) -> dict[str, float]:
    """A level's batches as the server counted them: mean batch size, how busy the engine's runner was (its calls'
    time over the level's wall time: near 1, the runner is the limit; well below, the requests' way to it is), ms per
    call and per stack, and per image the queue wait, preprocessing and postprocessing. Empty without the figures."""
    delta = {name: after.get(name, 0.0) - before.get(name, 0.0) for name in STAGE_METRICS}
    batches = delta["vitserve_batches_total"]
    if batches <= 0 or wall_s <= 0:
        return {}
    stages = {"mean_batch": round(delta["vitserve_images_total"] / batches, 1),
              "runner_busy": round(delta["vitserve_batch_seconds_total"] / wall_s, 2),
              "call_ms": round(1000 * delta["vitserve_batch_seconds_total"] / batches, 2),
              "stack_ms": round(1000 * delta["vitserve_batch_stack_seconds_total"] / batches, 2)}
    for stage in ("queue_wait", "preprocess", "postprocess"):
        count = delta[f"vitserve_{stage}_seconds_count"]
        if count > 0:
            stages[f"{stage}_ms"] = round(1000 * delta[f"vitserve_{stage}_seconds_sum"] / count, 2)
    return stages


def bare_app():
    """A FastAPI app whose classify endpoint reads the upload and returns a constant: the HTTP floor."""
    from fastapi import Body, FastAPI

    app = FastAPI(title="vitserve bench: bare endpoint")
    constant = {"model": {"name": "bare", "version": "0"}, "predictions": [{"index": 0, "label": "x", "score": 1.0}]}

    @app.post("/v1/classify")
    async def classify(image: bytes = Body(media_type="image/png")) -> dict:
        return constant

    @app.get(READY_PATH)
    async def ready() -> dict:
        return {"ready": True}

    return app


def run_bare_server() -> None:
    """Serve `bare_app` exactly as `vitserve serve` serves its app, with settings from `VITSERVE_*`."""
    from vitserve.service.cli import serve_with_uvicorn
    from vitserve.service.ground.settings import Settings

    serve_with_uvicorn("vitserve.bench.servers:bare_app", Settings())


if __name__ == "__main__":
    run_bare_server()
