"""`python -m vitserve.bench.paths`: one server, the same image on each of vitserve's HTTP ways in, side by side.

Paths: `classify` (`POST /v1/classify`, the PNG as the body), `classify-multipart` (the PNG as the form field `file`),
`v2-image` (`/v2/models/{m}/infer`, the PNG as the binary BYTES input `image`, outputs binary). All answer top
classes or logits and the rollout of the same image. Debian's wrk drives each path in turn (alternating rounds,
the order reversed every other round, a discarded warm-up before each level), and the server's own CPU is read
from /proc around each measured run: **HTTP µs per request** (the HTTP worker processes) and **engine µs per
request** (the engine process) say where a path's cost is, which requests/s on two shared cores cannot.
"""
from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from vitserve.bench.load import make_images
from vitserve.bench.oip import classify_request, image_request, infer_target
from vitserve.bench.peers.bodies import PeerRequest, multipart_image
from vitserve.bench.peers.wrk import find_wrk, run_wrk, write_script, wrk_argv
from vitserve.bench.report import command_line, publish
from vitserve.bench.servers import ServerProcess, free_port, serve_argv
from vitserve.machine import process_cpu_seconds, process_tree

PATHS = ("classify", "classify-multipart", "v2-image")


def path_requests(png: bytes, model: str) -> dict[str, PeerRequest]:
    return {"classify": PeerRequest("/v1/classify", *classify_request(png)),
            "classify-multipart": PeerRequest("/v1/classify", *multipart_image(png)),
            "v2-image": PeerRequest(infer_target(model), *image_request(png))}


def server_processes(root: int) -> tuple[list[int], list[int]]:
    """(frontend processes, engine processes) of the server whose first process is `root`. An engine is a process
    spawned below `root` that has a runtime's library loaded; the rest (the HTTP workers, or `root` itself with
    one worker, and the supervisor, idle while serving) are the frontend."""
    tree = process_tree(root)
    engines = [pid for pid in tree[1:] if _runs_a_runtime(pid)]
    return [pid for pid in tree if pid not in engines], engines


def _runs_a_runtime(pid: int) -> bool:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return "onnxruntime_pybind" in maps or "libopenvino" in maps


def measure_level(url: str, script: Path, connections: int, duration_s: int, groups) -> dict:
    wrk = find_wrk()
    run_wrk(wrk_argv(wrk, url, connections, 1, 30, script), 60)  # warm-up, discarded
    before = [sum(map(process_cpu_seconds, pids)) for pids in groups]
    result = run_wrk(wrk_argv(wrk, url, connections, duration_s, 30, script), duration_s + 60)
    after = [sum(map(process_cpu_seconds, pids)) for pids in groups]
    n = max(result["requests"], 1)
    http_us, engine_us = (1e6 * (a - b) / n for a, b in zip(after, before))
    return {"req_s": result["ok_per_s"], "p50_ms": result.get("p50_ms"), "p99_ms": result.get("p99_ms"),
            "non_2xx": result["non_2xx"], "http_us": http_us, "engine_us": engine_us}


def run(model: Path, connections: list[int], rounds: int, duration_s: int, workers: int | None,
        scripts_dir: Path) -> list[dict]:
    port = free_port()
    argv = serve_argv(model, port) + (["--workers", str(workers)] if workers else [])
    # the engine process named: the HTTP workers' CPU apart from the model's is what this bench reads
    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0", "VITSERVE_ENGINE": "process"}
    with ServerProcess(argv, port, env=env) as server:
        http, engine = server_processes(server.pid)
        png = make_images("png", (28, 28), 1, 1)[0]
        name = _served_name(port)
        requests = path_requests(png, name)
        rows = []
        for c in connections:
            for r in range(rounds):
                for path in (PATHS if r % 2 == 0 else PATHS[::-1]):
                    script = write_script(scripts_dir, path, requests[path])
                    level = measure_level(f"http://127.0.0.1:{port}{requests[path].target}", script, c, duration_s,
                                          (http, engine))
                    rows.append({"path": path, "connections": c, "round": r + 1, **level})
                    print(rows[-1], flush=True)
    return rows


def _served_name(port: int) -> str:
    import json
    import urllib.request
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models") as answer:
        return json.load(answer)["models"][0]["name"]


def render(rows: list[dict], command: str) -> str:
    lines = ["# vitserve's HTTP paths side by side", "", f"`{command}`", "",
             "Medians over rounds. HTTP / engine µs: the server's processes' CPU per request.", "",
             "| path | clients | req/s | p50 ms | p99 ms | HTTP µs/request | engine µs/request | non-2xx |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in sorted({r["connections"] for r in rows}):
        for path in PATHS:
            level = [r for r in rows if r["path"] == path and r["connections"] == c]
            if level:
                m = {k: statistics.median(r[k] for r in level) for k in ("req_s", "p50_ms", "p99_ms", "http_us",
                                                                       "engine_us")}
                bad = sum(r["non_2xx"] for r in level)
                lines.append(f"| {path} | {c} | {m['req_s']:.1f} | {m['p50_ms']:.2f} | {m['p99_ms']:.2f} | "
                             f"{m['http_us']:.0f} | {m['engine_us']:.0f} | {bad} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.paths", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=Path("models/vit-fmnist/model.onnx"))
    parser.add_argument("--concurrency", default="8,32,64", help="wrk connections per level")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration", type=int, default=5, help="seconds per measured run")
    parser.add_argument("--workers", type=int, help="the server's HTTP workers (default: its own)")
    parser.add_argument("--out", type=Path, help="write the Markdown (and its JSON) here")
    args = parser.parse_args(argv)
    rows = run(args.model, [int(c) for c in args.concurrency.split(",")], args.rounds, args.duration, args.workers,
               Path("build/bench/paths"))
    publish(render(rows, command_line("python -m vitserve.bench.paths", argv)), rows, args.out)


if __name__ == "__main__":
    main()
