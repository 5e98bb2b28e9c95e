"""`vitserve bench --mode repository`: what serving a repository costs and whether a live swap loses anything,
measured on a real `vitserve serve --model-repository` (explicit control mode) as a user starts it.

- swap under load: `clients` closed-loop clients on model `small` while a new version is loaded (and the old one
  unloaded by the latest-1 policy), `swaps` times in a row: every answer's status, and its version against the
  versions that were ready;
- memory: `cycles` load/unload cycles of one version, the engine process's RSS after each;
- an idle second model: `small`'s throughput alone, then with `big` loaded and idle, alternating rounds;
- overload isolation: `small`'s latency at one client, with `big` idle and with `big` flooded by `flood` clients.

Writes a Markdown report and its JSON. Only the standard library and httpx: the server is a child process.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from vitserve.bench.config import add_config_flags
from vitserve.bench.presets import resolve_model
from vitserve.bench.servers import free_port

ADMIN_KEY = "bench-admin-key"
AUTH = {"Authorization": f"Bearer {ADMIN_KEY}"}
ENGINE_NAME = "vitserve-engine"  # service/engine/server.py's PROCESS_NAME
BURNER = ("import os, numpy as np\nos.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))\n"
          "x = np.ones((1024, 1024), np.float32)\nwhile True:\n    x @ x")


@dataclass
class RepositoryBenchConfig:
    small: str = "models/vit-fmnist/model.onnx"
    big: str = "vit-s16"
    clients: int = 32
    swaps: int = 20
    cycles: int = 50
    rounds: int = 3
    seconds: float = 8.0
    flood: int = 64
    big_threads: int = 0  # the big model's intra_op_threads in its config.json; 0: the server's default
    big_priority: str = "normal"  # the big model's cpu_priority in its config.json
    out: Path = Path("build/bench/repository.md")
    cache_dir: Path = Path("build/bench/models")


@dataclass
class Report:
    config: dict
    swap: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    idle_model: dict = field(default_factory=dict)
    isolation: dict = field(default_factory=dict)


def place(root: Path, name: str, version: int, model: Path) -> None:
    folder = root / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / "model.onnx.partial"  # a whole file appears at once (the server reads only model.onnx)
    shutil.copyfile(model, partial)
    partial.replace(folder / "model.onnx")


class Server:
    """`vitserve serve --model-repository ROOT --model-control-mode explicit` on a free port."""

    def __init__(self, root: Path, load: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "vitserve.cli", "serve", "--model-repository", str(root), "--port",
                str(self.port), "--model-control-mode", "explicit", "--admin-key", ADMIN_KEY, "--log-level",
                "warning", "--grpc-port", "0", *[arg for name in load for arg in ("--load-model", name)]]
        self.process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited with {self.process.returncode}")
            try:
                if httpx.get(f"{self.url}/v2/health/ready", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise SystemExit("the server was not ready in 300 s")

    def engine_rss_mib(self) -> float:
        """The engine process's resident memory (the child of the server named vitserve-engine)."""
        for status in Path("/proc").glob("[0-9]*/status"):
            try:
                text = status.read_text()
            except OSError:
                continue
            fields = dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)
            if fields.get("Name", "").strip() == ENGINE_NAME and int(fields["PPid"]) == self.process.pid:
                return int(fields["VmRSS"].split()[0]) / 1024
        raise RuntimeError("no engine process found")

    def control(self, op: str, name: str) -> float:
        started = time.perf_counter()
        reply = httpx.post(f"{self.url}/v2/repository/models/{name}/{op}", headers=AUTH, timeout=600)
        if reply.status_code != 200:
            raise RuntimeError(f"{op} {name}: {reply.status_code} {reply.text}")
        return time.perf_counter() - started

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()


