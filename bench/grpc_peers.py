"""gRPC side by side: vitserve's gRPC front end against Triton's (the real `tritonserver` from nvidia-pytriton, its
`vit-tensor` model over the same ONNX file, bench/peers/triton_server.py), and vitserve's HTTP binary-tensor path
beside them, driven by the same load generator: Triton's own `perf_analyzer` (C++), closed loop, the same
`pixel_values` inputs (bench/perf_analyzer_inputs.py), at each concurrency.

Rounds alternate the servers' order (vitserve first, then Triton first, ...); one server runs at a time; each
measurement is perf_analyzer's window (`--measurement-interval`; its stability check is off: on two shared cores
three windows rarely agree within its 10% default, and the rounds are what is compared). Requests per second
and the p50/p99 latency perf_analyzer reports; the ratios are each round's, and their median is reported.

    python -m vitserve.bench.grpc_peers --perf-analyzer /path/to/perf_analyzer --out docs/results/bench-grpc.md

perf_analyzer asks for every output the model's configuration lists; a vitserve model with the relevance path
lists `relevance`, whose backward pass costs several forward passes, while Triton's `vit-tensor` answers logits
and rollout. The same work on both sides needs a model without it:

    vitserve export models/vit-fmnist/checkpoint --out build/bench-models/vit-fmnist-fast.onnx --no-relevance
    python -m vitserve.bench.grpc_peers --model build/bench-models/vit-fmnist-fast.onnx --perf-analyzer ...

perf_analyzer: the `tritonclient==2.51.0` wheel's binary, with Debian's libb64-0d and a libcudart.so.12 on
LD_LIBRARY_PATH (docs/open-inference-protocol.md says how).
"""
from __future__ import annotations

import argparse
import csv
import io
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from vitserve.bench.peers.servers import RunningServer, triton_spec, vitserve_spec
from vitserve.bench.peers.venvs import ensure_venv, library_dir
from vitserve.bench.perf_analyzer_inputs import perf_analyzer_inputs
from vitserve.machine import cpu_model_name, load_average

PATHS = ("vitserve grpc", "vitserve http-binary", "triton grpc")


def perf_analyzer(binary: str, model: str, url: str, protocol: str, inputs: Path, concurrency: int,
                  window_ms: int) -> dict:
    """One perf_analyzer measurement: requests/s and latency percentiles (ms)."""
    with tempfile.NamedTemporaryFile(suffix=".csv") as out:
        argv = [binary, "-m", model, "-u", url, "-i", protocol, "--input-data", str(inputs),
                "--concurrency-range", str(concurrency), "--measurement-interval", str(window_ms),
                "--max-trials", "3", "--stability-percentage", "1000", "-f", out.name]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
        if done.returncode != 0:
            raise RuntimeError(f"perf_analyzer failed ({done.returncode}): {done.stdout[-2000:]}{done.stderr[-2000:]}")
        (row,) = list(csv.DictReader(io.StringIO(Path(out.name).read_text())))
    return {"rps": float(row["Inferences/Second"]), "p50_ms": int(row["p50 latency"]) / 1000,
            "p99_ms": int(row["p99 latency"]) / 1000}


