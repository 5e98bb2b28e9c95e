"""What a measured window records: latency percentiles, and the CPU each party used while it was open."""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from vitserve.machine import machine_busy_seconds, process_tree_cpu_seconds


def latency_summary(latencies_s: list[float] | np.ndarray) -> dict[str, float]:
    """p50/p90/p99/mean in milliseconds; NaN when there is nothing to summarise."""
    if len(latencies_s) == 0:
        return {"p50_ms": float("nan"), "p90_ms": float("nan"), "p99_ms": float("nan"), "mean_ms": float("nan")}
    ms = np.asarray(latencies_s, dtype=np.float64) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"p50_ms": float(p50), "p90_ms": float(p90), "p99_ms": float(p99), "mean_ms": float(ms.mean())}


def timed_calls(run, seconds: float, min_calls: int = 3, max_calls: int | None = None) -> list[float]:
    """Seconds per call of `run()`, called for `seconds` and at least `min_calls` (at most `max_calls`) times."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while (max_calls is None or len(times) < max_calls) and (len(times) < min_calls or time.perf_counter() < end):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def alternating_rounds_ms(calls: dict, rounds: int, seconds: float) -> dict[str, list[float]]:
    """ms per call of each of `calls` (name -> a no-argument callable) in each of `rounds` rounds, each run for
    `seconds` (at least 3 calls) per round, the order reversed every other round: this machine's speed drifts, so
    only figures of the same round compare."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for round_ in range(rounds):
        order = list(calls.items())
        for name, call in order if round_ % 2 == 0 else reversed(order):
            times[name].append(1000 * float(np.mean(timed_calls(call, seconds))))
    return times


@dataclass
class CpuSnapshot:
    """CPU seconds used so far by the server (its process and their children: HTTP workers, engines), this
    process, and the whole machine (busy, all cores)."""

    wall: float
    server: float
    client: float
    machine: float

    @classmethod
    def take(cls, server_pid: int | None) -> CpuSnapshot:
        return cls(time.perf_counter(), process_tree_cpu_seconds(server_pid), time.process_time(),
                   machine_busy_seconds())

    def usage(self, later: CpuSnapshot) -> dict[str, float]:
        """Average cores busy between two snapshots: server, client, and everything else on the machine."""
        wall = max(later.wall - self.wall, 1e-9)
        server = (later.server - self.server) / wall
        client = (later.client - self.client) / wall
        other = (later.machine - self.machine) / wall - server - client
        return {"server_cores": server, "client_cores": client, "other_cores": max(other, 0.0)}