async def closed_loop(url: str, model: str, clients: int, seconds: float, body: bytes, params: dict | None = None,
                      stop: asyncio.Event | None = None) -> list[tuple[int, str, float]]:
    """`clients` clients, each sending its next request when the last is answered, for `seconds` (or until
    `stop`): (status, version, seconds) per answer."""
    answers: list[tuple[int, str, float]] = []
    ends = time.monotonic() + seconds
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(base_url=url, timeout=60, limits=limits) as client:
        async def one_client():
            while time.monotonic() < ends and not (stop and stop.is_set()):
                started = time.perf_counter()
                reply = await client.post("/v1/classify", content=body, headers={"content-type": "image/png"},
                                          params={"model": model, "map": "none", **(params or {})})
                version = reply.json().get("model", {}).get("version", "") if reply.status_code == 200 else ""
                answers.append((reply.status_code, version, time.perf_counter() - started))
        await asyncio.gather(*(one_client() for _ in range(clients)))
    return answers


async def _throughput(url: str, cfg: RepositoryBenchConfig, body: bytes, root: Path) -> float:
    """`small`'s answered 200s per second under `cfg.clients` closed-loop clients, after a 1 s settling run."""
    wrk = shutil.which("wrk")
    if wrk is None:
        await closed_loop(url, "small", cfg.clients, 1.0, body)
        answers = await closed_loop(url, "small", cfg.clients, cfg.seconds, body)
        return sum(1 for s, _, _ in answers if s == 200) / cfg.seconds
    from vitserve.bench.peers.bodies import PeerRequest
    from vitserve.bench.peers.wrk import run_wrk, write_script, wrk_argv
    script = write_script(root.parent / "wrk", "small", PeerRequest("/v1/classify", body, {"Content-Type":
                                                                                          "image/png"}))
    target = f"{url}/v1/classify?model=small&map=none"
    await asyncio.to_thread(run_wrk, wrk_argv(wrk, target, cfg.clients, 1, 30, script), 60)
    result = await asyncio.to_thread(run_wrk, wrk_argv(wrk, target, cfg.clients, round(cfg.seconds), 30, script),
                                     cfg.seconds + 60)
    return result["ok_per_s"]


def count_statuses(answers: list[tuple[int, str, float]]) -> dict[str, int]:
    """Answers per status code, as {"200": n, ...}."""
    return dict(Counter(str(status) for status, _, _ in answers))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def sample_png() -> bytes:
    import io

    from PIL import Image
    buffer = io.BytesIO()
    Image.new("L", (28, 28), 128).save(buffer, "PNG")
    return buffer.getvalue()


async def swap_under_load(cfg: RepositoryBenchConfig, small: Path, root: Path, body: bytes) -> dict:
    server = Server(root, ["small"])
    try:
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(server.url, "small", cfg.clients, 10_000, body, stop=stop))
        await asyncio.sleep(2)
        load_times, ready_versions = [], {"1"}
        for version in range(2, cfg.swaps + 2):
            place(root, "small", version, small)
            load_times.append(await asyncio.to_thread(server.control, "load", "small"))
            ready_versions.add(str(version))
            await asyncio.sleep(0.5)
        stop.set()
        answers = await load
    finally:
        server.stop()
    statuses = count_statuses(answers)
    versions = {v for s, v, _ in answers if s == 200}
    return {"answers": len(answers), "statuses": statuses, "versions_seen": sorted(versions, key=int),
            "all_from_ready_versions": versions <= ready_versions, "swaps": cfg.swaps,
            "load_s_median": statistics.median(load_times), "load_s_max": max(load_times),
            "p50_ms": 1000 * percentile([t for _, _, t in answers], 0.5),
            "p99_ms": 1000 * percentile([t for _, _, t in answers], 0.99)}


def memory_cycles(cfg: RepositoryBenchConfig, root: Path) -> dict:
    server = Server(root, [])
    try:
        rss = []
        for _ in range(cfg.cycles):
            server.control("load", "small")
            server.control("unload", "small")
            rss.append(round(server.engine_rss_mib(), 1))
    finally:
        server.stop()
    return {"cycles": cfg.cycles, "rss_mib": rss, "first": rss[0], "last": rss[-1], "ratio": rss[-1] / rss[0]}


