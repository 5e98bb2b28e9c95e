"""`python -m vitserve.bench.latency_budget`: where one client's request spends its time in vitserve, beside the work
itself done in one process and beside the 20-line FastAPI app a user writes first.

Three arms, the same PNG (the README's), one client on one keep-alive connection, `--requests` sequential requests
per arm and round after a warm-up, the arms alternating within each round (the order reversed every other round):

- **in-process**: the work itself in this process, no server: vitserve's `prepare_image` (decode, fit, normalise),
  one ONNX Runtime call at batch 1 (logits, rollout; vitserve's session options), the top 5 and the rollout grid,
  JSON (bench/peers/image_classifier.py, the work every peer does);
- **FastAPI app**: bench/peers/fastapi_app.py under uvicorn, the same work in a sync endpoint, the image as the
  multipart field `file`;
- **vitserve**: `vitserve serve --model M` as `make serve` starts it, with `--server-timing true`, the PNG as the body
  of `POST /v1/classify` (top 5 and the rollout grid, the defaults); and the same with `map=none` (top 5 alone);
- with `--baseline-commit REV`, **vitserve at REV** beside it: the same server and flags from that commit's tree
  (`git archive`, bench/peers/servers.py `export_commit`), so a change's before and after alternate in one run.

vitserve's answers carry the Server-Timing header (service/http/dependencies.py `answer`): each stage's p50 over a
round's requests is the budget, and the client's latency less the server's `total` is what happens outside the app
(uvicorn's parsing of the request, the write, the kernel, the client). The servers run side by side, idle while
another arm is measured. Output: Markdown and JSON (`--out`).
"""
from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from vitserve.bench.config import LOOPBACK
from vitserve.bench.report import at_least, command_line, publish
from vitserve.bench.servers import ServerProcess, free_port, serve_argv
from vitserve.machine import cpu_model_name, load_average

DEFAULT_MODEL = Path("models/vit-fmnist/model.onnx")
DEFAULT_IMAGE = Path("examples/ankle-boot.png")
BOUNDARY = "vitserve-budget"


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Client:
    """One keep-alive connection sending one prepared request again and again."""

    def __init__(self, port: int, path: str, body: bytes, content_type: str):
        self.port, self.path, self.body, self.headers = port, path, body, {"Content-Type": content_type}
        self.connection = http.client.HTTPConnection(LOOPBACK, port, timeout=60)

    def reconnect(self) -> None:
        """A new connection: a server closes one left idle past its keep-alive timeout while others measure."""
        self.connection.close()
        self.connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=60)

    def close(self) -> None:
        """Hung up after its arm: one client is one connection (a lone request on its server's only connection
        runs on its worker's event loop, service/usecases/admission.py `alone`)."""
        self.connection.close()

    def send(self) -> tuple[float, str | None]:
        """The request's latency in ms and its Server-Timing header, if any."""
        started = time.perf_counter()
        self.connection.request("POST", self.path, self.body, self.headers)
        response = self.connection.getresponse()
        body = response.read()
        elapsed = (time.perf_counter() - started) * 1000
        if response.status != 200:
            raise RuntimeError(f"{self.path}: {response.status} {body[:200]!r}")
        return elapsed, response.getheader("server-timing")


def multipart(png: bytes) -> bytes:
    return (f"--{BOUNDARY}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"image.png\"\r\n"
            f"Content-Type: image/png\r\n\r\n").encode() + png + f"\r\n--{BOUNDARY}--\r\n".encode()


def in_process(model: Path, png: bytes):
    """The work itself, in this process: one call per request, as the servers do it."""
    from vitserve.bench.peers.image_classifier import ImageClassifier

    classifier = ImageClassifier(model)

    def one() -> tuple[float, None]:
        started = time.perf_counter()
        pixels = classifier.prepare(png)[None]
        logits, rollout = classifier.run(pixels)
        json.dumps(classifier.answer(logits[0], rollout[0]))
        return (time.perf_counter() - started) * 1000, None
    return one


def stages_of(header: str) -> dict[str, float]:
    """Server-Timing `name;dur=MS, ...` -> {name: ms}, a stage that repeats summed."""
    stages: dict[str, float] = {}
    for entry in header.split(","):
        name, _, duration = entry.strip().partition(";dur=")
        stages[name] = stages.get(name, 0.0) + float(duration)
    return stages


