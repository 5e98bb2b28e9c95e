"""`python -m vitserve.bench.ray_repository`: two models on Ray Serve, three ways, side by side in one run.

- `replicated`: one deployment of R replicas, each holding every model of the repository (`--ray-models-per-replica
  0`, the default);
- `multiplexed`: one deployment of R replicas with Ray's model multiplexing (`--ray-models-per-replica 1`): a
  replica loads the model a request names and holds one; requests carry `serve_multiplexed_model_id`, by which
  Ray's router prefers a replica that has the model;
- `per_model`: one Ray application per model, R/2 replicas each, at /a and /b (what "one deployment per model"
  gives a user).

For each, the same two traffic mixes from two wrk processes at once (one per model): `even` (C/2 connections each)
and `skewed` (C-2 on `a`, 2 on `b`), answered requests per second and p99 per model, then the replicas' resident
memory. The layouts alternate over `rounds`; the model is the same file under both names, so the layouts differ in
routing and placement only.
"""
from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from vitserve.bench.config import add_config_flags
from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.wrk import find_wrk, parse_wrk, write_script, wrk_argv
from vitserve.bench.repository import place, sample_png
from vitserve.bench.servers import free_port

LAYOUTS = ("replicated", "multiplexed", "per_model")
MIXES = {"even": lambda c: (c // 2, c // 2), "skewed": lambda c: (c - 2, 2)}


@dataclass
class RayRepositoryBenchConfig:
    model: Path = Path("models/vit-fmnist/model.onnx")
    replicas: int = 2
    connections: int = 16
    seconds: int = 8
    rounds: int = 2
    out: Path = Path("build/bench/ray-repository.md")


def deploy(layout: str, root: Path, cfg: RayRepositoryBenchConfig) -> list[str]:
    """Deploy `layout` on the running Serve instance; the applications' names."""
    from ray import serve

    from vitserve.service.ray_serve import build_app
    common = {"providers": ["cpu"], "log_level": "warning", "max_loop_lag_ms": 60000}
    if layout == "per_model":
        for name in ("a", "b"):
            serve.run(build_app({**common, "model_path": str(root / name / "1" / "model.onnx"),
                                 "ray_replicas": max(1, cfg.replicas // 2)}), name=name, route_prefix=f"/{name}")
        return ["a", "b"]
    per_replica = 1 if layout == "multiplexed" else 0
    serve.run(build_app({**common, "model_repository": str(root), "ray_replicas": cfg.replicas,
                         "ray_models_per_replica": per_replica}), name=layout, route_prefix="/")
    return [layout]


def target(layout: str, base: str, name: str) -> tuple[str, dict[str, str]]:
    """The URL and extra headers a client of `layout` sends for model `name`."""
    if layout == "per_model":
        return f"{base}/{name}/v1/classify?map=none", {}
    headers = {"serve_multiplexed_model_id": name} if layout == "multiplexed" else {}
    return f"{base}/v1/classify?map=none&model={name}", headers


def replica_rss_mib() -> float:
    """The resident memory of every Serve replica process on this machine, summed."""
    total = 0
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if not cmdline.read_bytes().startswith(b"ray::ServeReplica"):
                continue
            status = (cmdline.parent / "status").read_text()
        except OSError:
            continue
        total += int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1])
    return total / 1024


def measure(layout: str, base: str, work: Path, cfg: RayRepositoryBenchConfig, body: bytes) -> dict:
    wrk = find_wrk()
    results: dict[str, Any] = {}
    for mix, split in MIXES.items():
        runs = []
        for name, connections in zip(("a", "b"), split(cfg.connections)):
            url, headers = target(layout, base, name)
            script = write_script(work, f"{layout}-{name}", PeerRequest("/v1/classify", body,
                                                                       {"Content-Type": "image/png", **headers}))
            runs.append((name, subprocess.Popen(wrk_argv(wrk, url, connections, cfg.seconds, 30, script),
                                                stdout=subprocess.PIPE, text=True)))
        for name, process in runs:
            out, _ = process.communicate(timeout=cfg.seconds + 60)
            report = parse_wrk(out)
            results[f"{mix}/{name}"] = {"ok_per_s": report["ok_per_s"], "p99_ms": report.get("p99_ms"),
                                        "non_2xx": report["non_2xx"]}
    results["rss_mib"] = replica_rss_mib()
    return results


def wait_ready(layout: str, base: str) -> None:
    """Until both models answer (a multiplexed replica loads its model on the first request)."""
    body, deadline = sample_png(), time.monotonic() + 300
    for name in ("a", "b"):
        url, headers = target(layout, base, name)
        while True:
            try:
                if httpx.post(url, content=body, headers={"content-type": "image/png", **headers},
                              timeout=30).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"{layout}: model {name} did not answer in 300 s")
            time.sleep(0.5)


def run(cfg: RayRepositoryBenchConfig) -> dict:
    import ray
    from ray import serve
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    rounds: dict[str, list[dict]] = {layout: [] for layout in LAYOUTS}
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-ray-") as directory:
        root, work = Path(directory) / "repository", Path(directory) / "wrk"
        for name in ("a", "b"):
            place(root, name, 1, cfg.model)
        ray.init(include_dashboard=False, logging_level=logging.ERROR)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        try:
            for round_ in range(cfg.rounds):
                order = LAYOUTS if round_ % 2 == 0 else tuple(reversed(LAYOUTS))
                for layout in order:
                    applications = deploy(layout, root, cfg)
                    wait_ready(layout, base)
                    measure(layout, base, work, RayRepositoryBenchConfig(**{**asdict(cfg), "seconds": 2}),
                            sample_png())  # settle: each replica has what its traffic routes to it
                    rounds[layout].append(measure(layout, base, work, cfg, sample_png()))
                    for application in applications:
                        serve.delete(application)
        finally:
            serve.shutdown()
            ray.shutdown()
    summary = {}
    for layout, results in rounds.items():
        summary[layout] = {key: statistics.median(r[key] if key == "rss_mib" else r[key]["ok_per_s"]
                                                  for r in results) for key in results[0]}
        summary[layout]["p99_ms"] = {key: statistics.median(r[key]["p99_ms"] for r in results)
                                     for key in results[0] if key != "rss_mib"}
    return {"config": {k: str(v) for k, v in asdict(cfg).items()}, "rounds": rounds, "medians": summary}


def render(report: dict) -> str:
    lines = ["# Two models on Ray Serve: replicated, multiplexed, one deployment per model", "",
             f"`python -m vitserve.bench.ray_repository` ({json.dumps(report['config'])}). Medians over the rounds; "
             "answered (2xx) requests per second per model, wrk's p99 in brackets.", "",
             "| layout | even: a | even: b | skewed: a | skewed: b | replicas' RSS (MiB) |",
             "|---|---|---|---|---|---|"]
    for layout, m in report["medians"].items():
        cells = [f"{m[k]:.0f} ({m['p99_ms'][k]:.0f} ms)" for k in ("even/a", "even/b", "skewed/a", "skewed/b")]
        lines.append(f"| {layout} | " + " | ".join(cells) + f" | {m['rss_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    d = RayRepositoryBenchConfig()
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.ray_repository", description=__doc__.split("\n\n")[0])
    add_config_flags(p, d)
    cfg = RayRepositoryBenchConfig(**vars(p.parse_args(argv)))
    if shutil.which("wrk") is None:
        raise SystemExit("wrk is needed (apt-get install wrk)")
    report = run(cfg)
    cfg.out.parent.mkdir(parents=True, exist_ok=True)
    cfg.out.write_text(render(report))
    cfg.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(render(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
