"""Starting and stopping the three servers, one at a time, each as its users start it, on 127.0.0.1.

- vitserve: `vitserve serve --model M --host 127.0.0.1 --port P` (bench/servers.py `serve_argv`), its defaults
  but for the log level (warning: no access log line per request; neither peer writes one); the working tree's
  code, or a commit's exported by `export_commit`.
- Triton: `python -m vitserve.bench.peers.triton_server` in the Triton venv, the repository on PYTHONPATH and the venv
  Python's library directory on LD_LIBRARY_PATH (the Python backend stub links libpython).
- LitServe: `python -m vitserve.bench.peers.litserve_server` in the LitServe venv, the repository on PYTHONPATH.
- the FastAPI app: `python -m uvicorn vitserve.bench.peers.fastapi_app:app` in vitserve's own environment.

Each runs in its own session (process group): a stop is SIGTERM, then after `grace_s` SIGKILL to the group, since
neither peer's children are sure to go with their parent (LitServe 0.2's workers outlive a SIGTERM). A server
starts only on ports nobody listens on and is ready when all its readiness paths answer 200 (Triton's models load
after the server is up); a stop waits until its ports are free again.
"""
from __future__ import annotations

import io
import os
import shutil
import signal
import subprocess
import tarfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from vitserve.bench.config import LOOPBACK
from vitserve.bench.peers.bodies import TRITON_IMAGE_MODEL, TRITON_TENSOR_MODEL
from vitserve.bench.servers import free_port, serve_argv
from vitserve.service.cli import port_is_free

REPO = Path(__file__).resolve().parents[2]


@dataclass
class ServerSpec:
    name: str
    argv: list[str]
    ports: list[int]  # the first is HTTP
    ready_paths: list[str]  # every one answers 200 when the server is ready
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return self.ports[0]


def vitserve_spec(model: Path, source: Path | None = None, ray_replicas: int | None = None,
                  grpc: bool = False, runtime: tuple[str, dict[str, str]] | None = None) -> ServerSpec:
    """`vitserve serve`, with the code in `source` (first on PYTHONPATH) when given; with `ray_replicas`,
    `vitserve serve --ray` with that many replicas (a local Ray cluster of its own); with `grpc`, its gRPC port
    second in `ports` (otherwise none: an older commit's server, which has no gRPC, ignores the variable); with
    `runtime` (a name, and its variables: `VITSERVE_RUNTIME`, `VITSERVE_PRECISION_HINT`), that runtime and
    precision instead of the server's default."""
    port, grpc_port = _distinct_free_ports(2) if grpc else (free_port(), 0)
    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": str(grpc_port),
           **({"PYTHONPATH": str(source.resolve())} if source else {})}
    argv = serve_argv(model.resolve(), port)
    name = "vitserve"
    if ray_replicas:
        argv += ["--ray", "--ray-replicas", str(ray_replicas)]
        env["RAY_USAGE_STATS_ENABLED"] = "0"
        name = f"vitserve-ray{ray_replicas}"
    if runtime:
        name, variables = runtime
        env.update(variables)
    if source:  # -P: the working directory (this repository) must not come first on the path and shadow `source`
        argv.insert(1, "-P")
    return ServerSpec(name, argv, [port, *([grpc_port] if grpc else [])], ["/v2/health/ready"], env)


