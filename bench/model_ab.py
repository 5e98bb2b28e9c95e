"""`python -m vitserve.bench.model_ab A.onnx B.onnx`: the same server code serving two model files, side by side:
does a re-export (new outputs, a new opset, other weights) cost the served latency?

Each round starts `vitserve serve --model FILE` for A, then for B (B first in even rounds), and drives each with
Debian's wrk at every client count on /v1/classify (one Fashion-MNIST test image as PNG): 2 s settling, then the
measured window. Reports answers/s, p50 and p99 per arm, and B's medians over the rounds as ratios to the same
round's A. Writes a Markdown report and its JSON.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vitserve.machine import process_cpu_seconds, process_tree
from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.wrk import find_wrk, run_wrk, write_script, wrk_argv
from vitserve.bench.report import publish
from vitserve.bench.servers import free_port
from vitserve.bench.shadow import machine, png, test_images
from vitserve.service.engine.process import PROCESS_NAME as ENGINE_PROCESS_NAME


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model), "--port",
                                str(port), "--grpc-port", "0", "--log-level", "warning"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + 300
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"vitserve serve --model {model} exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/v2/health/ready", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    raise SystemExit(f"vitserve serve --model {model} was not ready in 300 s")


def engine_and_frontend_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's engine processes (named PROCESS_NAME) and of the rest of its tree (the
    supervisor and HTTP workers): which side of the process boundary a difference in cost lies on."""
    engine = frontend = 0.0
    for child in process_tree(pid):
        try:
            name = Path(f"/proc/{child}/comm").read_text().strip()
        except OSError:
            continue  # gone meanwhile
        seconds = process_cpu_seconds(child)
        if name == ENGINE_PROCESS_NAME:
            engine += seconds
        else:
            frontend += seconds
    return engine, frontend


def arm(model: Path, label: str, clients: list[int], seconds: int, script: Path, wrk: str, round_: int) -> list[dict]:
    process, url = serve(model)
    try:
        rows = []
        for count in clients:
            target = f"{url}/v1/classify"
            run_wrk(wrk_argv(wrk, target, count, 2, 30, script), 60)
            engine_before, frontend_before = engine_and_frontend_cpu_seconds(process.pid)
            result = run_wrk(wrk_argv(wrk, target, count, seconds, 30, script), seconds + 60)
            answers = max(result["ok_per_s"] * seconds, 1.0)
            engine_after, frontend_after = engine_and_frontend_cpu_seconds(process.pid)
            engine_ms = (engine_after - engine_before) / answers * 1e3
            frontend_ms = (frontend_after - frontend_before) / answers * 1e3
            rows.append({"round": round_, "file": label, "clients": count, "ok_per_s": result["ok_per_s"],
                         "p50_ms": result.get("p50_ms"), "p99_ms": result.get("p99_ms"),
                         "cpu_ms": engine_ms + frontend_ms, "engine_cpu_ms": engine_ms,
                         "frontend_cpu_ms": frontend_ms,
                         "non_2xx": result["non_2xx"]})
        return rows
    finally:
        process.terminate()
        process.wait(60)


def render(a: Path, b: Path, rows: list[dict], rounds: int, seconds: int) -> str:
    lines = ["# One server, two model files (`python -m vitserve.bench.model_ab`)", "",
             f"Machine: {machine()}. A: `{a}`; B: `{b}`. wrk on `/v1/classify` (one Fashion-MNIST test image as PNG), "
             f"{seconds} s per arm after 2 s settling, {rounds} rounds, A and B alternating which goes first.", "",
             "| round | file | clients | answers/s | p50 ms | p99 ms | server CPU ms / answer | engine | frontend "
             "| non-2xx |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['round']} | {r['file']} | {r['clients']} | {r['ok_per_s']:.1f} | {r['p50_ms']:.2f} | "
              f"{r['p99_ms']:.2f} | {r['cpu_ms']:.3f} | {r['engine_cpu_ms']:.3f} | {r['frontend_cpu_ms']:.3f} | "
              f"{r['non_2xx']} |" for r in rows]
    lines += ["", "B against A, medians over the rounds of the same round's ratio (server CPU: all its processes "
                  "over the measured window, per answer; engine: the engine process, which runs the model; "
                  "frontend: the supervisor and the HTTP workers):", "",
              "| clients | answers/s | p50 | p99 | server CPU / answer | engine | frontend |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    spreads = []
    for count in sorted({r["clients"] for r in rows}):
        ratios = {key: [] for key in ("ok_per_s", "p50_ms", "p99_ms", "cpu_ms", "engine_cpu_ms", "frontend_cpu_ms")}
        for round_ in sorted({r["round"] for r in rows}):
            pair = {r["file"]: r for r in rows if (r["round"], r["clients"]) == (round_, count)}
            for key in ratios:
                ratios[key].append(pair["B"][key] / pair["A"][key])
        lines.append(f"| {count} | " + " | ".join(f"{statistics.median(v):.3f}x" for v in ratios.values()) + " |")
        spreads.append(f"| {count} | " + " | ".join("{:.3f}-{:.3f}x".format(*median_interval(v))
                                                    for v in ratios.values()) + " |")
    lines += ["", "How far those medians can be trusted: a 95% interval of each (the rounds resampled 2,000 times). A "
                  "difference is resolved only where the interval leaves 1.0x out; run more rounds to narrow it:", "",
              "| clients | answers/s | p50 | p99 | server CPU / answer | engine | frontend |",
              "| --- | --- | --- | --- | --- | --- | --- |", *spreads]
    return "\n".join(lines) + "\n"


def median_interval(values: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A bootstrap 95% interval of the median of `values` (the percentile method; seeded, so a report is
    reproducible from its rows)."""
    import numpy as np

    picks = np.random.default_rng(seed).choice(np.asarray(values), (draws, len(values)))
    medians = np.median(picks, axis=1)
    return float(np.percentile(medians, 2.5)), float(np.percentile(medians, 97.5))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.model_ab", description=__doc__.split("\n\n")[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--clients", default="1,32", help="wrk connections, comma-separated (default 1,32)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--out", type=Path, default=Path("build/bench/model-ab.md"))
    args = p.parse_args(argv)
    clients, wrk, rows = [int(c) for c in args.clients.split(",")], find_wrk(), []
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-ab-") as directory:
        script = write_script(Path(directory), "ab", PeerRequest("/v1/classify", png(test_images(1)[0]),
                                                                 {"Content-Type": "image/png"}))
        for round_ in range(1, args.rounds + 1):
            order = [("A", args.a), ("B", args.b)] if round_ % 2 else [("B", args.b), ("A", args.a)]
            for label, model in order:
                rows += arm(model, label, clients, args.seconds, script, wrk, round_)
                print(rows[-1], flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    publish(render(args.a, args.b, rows, args.rounds, args.seconds), {"a": str(args.a), "b": str(args.b),
                                                                       "rows": rows}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
