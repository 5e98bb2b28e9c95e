"""The GPU kit's served measure: a real `vitserve serve`, loaded by wrk on cores of its own, the GPU watched.

A Python client on the same cores as the server could not say whether the server or the client was the limit.
Here the load is Debian's `wrk` (C, a few percent of
a core per thousand requests/s) pinned with `taskset` to the last `client_cores` cores, the server to the others,
and each level reports the client's CPU beside the server's and the GPU's utilisation sampled by `nvidia-smi`
while the level ran, and how the clients and the CPU fell on the HTTP workers (`worker_split`). The body is one
JPEG sent raw (`Content-Type: image/jpeg`) to `/v1/classify`.
"""
from __future__ import annotations

import os
import resource
import shutil
import subprocess
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.wrk import parse_wrk, write_script
from vitserve.bench.servers import STAGE_METRICS, ServerProcess, free_port, scrape_metrics, serve_argv, server_stages
from vitserve.machine import main_thread_cpu_seconds, process_cpu_seconds, process_tree


def split_cores(client_cores: int) -> tuple[list[int], list[int]]:
    """(server cores, client cores) out of this process's affinity: the client takes the last ones."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) <= client_cores:
        return cores, cores  # one core or two: nothing to split, both share
    return cores[:-client_cores], cores[-client_cores:]


def taskset(cores: list[int], argv: list[str]) -> list[str]:
    return ["taskset", "-c", ",".join(map(str, cores)), *argv] if shutil.which("taskset") else argv


class GpuSampler:
    """`nvidia-smi` printing the GPU's utilisation every `interval_ms` while the `with` block runs."""

    def __init__(self, interval_ms: int = 100):
        self.interval_ms = interval_ms
        self.samples: list[tuple[float, ...]] = []  # (utilisation %, memory MiB) per line of nvidia-smi

    @contextmanager
    def sampling(self):
        smi = shutil.which("nvidia-smi")
        if smi is None:
            yield self
            return
        proc = subprocess.Popen([smi, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits",
                                 f"-lms={self.interval_ms}"], stdout=subprocess.PIPE, text=True)
        try:
            yield self
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
            self.samples = [tuple(float(v) for v in line.split(",")) for line in out.splitlines() if numeric(line)]

    def summary(self) -> dict:
        if not self.samples:
            return {"gpu_util_mean": None, "gpu_util_samples": 0}
        util = sorted(s[0] for s in self.samples)
        # the first and last samples straddle the level's start and end
        inner = util if len(util) < 5 else sorted(s[0] for s in self.samples[1:-1])
        return {"gpu_util_mean": sum(inner) / len(inner), "gpu_util_median": inner[len(inner) // 2],
                "gpu_memory_mib_max": max(s[1] for s in self.samples), "gpu_util_samples": len(self.samples)}


def numeric(line: str) -> bool:
    """A sample line of nvidia-smi's CSV ("37, 4577"), not a header or a warning."""
    return line.count(",") == 1 and line.replace(",", "").replace(" ", "").replace(".", "").isdigit()


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@dataclass(frozen=True)
class CpuSnapshot:
    """The CPU seconds so far of each of the server's processes, and of each one's main thread, where an HTTP
    worker and the engine run their event loops: a loop near a whole core is where requests queue."""
    process_s: dict[int, float]
    loop_s: dict[int, float]


def cpu_snapshot(pids: list[int]) -> CpuSnapshot:
    return CpuSnapshot({pid: process_cpu_seconds(pid) for pid in pids},
                       {pid: main_thread_cpu_seconds(pid) for pid in pids})


def connections_on(pids: list[int], port: int) -> dict[int, int]:
    """Each process's established TCP connections on local `port` (an HTTP worker's clients), by pid; a process
    holding none is left out, and so is every process without psutil."""
    try:
        import psutil
    except ImportError:
        return {}
    counts = {}
    for pid in pids:
        try:
            proc = psutil.Process(pid)  # net_connections is psutil 6's name; the GPU machine's may be older
            listed = proc.net_connections("tcp") if hasattr(proc, "net_connections") else proc.connections("tcp")
        except psutil.Error:
            continue
        held = sum(1 for c in listed if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)
        if held:
            counts[pid] = held
    return counts


def worker_split(before: CpuSnapshot, after: CpuSnapshot, connections: dict[int, int], wall_s: float) -> dict:
    """How a level's clients and CPU fell on the server's processes: the clients each HTTP worker held (a process
    with connections on the port), most first; the busiest worker's cores and its event loop's (near 1: that loop
    is the limit, however idle the others); and the cores of the processes holding none (the engine, the
    supervisors) with the busiest of their loops (the engine's: every worker's requests pass through it). The
    kernel hands a shared socket's connections to whichever worker accepts first, so the split is seldom even
    (docs/results/bench-gpu.md)."""
    if not connections or wall_s <= 0:
        return {}

    def cores(seconds_before: dict[int, float], seconds_after: dict[int, float]) -> dict[int, float]:
        # a process gone meanwhile reads 0 seconds after: it counts for nothing, not for less than nothing
        return {pid: max(0.0, seconds_after[pid] - seconds_before.get(pid, 0.0)) / wall_s for pid in seconds_after}

    process, loop = cores(before.process_s, after.process_s), cores(before.loop_s, after.loop_s)
    busiest = max(connections, key=lambda pid: process.get(pid, 0.0))
    others = [pid for pid in process if pid not in connections]
    return {"worker_clients": "/".join(str(n) for n in sorted(connections.values(), reverse=True)),
            "busiest_worker_cores": round(process.get(busiest, 0.0), 2),
            "busiest_worker_loop_cores": round(loop.get(busiest, 0.0), 2),
            "other_cores": round(sum(process[pid] for pid in others), 2),
            "busiest_other_loop_cores": round(max((loop.get(pid, 0.0) for pid in others), default=0.0), 2)}


def served_levels(model: Path, jpeg: bytes, concurrency: list[int], duration_s: int, env: dict[str, str],
                  wrk: str, work: Path, client_cores: int = 2, query: str = "map=none") -> dict:
    """wrk at each concurrency against one `vitserve serve` of `model`; per level req/s, latency, the client's and
    the server's cores, and the GPU's utilisation."""
    server_cores, wrk_cores = split_cores(client_cores)
    port = free_port()
    script = write_script(work / "wrk", f"jpeg-{len(jpeg)}", PeerRequest("/v1/classify?" + query, jpeg,
                                                                         {"Content-Type": "image/jpeg"}))
    url = f"http://127.0.0.1:{port}/v1/classify?{query}"
    levels = []
    argv = taskset(server_cores, serve_argv(model, port))
    with ServerProcess(argv, port, env=env, log_path=work / f"{model.stem}-served.log", startup_timeout_s=600) as srv:
        for clients in concurrency:
            threads = min(clients, len(wrk_cores), 2) or 1
            wrk_argv = taskset(wrk_cores, [wrk, "-t", str(threads), "-c", str(clients), "-d", "1s", "--timeout",
                                           "10s", "-s", str(script), url])
            subprocess.run(wrk_argv, capture_output=True, timeout=60)  # warm-up: connections, buckets, caches
            wrk_argv[wrk_argv.index("-d") + 1] = f"{duration_s}s"
            wrk_argv.insert(-1, "--latency")
            stages_before = scrape_metrics(port, STAGE_METRICS)
            pids = process_tree(srv.pid)
            sampler, client_before, server_before = GpuSampler(), children_cpu_s(), cpu_snapshot(pids)
            started = time.monotonic()
            with sampler.sampling():
                with subprocess.Popen(wrk_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as load:
                    try:
                        time.sleep(duration_s / 2)  # every connection open and busy: who holds them
                        connections = connections_on(pids, port)
                        stdout, stderr = load.communicate(timeout=duration_s + 60)
                    except BaseException:  # a wrk that hangs (or an interrupt) does not outlive the level
                        load.kill()
                        raise
            wall = time.monotonic() - started
            server_after = cpu_snapshot(pids)
            stages = server_stages(stages_before, scrape_metrics(port, STAGE_METRICS), wall)
            if load.returncode != 0:
                raise RuntimeError(f"wrk exited {load.returncode}: {stderr[-500:]}")
            result = parse_wrk(stdout)
            levels.append({"concurrency": clients, **{k: result.get(k) for k in (
                "requests_per_s", "ok_per_s", "p50_ms", "p90_ms", "p99_ms", "non_2xx", "socket_errors")},
                "client_cores": round((children_cpu_s() - client_before) / wall, 2),
                "server_cores": round((sum(server_after.process_s.values()) - sum(server_before.process_s.values()))
                                      / wall, 2),
                **worker_split(server_before, server_after, connections, wall), **stages, **sampler.summary()})
            print(f"  served {clients:3d} clients: {result['ok_per_s']:8.1f} req/s 2xx  p99 {result.get('p99_ms')} ms"
                  f"  GPU {levels[-1].get('gpu_util_mean')}%", flush=True)
    return {"server_cores": server_cores, "client_cores": wrk_cores, "jpeg_bytes": len(jpeg), "query": query,
            "levels": levels}