def measure(send, requests: int, warmup: int) -> dict:
    client = getattr(send, "__self__", None)
    if isinstance(client, Client):
        client.reconnect()
    for _ in range(warmup):
        send()
    latencies, budgets = [], []
    for _ in range(requests):
        ms, header = send()
        latencies.append(ms)
        if header:
            budgets.append(stages_of(header))
    if isinstance(client, Client):
        client.close()
    result = {"p50_ms": statistics.median(latencies), "p99_ms": percentile(latencies, 0.99),
              "mean_ms": statistics.fmean(latencies)}
    if budgets:
        result["stages_p50_us"] = {name: 1000 * statistics.median(b.get(name, 0.0) for b in budgets)
                                   for name in budgets[0]}
    return result


def run(args, command: str) -> dict:
    png = args.image.read_bytes()
    baseline = None
    vitserve_port, app_port = free_port(), free_port()
    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0", "VITSERVE_SERVER_TIMING": "true"}
    vitserve_argv = serve_argv(args.model, vitserve_port) + args.serve_flags.split()
    app_argv = [sys.executable, "-m", "uvicorn", "vitserve.bench.peers.fastapi_app:app", "--host", LOOPBACK,
                "--port", str(app_port), "--log-level", "warning"]
    with contextlib.ExitStack() as servers:
        if args.baseline_commit:  # first: a commit that is not there stops the run before any server starts
            from vitserve.bench.peers.servers import export_commit

            tree, sha = export_commit(args.baseline_commit, Path(servers.enter_context(tempfile.TemporaryDirectory())))
        servers.enter_context(ServerProcess(vitserve_argv, vitserve_port, env=env))
        servers.enter_context(ServerProcess(app_argv, app_port, ready_path="/ready",
                                            env={"MODEL_PATH": str(args.model)}))
        arms = {"in-process": in_process(args.model, png),
                "FastAPI app": Client(app_port, "/classify", multipart(png),
                                      f"multipart/form-data; boundary={BOUNDARY}").send,
                "vitserve": Client(vitserve_port, "/v1/classify", png, "image/png").send,
                "vitserve, map=none": Client(vitserve_port, "/v1/classify?map=none", png, "image/png").send}
        if args.baseline_commit:
            baseline_port = free_port()
            # -P: this repository, the working directory, must not come first on the path and shadow the tree
            baseline_argv = [sys.executable, "-P", *serve_argv(args.model.resolve(), baseline_port)[1:],
                             *args.serve_flags.split()]
            servers.enter_context(ServerProcess(baseline_argv, baseline_port, env={**env, "PYTHONPATH": str(tree)}))
            baseline = baseline_arm(sha)
            arms[baseline] = Client(baseline_port, "/v1/classify", png, "image/png").send
        card = json.loads(_get(vitserve_port, "/v1/models"))
        # each server chose its runtime and precision at its own start (`auto` times them): said beside the figures
        runs_on = {"vitserve": runs_on_of(_get(vitserve_port, "/metrics"))}
        if baseline is not None:
            runs_on[baseline] = runs_on_of(_get(baseline_port, "/metrics"))
        rounds = []
        for number in range(args.rounds):
            order = list(arms) if number % 2 == 0 else list(reversed(arms))
            results = {name: measure(arms[name], args.requests, args.warmup) for name in order}
            rounds.append({"order": order, **results})
            print(f"round {number + 1}: " + ", ".join(f"{name} p50 {results[name]['p50_ms']:.2f} ms"
                                                    for name in arms), flush=True)
    return {"command": command, "baseline": baseline,
            "machine": f"{cpu_model_name()}, {len(os.sched_getaffinity(0))} cores, load average {load_average()}",
            "model": str(args.model), "image": str(args.image),
            "requests": args.requests, "vitserve_models": card, "runs_on": runs_on, "rounds": rounds}


def runs_on_of(metrics: bytes) -> str:
    """Where a vitserve's model runs, from its `vitserve_model_info` series (e.g. "OpenVINO/CPU/bf16")."""
    from prometheus_client.parser import text_string_to_metric_families

    return next((sample.labels["provider"] for family in text_string_to_metric_families(metrics.decode())
                 for sample in family.samples if sample.name == "vitserve_model_info"), "unknown")


def baseline_arm(sha: str) -> str:
    return f"vitserve at {sha[:12]}"


def _get(port: int, path: str) -> bytes:
    connection = http.client.HTTPConnection(LOOPBACK, port, timeout=10)
    connection.request("GET", path)
    return connection.getresponse().read()


