"""One `vitserve bench` run, phase by phase: the raw session, then real `vitserve serve` processes under closed-loop
load (batching on, then off, each with the paired one-client measurement), then for HTTP-bound models the bare
endpoint. Returns the report that bench/report.py renders.
"""
from __future__ import annotations

import asyncio
import os
import platform
import time
from dataclasses import asdict
from pathlib import Path
from typing import Protocol

from vitserve.bench.config import LOOPBACK, BenchConfig, with_server_defaults
from vitserve.bench.load import closed_loop, encode_request, make_images, paired_one_client, settle
from vitserve.bench.measure import CpuSnapshot
from vitserve.bench.presets import resolve_model
from vitserve.bench.raw import load_raw_model, model_summary, preprocessed, raw_phase
from vitserve.bench.report import targets
from vitserve.bench.servers import ServerProcess, bare_argv, free_port, scrape_metrics, serve_argv, server_settings
from vitserve.machine import cpu_model_name, load_average

_BATCH_METRICS = ("vitserve_batch_size_sum", "vitserve_batch_size_count", "vitserve_inference_seconds_sum")


class Budget:
    """The run's time limit: levels check it before they start, so a run ends at most one level past it."""

    def __init__(self, limit_s: float):
        self.deadline = time.monotonic() + limit_s

    def allows(self, seconds: float) -> bool:
        return time.monotonic() + seconds <= self.deadline


def run_bench(cfg: BenchConfig, overrides: dict[str, str], command: str = "vitserve bench") -> dict:
    """Everything, in one run; returns the report (also what the Markdown, JSON and plot are made from)."""
    budget = Budget(cfg.time_limit_s)
    cfg = with_server_defaults(cfg)
    model_path = resolve_model(cfg.model, cfg.cache_dir)
    cfg.log_dir.mkdir(parents=True, exist_ok=True)
    env = environment()
    model = load_raw_model(model_path, server_settings(cfg, overrides, batching=True))
    summary = model_summary(model, model_path)
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
    env.update(loadavg_end=load_average(), other_cores_mean=other, contended=bool(other > 0.25))
    settings = {**asdict(cfg), "server_settings": overrides,
                "load_generator": "asyncio keep-alive HTTP/1.1 client in the bench process"}
    report = {"command": command, "model": summary, "environment": env, "settings": settings,
              "raw": raw, "served": served, "paired": paired, "bare": bare}
    report["targets"] = targets(report)
    return report


def environment() -> dict:
    import onnxruntime

    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "onnxruntime": onnxruntime.__version__,
            "python": platform.python_version(), "cpu": cpu_model_name(), "cpus": os.cpu_count(),
            "loadavg_start": load_average()}


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
        log_path = cfg.log_dir / f"bench-server-batching-{label}.log"
        print(f"served, batching {label} (server log: {log_path})", flush=True)
        with ServerProcess(serve_argv(model_path, port), port, env=server_settings(cfg, overrides, batching),
                           log_path=log_path) as server:
            rows += run_levels(server, payloads, cfg, budget, app="served", batching=label)
            if pairing and cfg.pairs > 0 and budget.allows(cfg.pairs * 0.5):
                paired.append({"batching": label, **paired_level(server, pairing, cfg)})
                p = paired[-1]
                print(f"  paired one client, batching {label}: raw p50 {p['raw_p50_ms']:.2f} ms, served p50 "
                      f"{p['served_p50_ms']:.2f} ms, overhead p50 {p['overhead_p50_ms']:+.2f} ms", flush=True)
    return rows, paired


def paired_level(server: ServerProcess, pairing: tuple, cfg: BenchConfig) -> dict:
    run_batch, pixels, payload = pairing
    return paired_one_client(run_batch, pixels, server.port, payload, cfg.pairs, cfg.pair_gap_s, cfg.request_timeout_s)


def bare_phase(payloads: dict[str, list[bytes]], cfg: BenchConfig, overrides: dict[str, str],
               budget: Budget) -> list[dict]:
    """The constant endpoint (bench.servers.bare_app) under the same uvicorn options as `vitserve serve`."""
    port = free_port()
    env = {**server_settings(cfg, overrides, batching=True), "VITSERVE_PORT": str(port)}
    log_path = cfg.log_dir / "bench-server-bare.log"
    print(f"bare constant endpoint (server log: {log_path})", flush=True)
    with ServerProcess(bare_argv(), port, env=env, log_path=log_path) as server:
        return run_levels(server, {"png": payloads["png"]}, cfg, budget, app="bare")


def run_levels(server: ServerProcess, payloads: dict[str, list[bytes]], cfg: BenchConfig, budget: Budget,
               **labels) -> list[dict]:
    """Every input kind at every concurrency level against one server; levels past the time limit are skipped."""
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


class LevelConfig(Protocol):
    """What one closed-loop level reads of its run's configuration: BenchConfig's and OipConfig's fields."""
    warmup_s: float
    duration_s: float
    request_timeout_s: float
    min_completed_per_client: int
    max_duration_factor: float


def run_level(server: ServerProcess, payloads: list[bytes], concurrency: int, cfg: LevelConfig) -> dict:
    """One closed-loop level against a running server, with CPU use and batch statistics over its window."""
    edges: dict[str, tuple[CpuSnapshot, dict]] = {}

    async def on_window(edge: str) -> None:
        metrics = await asyncio.to_thread(scrape_metrics, server.port, _BATCH_METRICS)
        edges[edge] = (CpuSnapshot.take(server.pid), metrics)

    result = asyncio.run(closed_loop(LOOPBACK, server.port, payloads, concurrency, cfg.warmup_s, cfg.duration_s,
                                     cfg.request_timeout_s, on_window, min_completed=cfg.min_completed_per_client
                                     * concurrency, max_duration_s=cfg.max_duration_factor * cfg.duration_s))
    (cpu0, m0), (cpu1, m1) = edges["start"], edges["end"]
    result.update(cpu0.usage(cpu1))
    batch_sum, batch_count, infer_sum = _BATCH_METRICS
    batches = m1.get(batch_count, 0.0) - m0.get(batch_count, 0.0)
    # prometheus-client's Histogram.observe adds to the sum before the bucket, and a scrape reads both at any moment:
    # a batch observed during a window's edge can count in one and not the other, so the mean is exact only to one
    # batch at each edge (`batches` says how many it is over).
    result["batches"] = batches
    result["mean_batch_size"] = (m1[batch_sum] - m0[batch_sum]) / batches if batches else float("nan")
    infer = m1.get(infer_sum, float("nan")) - m0.get(infer_sum, float("nan"))
    result["inference_busy"] = infer / (cpu1.wall - cpu0.wall)  # fraction of the window inside ORT calls
    return result


def _level_line(r: dict) -> str:
    return (f"  {r.get('app', 'served'):6s} batching={r.get('batching', '-'):3s} {r['input']:4s} "
            f"c={r['concurrency']:<3d} {r['requests_per_s']:8.1f} req/s  p50 {r['p50_ms']:8.2f} ms  "
            f"p99 {r['p99_ms']:8.2f} ms  errors {sum(r['errors'].values())}")