async def idle_second_model(cfg: RepositoryBenchConfig, root: Path, body: bytes) -> dict:
    """`small`'s throughput alone and beside an idle `big`, alternating rounds in one server. The load is wrk (C,
    little CPU of its own on a machine the server shares), else these Python clients."""
    server = Server(root, ["small"])
    rates: dict[str, list[float]] = {"alone": [], "beside_idle_big": []}
    try:
        for _ in range(cfg.rounds):
            for case in ("alone", "beside_idle_big"):
                await asyncio.to_thread(server.control, "load" if case != "alone" else "unload", "big")
                rates[case].append(await _throughput(server.url, cfg, body, root))
    finally:
        server.stop()
    alone, beside = statistics.median(rates["alone"]), statistics.median(rates["beside_idle_big"])
    return {"rates": rates, "alone_rps": alone, "beside_idle_big_rps": beside, "ratio": beside / alone}


async def isolation(cfg: RepositoryBenchConfig, root: Path, body: bytes, big_body: bytes) -> dict:
    """`small` at one client: with `big` idle, then with `big` flooded (its 429s are expected, `small`'s not).
    The flood is wrk, a process of its own as a remote load would be, where it is installed (else these Python
    clients, whose work shares this process's event loop with the one measuring `small`)."""
    server = Server(root, ["small", "big"])
    try:
        idle = await closed_loop(server.url, "small", 1, cfg.seconds, body)
        flood = asyncio.create_task(_flood(server.url, cfg, big_body, root))
        await asyncio.sleep(2)
        loaded = await closed_loop(server.url, "small", 1, cfg.seconds, body)
        big_statuses, flooded_by = await flood
        # The floor no server can go under: compute that shares nothing with the server but the machine (a
        # process per core, at the lowest priority the kernel has) still costs `small` its caches and cores.
        one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        burners = [subprocess.Popen([sys.executable, "-c", BURNER], env=one_thread) for _ in range(os.cpu_count() or 1)]
        try:
            await asyncio.sleep(1)
            beside_burners = await closed_loop(server.url, "small", 1, cfg.seconds, body)
        finally:
            for burner in burners:
                burner.kill()
                burner.wait()
    finally:
        server.stop()

    def summary(answers):
        times = [t for s, _, t in answers if s == 200]
        return {"answers": len(answers), "non_200": sum(1 for s, _, _ in answers if s != 200),
                "p50_ms": 1000 * percentile(times, 0.5), "p99_ms": 1000 * percentile(times, 0.99)}
    return {"small_big_idle": summary(idle), "small_big_flooded": summary(loaded), "big_statuses": big_statuses,
            "flooded_by": flooded_by, "small_beside_idle_burners": summary(beside_burners)}


async def _flood(url: str, cfg: RepositoryBenchConfig, body: bytes, root: Path) -> tuple[dict[str, int], str]:
    """`cfg.flood` closed-loop clients on `big` for the 2 s before and the `cfg.seconds` of the measurement:
    (answers per status, what sent them)."""
    seconds = cfg.seconds + 3
    wrk = shutil.which("wrk")
    if wrk is None:
        stop = asyncio.Event()
        asyncio.get_running_loop().call_later(seconds, stop.set)
        answers = await closed_loop(url, "big", cfg.flood, 10_000, body, stop=stop)
        return count_statuses(answers), "httpx in the bench process"
    from vitserve.bench.peers.bodies import PeerRequest
    from vitserve.bench.peers.wrk import parse_statuses, run_wrk, write_script, wrk_argv
    script = write_script(root.parent / "wrk", "big", PeerRequest("/v1/classify", body, {"Content-Type":
                                                                                        "image/png"}))
    argv = wrk_argv(wrk, f"{url}/v1/classify?model=big&map=none", cfg.flood, round(seconds), 30,
                    script.with_suffix(".status.lua"))
    result = await asyncio.to_thread(run_wrk, argv, seconds + 60)
    return parse_statuses(result["wrk_output"]), "wrk"