def run(args) -> dict:
    from vitserve.service.engine.inference_model import read_model_file_info
    if read_model_file_info(args.model).explains_classes:
        raise SystemExit(f"{args.model} has the relevance path, which perf_analyzer would ask every request for "
                         f"(Triton's model answers logits and rollout only): export one with --no-relevance "
                         f"(this module's docstring)")
    inputs_dir = Path(tempfile.mkdtemp(prefix="vitserve-grpc-bench-"))
    (inputs_dir / "pixels.json").write_text(json.dumps(perf_analyzer_inputs(args.model)["pixels.json"]))
    pixels = inputs_dir / "pixels.json"
    triton_python = ensure_venv(args.work_dir, "triton", None)
    rows = []
    for round_index in range(args.rounds):
        order = ["vitserve", "triton"] if round_index % 2 == 0 else ["triton", "vitserve"]
        for server in order:
            if server == "vitserve":
                spec = vitserve_spec(args.model, grpc=True)
                targets = [("vitserve grpc", "vit-fmnist", "grpc", spec.ports[1]),
                           ("vitserve http-binary", "vit-fmnist", "http", spec.ports[0])]
            else:
                spec = triton_spec(args.model, triton_python, library_dir(triton_python))
                targets = [("triton grpc", "vit-tensor", "grpc", spec.ports[1])]
            log = args.work_dir / f"grpc-bench-{server}.log"
            with RunningServer(spec, log, startup_timeout_s=120) as _:
                for path, model, protocol, port in targets:
                    for concurrency in args.concurrency:
                        perf_analyzer(args.perf_analyzer, model, f"127.0.0.1:{port}", protocol, pixels, concurrency,
                                      1000)  # warm-up, discarded
                        measured = perf_analyzer(args.perf_analyzer, model, f"127.0.0.1:{port}", protocol, pixels,
                                                 concurrency, args.window_ms)
                        row = {"round": round_index, "path": path, "concurrency": concurrency, **measured}
                        print(json.dumps(row), flush=True)
                        rows.append(row)
    return {"rows": rows, "machine": {"cpu": cpu_model_name(), "cores": len(__import__("os").sched_getaffinity(0)),
                                      "load_before": load_average(), "python": platform.python_version()},
            "model": str(args.model), "rounds": args.rounds, "window_ms": args.window_ms,
            "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def summary(result: dict) -> str:
    rows = result["rows"]
    levels = sorted({r["concurrency"] for r in rows})

    def of(path: str, level: int) -> list[dict]:
        return sorted((r for r in rows if r["path"] == path and r["concurrency"] == level), key=lambda r: r["round"])

    lines = [f"# gRPC side by side: vitserve against Triton ({result['when']})", "",
             f"`python -m vitserve.bench.grpc_peers` on {result['machine']['cpu']}, "
             f"{result['machine']['cores']} cores, "
             f"model {result['model']}: perf_analyzer 2.51.0 closed loop, `pixel_values` raw tensors, "
             f"{result['rounds']} rounds alternating the servers' order, {result['window_ms']} ms windows.", "",
             "| clients | path | req/s per round | median req/s | p50 ms (median) | p99 ms (median) |",
             "| ---: | --- | --- | ---: | ---: | ---: |"]
    for level in levels:
        for path in PATHS:
            runs = of(path, level)
            if not runs:
                continue
            per_round = ", ".join(f"{r['rps']:.0f}" for r in runs)
            lines.append(f"| {level} | {path} | {per_round} | "
                         f"{statistics.median(r['rps'] for r in runs):.0f} | "
                         f"{statistics.median(r['p50_ms'] for r in runs):.2f} | "
                         f"{statistics.median(r['p99_ms'] for r in runs):.2f} |")
    lines += ["", "| clients | vitserve gRPC / Triton gRPC (req/s, per round) | vitserve gRPC / vitserve HTTP binary | "
              "p99: vitserve gRPC / Triton gRPC |", "| ---: | --- | --- | --- |"]
    for level in levels:
        ours, theirs, http = of("vitserve grpc", level), of("triton grpc", level), of("vitserve http-binary", level)
        versus = [a["rps"] / b["rps"] for a, b in zip(ours, theirs)]
        over_http = [a["rps"] / b["rps"] for a, b in zip(ours, http)]
        tails = [a["p99_ms"] / b["p99_ms"] for a, b in zip(ours, theirs)]
        lines.append(f"| {level} | {', '.join(f'{v:.2f}' for v in versus)} (median {statistics.median(versus):.2f}) | "
                     f"{', '.join(f'{v:.2f}' for v in over_http)} (median {statistics.median(over_http):.2f}) | "
                     f"{', '.join(f'{v:.2f}' for v in tails)} (median {statistics.median(tails):.2f}) |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.grpc_peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=Path("build/bench-models/vit-fmnist-fast.onnx"))
    p.add_argument("--perf-analyzer", required=True, help="the perf_analyzer binary")
    p.add_argument("--concurrency", type=lambda s: [int(v) for v in s.split(",")], default=[1, 32])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--window-ms", type=int, default=5000)
    p.add_argument("--work-dir", type=Path, default=Path("build/peers"))
    p.add_argument("--out", type=Path, default=Path("build/bench-grpc.md"))
    args = p.parse_args(argv)
    args.work_dir.mkdir(parents=True, exist_ok=True)
    result = run(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(summary(result))
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=1))
    print(summary(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