def medians(report: dict, arm: str, key: str) -> float:
    return statistics.median(r[arm][key] for r in report["rounds"])


def markdown(report: dict) -> str:
    arms = report["rounds"][0]["order"]
    lines = ["# The latency budget of one request", "",
             f"`{report['command']}`: {report['machine']}. Model `{report['model']}`, image `{report['image']}`, "
             f"{report['requests']} sequential requests per arm and round, {len(report['rounds'])} rounds, the arms "
             f"alternating (bench/latency_budget.py says how)."
             + "".join(f" {arm} ran on {where}." for arm, where in report.get("runs_on", {}).items()), "",
             "| arm | p50 ms | p99 ms |", "|---|---:|---:|"]
    for arm in sorted(arms):
        lines.append(f"| {arm} | {medians(report, arm, 'p50_ms'):.2f} | {medians(report, arm, 'p99_ms'):.2f} |")
    served, floor = medians(report, "vitserve", "p50_ms"), medians(report, "in-process", "p50_ms")
    app = medians(report, "FastAPI app", "p50_ms")
    lines += ["", f"Served minus the work in one process, at p50: **{served - floor:.2f} ms**; vitserve against the "
                  f"FastAPI app at p50: **{served / app:.2f}x** ({served:.2f} against {app:.2f} ms).", "",
              "## vitserve's budget (its Server-Timing header; p50 per stage over each round, median of rounds)", ""]
    budgets = ["vitserve"] + ([report["baseline"]] if report.get("baseline") else [])
    if len(budgets) > 1:
        before = medians(report, budgets[1], "p50_ms")
        lines[-2:-2] = [f"Before the change ({budgets[1]}): {before:.2f} ms at p50, so {served:.2f} against "
                        f"{before:.2f} ms ({served / before:.2f}x); served minus the work in one process then "
                        f"{before - floor:.2f} ms, against the FastAPI app {before / app:.2f}x.", ""]
    lines += ["| stage | " + " | ".join(f"{arm} µs" for arm in budgets) + " |",
              "|---|" + "---:|" * len(budgets)]

    def stage(arm: str, name: str) -> str:
        values = [r[arm]["stages_p50_us"].get(name) for r in report["rounds"]]
        return "" if None in values else f"{statistics.median(values):.0f}"

    names = list(report["rounds"][0]["vitserve"]["stages_p50_us"])
    for arm in budgets[1:]:
        names += [n for n in report["rounds"][0][arm]["stages_p50_us"] if n not in names]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(stage(arm, name) for arm in budgets) + " |")
    outside = [f"{1000 * medians(report, arm, 'p50_ms') - float(stage(arm, 'total')):.0f}" for arm in budgets]
    lines += ["| outside the app (client p50 less the server's total) | " + " | ".join(outside) + " |", ""]
    if "vitserve, map=none" in arms:
        none = medians(report, "vitserve, map=none", "p50_ms")
        inference = statistics.median(r["vitserve, map=none"]["stages_p50_us"]["inference"] for r in report["rounds"])
        lines += [f"With `map=none`: {none:.2f} ms at p50, its inference stage {inference:.0f} µs.", ""]
    lines += ["Stages: `accept` from the app's first middleware to admission (compression's check, the key, the "
              "query); `admit`; `route`; `body` (reading the upload); `decode` the work in the pool, `decode_wait` "
              "the wait around it; `queue` in the batch queue (batch assembly included); `inference` the batch's "
              "run; `engine_hop` the rest of the way to the engine and back; `postprocess` top-k and the map; "
              "`encode` the JSON; `total` from the first middleware to the answer."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.latency_budget",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--image", type=Path, default=DEFAULT_IMAGE)
    parser.add_argument("--requests", type=at_least(1), default=1000, help="per arm and round")
    parser.add_argument("--warmup", type=at_least(0), default=100)
    parser.add_argument("--rounds", type=at_least(1), default=3)
    parser.add_argument("--serve-flags", default="", help="more flags for vitserve serve")
    parser.add_argument("--baseline-commit", metavar="REV", help="serve this commit's vitserve beside the working "
                                                                 "tree's, alternating (a change's before and after)")
    parser.add_argument("--out", type=Path, help="the Markdown report; its JSON beside it")
    args = parser.parse_args(argv)
    report = run(args, command_line("python -m vitserve.bench.latency_budget", argv))
    publish(markdown(report), report, args.out)


if __name__ == "__main__":
    main()