def render(report: Report) -> str:
    s, m, i, o = report.swap, report.memory, report.idle_model, report.isolation
    lines = ["# Serving a repository: live swaps, memory, a second model", "",
             f"`python -m vitserve.bench.repository` ({json.dumps(report.config)})", ""]
    if s:
        lines += ["## Swap under load", "",
                  f"{s['swaps']} loads of a new version of `small` (the old one unloaded by the latest-1 policy) "
                  f"under {report.config['clients']} closed-loop clients: {s['answers']} answers, statuses "
                  f"{s['statuses']}, versions seen {', '.join(s['versions_seen'])}, every one from a ready version: "
                  f"{s['all_from_ready_versions']}. A load took {s['load_s_median']:.2f} s (median), "
                  f"{s['load_s_max']:.2f} s at most; latency over the run p50 {s['p50_ms']:.1f} ms, p99 "
                  f"{s['p99_ms']:.1f} ms.", ""]
    if m:
        lines += ["## Memory over load/unload cycles", "",
                  f"{m['cycles']} cycles of loading and unloading `small`: the engine's RSS after the first "
                  f"{m['first']:.1f} MiB, after the last {m['last']:.1f} MiB ({m['ratio']:.3f}x).", "",
                  "RSS after each cycle (MiB): " + ", ".join(f"{v:.1f}" for v in m["rss_mib"]), ""]
    if i:
        lines += ["## An idle second model", "",
                  f"`small` alone {i['alone_rps']:.1f} req/s, beside an idle `big` {i['beside_idle_big_rps']:.1f} "
                  f"req/s: {i['ratio']:.3f}x (medians of {report.config['rounds']} alternating rounds: "
                  f"{i['rates']}).", ""]
    if o:
        a, b = o["small_big_idle"], o["small_big_flooded"]
        lines += ["## Overload of one model, latency of the other", "",
                  f"`small` at one client, `big` idle: p50 {a['p50_ms']:.1f} ms, p99 {a['p99_ms']:.1f} ms "
                  f"({a['non_200']} of {a['answers']} not 200). With `big` flooded by {report.config['flood']} "
                  f"clients ({o.get('flooded_by', 'httpx')}; its answers: {o['big_statuses']}): "
                  f"p50 {b['p50_ms']:.1f} ms, p99 {b['p99_ms']:.1f} "
                  f"ms ({b['non_200']} of {b['answers']} not 200).", ""]
        if "small_beside_idle_burners" in o:
            c = o["small_beside_idle_burners"]
            lines += [f"The machine's floor: `small` beside a matrix-multiplying process per core at SCHED_IDLE, "
                      f"sharing nothing with the server: p50 {c['p50_ms']:.1f} ms, p99 {c['p99_ms']:.1f} ms.", ""]
    return "\n".join(lines)


async def run(cfg: RepositoryBenchConfig, parts: list[str]) -> Report:
    small, big = resolve_model(cfg.small, cfg.cache_dir), resolve_model(cfg.big, cfg.cache_dir)
    body, report = sample_png(), Report({k: str(v) for k, v in asdict(cfg).items()})
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-repo-") as directory:
        root = Path(directory) / "repository"  # beside it, wrk's scripts (bench/repository.py `_throughput`)
        place(root, "small", 1, small)
        place(root, "big", 1, big)
        big_config = {k: v for k, v in (("intra_op_threads", cfg.big_threads), ("cpu_priority", cfg.big_priority))
                      if v and v != "normal"}
        if big_config:
            (root / "big" / "config.json").write_text(json.dumps(big_config))
        if "swap" in parts:
            report.swap = await swap_under_load(cfg, small, root, body)
            shutil.rmtree(root / "small")
            place(root, "small", 1, small)
        if "memory" in parts:
            report.memory = await asyncio.to_thread(memory_cycles, cfg, root)
        if "idle" in parts:
            report.idle_model = await idle_second_model(cfg, root, body)
        if "isolation" in parts:
            import io

            from PIL import Image
            buffer = io.BytesIO()
            Image.new("RGB", (224, 224), (120, 60, 30)).save(buffer, "PNG")
            report.isolation = await isolation(cfg, root, body, buffer.getvalue())
    return report


def main(argv: list[str] | None = None) -> int:
    d = RepositoryBenchConfig()
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.repository", description=__doc__.split("\n\n")[0])
    add_config_flags(p, d)
    p.add_argument("--parts", default="swap,memory,idle,isolation", help="which measurements, comma-separated")
    args = vars(p.parse_args(argv))
    parts = args.pop("parts").split(",")
    cfg = RepositoryBenchConfig(**args)
    report = asyncio.run(run(cfg, parts))
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(render(report) + "\n")
    cfg.out.with_suffix(".json").write_text(json.dumps(asdict(report), indent=1) + "\n")
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