def export_commit(rev: str, work_dir: Path) -> tuple[Path, str]:
    """The tree of commit `rev` as files under `work_dir` (`git archive`: the working tree and the index are not
    touched), and its full hash."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)
    if found.returncode:
        raise SystemExit(f"no commit {rev!r} in this repository")
    sha = found.stdout.strip()
    dest = work_dir / f"vitserve-{sha[:12]}"
    if not dest.is_dir():
        archive = subprocess.run(["git", "archive", "--format=tar", sha], cwd=REPO, capture_output=True, check=True)
        partial = dest.with_name(dest.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        with tarfile.open(fileobj=io.BytesIO(archive.stdout)) as tar:
            tar.extractall(partial, filter="data")
        partial.rename(dest)
    return dest, sha


def triton_spec(model: Path, python: Path, library_dir: str, openvino_precision: str | None = None,
                name: str = "triton") -> ServerSpec:
    """Triton (pytriton) serving `model` on ONNX Runtime, or with `openvino_precision` on OpenVINO at it."""
    http, grpc, metrics = _distinct_free_ports(3)
    argv = [str(python), "-m", "vitserve.bench.peers.triton_server", "--model", str(model.resolve()),
            "--http-port", str(http), "--grpc-port", str(grpc), "--metrics-port", str(metrics),
            *(["--openvino-precision", openvino_precision] if openvino_precision else [])]
    path = os.pathsep.join(p for p in (library_dir, os.environ.get("LD_LIBRARY_PATH", "")) if p)
    # tritonserver is ready before pytriton has loaded the models into it
    ready = [f"/v2/models/{model_name}/ready" for model_name in (TRITON_IMAGE_MODEL, TRITON_TENSOR_MODEL)]
    return ServerSpec(name, argv, [http, grpc, metrics], ["/v2/health/ready", *ready],
                      {"PYTHONPATH": str(REPO), "LD_LIBRARY_PATH": path})


def litserve_spec(model: Path, python: Path) -> ServerSpec:
    port = free_port()
    argv = [str(python), "-m", "vitserve.bench.peers.litserve_server", "--model", str(model.resolve()),
            "--port", str(port)]
    return ServerSpec("litserve", argv, [port], ["/health"], {"PYTHONPATH": str(REPO)})


def fastapi_spec(model: Path, python: Path) -> ServerSpec:
    """The 20-line FastAPI app under uvicorn as its docs start it (one process, log level warning as the others)."""
    port = free_port()
    argv = [str(python), "-m", "uvicorn", "vitserve.bench.peers.fastapi_app:app", "--host", LOOPBACK,
            "--port", str(port), "--log-level", "warning"]
    return ServerSpec("fastapi", argv, [port], ["/ready"], {"MODEL_PATH": str(model.resolve())})


def _distinct_free_ports(count: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class RunningServer:
    """A server in its own process group, ready when every readiness path answers 200; stopped on exit."""

    def __init__(self, spec: ServerSpec, log_path: Path, startup_timeout_s: float, grace_s: float = 30.0):
        self.spec, self.log_path = spec, log_path
        self.startup_timeout_s, self.grace_s = startup_timeout_s, grace_s
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        """Start it and wait until it is ready; RuntimeError (and nothing left running) when it cannot be."""
        busy = [p for p in self.spec.ports if not port_is_free(LOOPBACK, p)]
        if busy:
            raise RuntimeError(f"{self.spec.name}: port(s) {busy} already in use")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(self.spec.argv, env={**os.environ, **self.spec.env}, cwd=REPO, stdout=log,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            self._wait_ready(self.proc)
        except BaseException:
            self.stop()
            raise

    def cpu_seconds(self) -> float:
        """User and system CPU time of the server and every process under it so far: an answer's whole cost,
        its front end and its model process alike (a process that exits takes its share with it)."""
        import psutil
        if self.proc is None:
            raise RuntimeError(f"{self.spec.name} is not started")
        try:
            root = psutil.Process(self.proc.pid)
            processes = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return 0.0
        total = 0.0
        for process in processes:
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        return total

    def __enter__(self) -> RunningServer:  # an already started server: `with` only stops it
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def url(self) -> str:
        return f"http://{LOOPBACK}:{self.spec.port}"

    def _wait_ready(self, proc: subprocess.Popen) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"{self.spec.name} exited with code {proc.returncode} before it was ready; "
                                   f"its log ends:\n{self.log_path.read_text(errors='replace')[-2000:]}")
            if all(self._answers_200(path) for path in self.spec.ready_paths):
                return
            time.sleep(0.2)
        raise RuntimeError(f"{self.spec.name} not ready after {self.startup_timeout_s:.0f} s (log: {self.log_path})")

    def _answers_200(self, path: str) -> bool:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        """SIGTERM to the server, then SIGKILL to its whole group; returns when its ports are free."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=self.grace_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (start_new_session): children left behind
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)
        deadline = time.monotonic() + 30
        while any(not port_is_free(LOOPBACK, p) for p in self.spec.ports) and time.monotonic() < deadline:
            time.sleep(0.2)
        self.proc = None

