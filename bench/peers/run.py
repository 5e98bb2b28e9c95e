"""The comparison, in order, per model: the raw ONNX Runtime session (for context, and the reference answer), then
`rounds` rounds, each starting every server in turn (the order reversed every other round), one at a time; a
server's answers are checked once (bench/peers/answers.py), then every path it serves is loaded with wrk at every
connection count: a discarded warm-up run, the measured run, and after each one request answered alone, so that
work a run left queued is done before the next one starts.
"""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TypeAlias

import numpy as np

from vitserve.bench.load import make_images
from vitserve.bench.pages import portable
from vitserve.bench.peers.answers import check, post
from vitserve.bench.peers.bodies import PeerRequest, peer_request
from vitserve.bench.peers.config import (
    BASELINE,
    BF16_SERVERS,
    FASTAPI,
    PATHS,
    RAY_SERVERS,
    RUNTIME_SERVERS,
    SERVED_PATHS,
    TRITON_OPENVINO,
    PeersConfig,
    family,
)
from vitserve.bench.peers.report import summarise
from vitserve.bench.peers.servers import (
    RunningServer,
    ServerSpec,
    export_commit,
    fastapi_spec,
    litserve_spec,
    triton_spec,
    vitserve_spec,
)
from vitserve.bench.peers.venvs import VERSIONS_OF, ensure_venv, library_dir, package_versions
from vitserve.bench.peers.wrk import (
    find_wrk,
    parse_statuses,
    run_wrk,
    steady_rate,
    take_answer_times,
    threads_for,
    write_script,
    wrk_argv,
    wrk_version,
)
from vitserve.bench.presets import resolve_model
from vitserve.bench.raw import bench_raw, load_raw_model, preprocessed
from vitserve.bench.reliability import alternated
from vitserve.bench.run import Budget
from vitserve.machine import cpu_model_name, load_average

_STARTUP_ALLOWANCE_S = 40.0  # what a level's time check adds for a server yet to start
SESSION_ALONE = "session alone"  # the arm of the rounds that runs the raw session, no server
# The vitserve code served: None for this tree, a commit's tree, or {"vitserve": either, BASELINE: a commit's tree}
CodeSource: TypeAlias = Path | dict[str, Path | None] | None


@dataclass
class ModelUnderTest:
    path: Path
    png: bytes  # the one image every request carries
    pixels: np.ndarray  # (1, C, H, W): vitserve's preprocessing of it
    logits: np.ndarray  # (K,): the raw session's answer, the reference
    grid: list[int]  # [h, w] of the rollout
    paths: tuple[str, ...]
    concurrency: list[int]
    duration_s: int  # measured wrk run per level
    work_dir: Path
    temperature: float = 1.0  # the file's (vitserve serves softmax(logits / T) on /v1)
    # a compute-bound model's answers come a batch at a time: its runs also time each answer (`steady_rate`), with
    # answers this close together counted as one batch's
    burst_gap_s: float | None = None


def run_peers(cfg: PeersConfig, command: str) -> dict:
    wrk = find_wrk()
    # each peer's interpreter: its own venv's, or this one for the FastAPI app (vitserve's own dependencies)
    pythons = {family(p): Path(sys.executable) if p == FASTAPI else
               ensure_venv(cfg.work_dir, family(p), cfg.venv_python) for p in cfg.servers if family(p) != "vitserve"}
    tree: Path | None = None
    env = environment(wrk, pythons)
    if cfg.vitserve_commit:
        tree, env["vitserve_commit"] = export_commit(cfg.vitserve_commit, cfg.work_dir)
    source: CodeSource = tree
    if BASELINE in cfg.servers:
        if not cfg.baseline_commit:
            raise SystemExit(f"bench peers: {BASELINE} serves --baseline-commit REV: name the commit")
        baseline, env["baseline_commit"] = export_commit(cfg.baseline_commit, cfg.work_dir)
        source = {"vitserve": tree, BASELINE: baseline}
    env["loadavg_start"], env["waited_for_quiet_s"] = wait_for_quiet(cfg.quiet_load, cfg.quiet_wait_s)
    budget = Budget(cfg.time_limit_s)
    models = [measure_model(cfg, name, wrk, pythons, source, budget) for name in cfg.models]
    env["loadavg_end"] = load_average()
    env["triton_version"] = next((facts["server_metadata"].get("version") for m in models
                                  for server, facts in m["servers"].items() if family(server) == "triton"), None)
    return {"command": command, "environment": env, "settings": asdict(cfg), "models": models}


def environment(wrk: str, pythons: dict[str, Path]) -> dict:
    import onnxruntime

    versions = {p: package_versions(py, VERSIONS_OF[p]) for p, py in pythons.items()}
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model_name(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "onnxruntime": onnxruntime.__version__,
            "wrk": wrk_version(wrk), "commit": _git("rev-parse", "HEAD") or None,
            "uncommitted_files": len(_git("status", "--porcelain", "--untracked-files=no").splitlines()),
            "peer_versions": versions}


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True).stdout.strip()


def wait_for_quiet(quiet_load: float, wait_s: float) -> tuple[str, float]:
    """Wait (at most `wait_s`) for the 1-minute load average to fall to `quiet_load`; (load then, seconds waited)."""
    started = time.monotonic()
    while os.getloadavg()[0] > quiet_load and time.monotonic() - started < wait_s:
        if time.monotonic() - started < 1:
            print(f"load average {load_average()}: waiting up to {wait_s:.0f} s for it to fall to {quiet_load:g}",
                  flush=True)
        time.sleep(5)
    return load_average(), round(time.monotonic() - started, 1)


def measure_model(cfg: PeersConfig, name: str, wrk: str, pythons: dict[str, Path], source: CodeSource,
                  budget: Budget) -> dict:
    model_path = resolve_model(name, cfg.cache_dir)
    model, raw = raw_session(cfg, model_path)
    batch_one = min(raw, key=lambda r: r["batch_size"])
    compute_bound = batch_one["p50_ms"] > cfg.compute_bound_ms
    m = ModelUnderTest(model["path"], model["png"], model["pixels"], model["logits"], model["grid"],
                       ("image",) if compute_bound else PATHS,
                       cfg.compute_bound_concurrency if compute_bound else cfg.concurrency,
                       max(cfg.duration_s, cfg.compute_bound_duration_s) if compute_bound else cfg.duration_s,
                       cfg.work_dir / "requests" / model_path.stem, model["temperature"],
                       # a batch's answers leave together; the next batch's at least a batch-1 call later
                       cfg.compute_bound_ms / 2000 if compute_bound else None)
    kind = "compute" if compute_bound else "HTTP"
    print(f"{model_path}: raw batch-1 p50 {batch_one['p50_ms']:.2f} ms ({kind}-bound); "
          f"paths {', '.join(m.paths)} at {m.concurrency} connections, {m.duration_s} s each", flush=True)
    # a compute-bound model's session alone takes its turn among the servers in every round: what a server delivers
    # of its model is judged against the session measured beside it, not once at the start of a drifting hour
    alone = (lambda: bench_raw(model["session"].run, m.pixels, cfg.raw_batch_sizes, cfg.raw_duration_s)) \
        if compute_bound else None
    rows, checks, servers, alone_rounds = run_rounds(
        cfg, m, wrk, lambda server: server_spec(server, m.path, pythons, source), budget, alone)
    sizes = {s: {p: len(request_for_size(s, p, m)) for p in m.paths if p in SERVED_PATHS[s]} for s in cfg.servers}
    return {"model": {**model_summary_of(model_path), "compute_bound": compute_bound}, "raw": raw,
            "paths": list(m.paths), "concurrency": m.concurrency, "duration_s": m.duration_s, "checks": checks,
            "servers": servers, "request_bytes": sizes, "rounds": rows, "session_alone_rounds": alone_rounds,
            "summary": summarise(rows, cfg.servers, list(m.paths), m.concurrency)}


def run_rounds(cfg: PeersConfig, m: ModelUnderTest, wrk: str, spec_of, budget: Budget,
               session_alone: Callable[[], list[dict]] | None = None) -> tuple[list, dict, dict, list]:
    """Every server once per round, one at a time, and with `session_alone` the session alone as one more turn: (a
    row per level, answer checks, how each server ran, the session's rows of each round)."""
    rows: list[dict] = []
    checks: dict[str, dict[str, list[dict]]] = {}  # server -> path -> each round's check
    servers: dict[str, dict] = {}
    alone: list[dict] = []
    arms = [*cfg.servers, *([SESSION_ALONE] if session_alone is not None else [])]
    for round_, server in alternated(arms, cfg.rounds):
        if server == SESSION_ALONE:
            assert session_alone is not None, "an arm only when given"
            if not budget.allows(len(cfg.raw_batch_sizes) * cfg.raw_duration_s + 5):
                continue
            alone.append({"round": round_ + 1, "raw": session_alone()})
            print(f"  the session alone: {max(r['images_per_s'] for r in alone[-1]['raw']):.1f} images/s at best",
                  flush=True)
            continue
        levels = [(p, c) for p in m.paths if p in SERVED_PATHS[server] for c in m.concurrency]
        head = {"round": round_ + 1, "server": server}
        if not budget.allows(_STARTUP_ALLOWANCE_S + cfg.warmup_s + m.duration_s + 5):
            rows += [{**head, "path": p, "connections": c, "skipped": "time limit"} for p, c in levels]
            continue
        spec = spec_of(server)
        log = cfg.log_dir / f"peers-{m.path.stem}-{server}-round{round_ + 1}.log"
        running = RunningServer(spec, log, cfg.startup_timeout_s)
        try:
            running.start()
        except RuntimeError as e:  # reported in its rows; the other servers still run
            print(f"  {server} did not start: {e}", flush=True)
            rows += [{**head, "path": p, "connections": c, "skipped": f"did not start ({log})"} for p, c in levels]
            continue
        with running:
            requests = {p: request_for(server, p, running, m) for p, _ in levels}
            bf16 = computes_bf16(server, running)
            answers = {p: {"round": round_ + 1,
                           **check(family(server), p, running.url, r, m.logits, m.grid, m.temperature, bf16=bf16)}
                       for p, r in requests.items()}  # every round: a failure may be passing
            for path, result in answers.items():
                checks.setdefault(server, {}).setdefault(path, []).append(result)
            servers.setdefault(server, describe(server, spec, running))
            print(f"  {server}: answers {_check_line(answers)}", flush=True)
            rows += [load_level(cfg, m, wrk, running, {**head, "path": p, "connections": c}, requests[p], budget)
                     for p, c in levels]
    return rows, checks, servers, alone


def load_level(cfg: PeersConfig, m: ModelUnderTest, wrk: str, running: RunningServer, row: dict,
               request: PeerRequest, budget: Budget) -> dict:
    """One row: the level measured, or why not (the time limit, or wrk failing)."""
    if not budget.allows(cfg.warmup_s + m.duration_s + 5):
        return {**row, "skipped": "time limit"}
    script = write_script(m.work_dir, f"{row['server']}-{row['path']}", request)
    try:
        row = {**row, **measure_level(cfg, wrk, running.url + request.target, script, row["connections"],
                                      m.duration_s, request, running.cpu_seconds, m.burst_gap_s)}
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        row = {**row, "skipped": f"wrk failed: {str(e)[:200]}"}
        print(f"  {row['server']} {row['path']} c={row['connections']}: {row['skipped']}", flush=True)
        return row
    print(_level_line(row), flush=True)
    return row


def raw_session(cfg: PeersConfig, model_path: Path) -> tuple[dict, list[dict]]:
    """The reference image and answer, and the session alone at each batch size (vitserve's own session)."""
    session = load_raw_model(model_path, {})
    info = session.info
    png = make_images("png", info.image_size, info.channels, 1, cfg.seed)[0]
    pixels = preprocessed(session, [png])  # (1, C, H, W)
    logits, rollout = session.run(pixels)[:2]  # the optional outputs (embedding, ood_score) after them
    print(f"raw ONNX Runtime session, batch sizes {cfg.raw_batch_sizes}", flush=True)
    raw = bench_raw(session.run, pixels, cfg.raw_batch_sizes, cfg.raw_duration_s)
    for r in raw:
        print(f"  raw bs {r['batch_size']:3d}: {r['images_per_s']:8.1f} images/s  p50 {r['p50_ms']:8.2f} ms",
              flush=True)
    model = {"path": model_path, "png": png, "pixels": pixels, "logits": logits[0], "grid": list(rollout.shape[-2:]),
             "session": session,
             # the temperature /v1 divides this image's logits by (one per answer, by its entropy, where the file
             # has the curve): the calibrated scores it serves
             "temperature": float(info.temperature_for(logits[0]))}
    return model, raw


def model_summary_of(model_path: Path) -> dict:
    from vitserve.service.engine.inference_model import read_model_file_info

    info = read_model_file_info(model_path)
    return {"name": info.name, "version": info.version, "path": str(model_path), "height": info.image_size[0],
            "width": info.image_size[1], "channels": info.channels, "patch_size": info.patch_size,
            "precision": info.precision, "size_mb": round(model_path.stat().st_size / 2**20, 1)}


def server_spec(server: str, model_path: Path, pythons: dict[str, Path], source: CodeSource) -> ServerSpec:
    """How `server` starts; `source`: the vitserve code to serve (a dict when a baseline is served beside it)."""
    if isinstance(source, dict):
        if server == BASELINE:
            return replace(vitserve_spec(model_path, source[BASELINE]), name=BASELINE)
        source = source["vitserve"]
    if server == "vitserve":
        return vitserve_spec(model_path, source)
    if server in RAY_SERVERS:
        return vitserve_spec(model_path, source, ray_replicas=RAY_SERVERS[server])
    if server in RUNTIME_SERVERS:
        return vitserve_spec(model_path, source, runtime=(server, RUNTIME_SERVERS[server]))
    if family(server) == "triton":
        return triton_spec(model_path, pythons["triton"], library_dir(pythons["triton"]), TRITON_OPENVINO.get(server),
                           server)
    if server == FASTAPI:
        return fastapi_spec(model_path, pythons[FASTAPI])
    return litserve_spec(model_path, pythons["litserve"])


def computes_bf16(server: str, running: RunningServer) -> bool:
    """Whether `server` answers in bfloat16: named so, or vitserve whose `auto` chose it on this CPU (its card's
    provider, e.g. OpenVINO/CPU/bf16)."""
    if server in BF16_SERVERS:
        return True
    return family(server) == "vitserve" and _get_json(running.url + "/v1/model").get("provider", "").endswith("bf16")


def request_for(server: str, path: str, running: RunningServer, m: ModelUnderTest) -> PeerRequest:
    name = _get_json(running.url + "/v1/model")["name"] if family(server) == "vitserve" and path != "image" else ""
    return peer_request(family(server), path, m.png, m.pixels, name)


def request_for_size(server: str, path: str, m: ModelUnderTest) -> bytes:
    return peer_request(family(server), path, m.png, m.pixels, "model").body


def describe(server: str, spec: ServerSpec, running: RunningServer) -> dict:
    """How the server was started, and what it says it is."""
    facts = {"argv": [portable(arg) for arg in spec.argv], "env": {k: portable(v) for k, v in spec.env.items()}}
    if family(server) == "triton":
        facts["server_metadata"] = _get_json(running.url + "/v2")
    if family(server) == "vitserve":
        facts["model"] = _get_json(running.url + "/v1/model")
    return facts


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=30) as r:
        return json.loads(r.read())


def measure_level(cfg: PeersConfig, wrk: str, url: str, script: Path, connections: int, duration_s: int,
                  request: PeerRequest, cpu_seconds: Callable[[], float], burst_gap_s: float | None = None) -> dict:
    """At `url` (the path's whole URL): a discarded warm-up run, then the measured one, each followed by one
    request answered alone; when some answers were not 2xx, a short run counting their status codes. With the
    measured run, the server's CPU time per answer (`cpu_seconds`: its whole process tree's): on a machine it
    saturates, what decides its req/s. With `burst_gap_s` (a compute-bound model) the measured run also times each
    2xx answer: `steady_ok_per_s` (wrk.steady_rate)."""
    limit = duration_s + cfg.wrk_timeout_s + 60
    server = url.removesuffix(request.target)
    run_wrk(wrk_argv(wrk, url, connections, cfg.warmup_s, cfg.wrk_timeout_s, script), limit)
    post(server, request, cfg.wrk_timeout_s)
    load = os.getloadavg()[0]
    measured = script.with_suffix(".times.lua") if burst_gap_s is not None else script
    argv = wrk_argv(wrk, url, connections, duration_s, cfg.wrk_timeout_s, measured)
    cpu_before = cpu_seconds()
    result = run_wrk(argv, limit)
    cpu_ms = (cpu_seconds() - cpu_before) * 1000
    result["server_cpu_ms_per_answer"] = cpu_ms / result["requests"] if result["requests"] else None
    if burst_gap_s is not None:
        times, result["wrk_output"] = take_answer_times(result["wrk_output"])
        result["steady_ok_per_s"] = steady_rate(times, burst_gap_s)
    if result["non_2xx"]:
        counted = run_wrk(wrk_argv(wrk, url, connections, cfg.warmup_s, cfg.wrk_timeout_s,
                                   script.with_suffix(".status.lua")), limit)
        result["status_sample"] = parse_statuses(counted["wrk_output"])
    post(server, request, cfg.wrk_timeout_s)
    return {**result, "threads": threads_for(connections), "load1_before": round(load, 2),
            "wrk_argv": " ".join(argv[1:])}


def _check_line(checks: dict) -> str:
    return "; ".join(f"{p} {'ok' if c['ok'] else 'WRONG'} (top-1 {c.get('top1')}, max diff "
                     f"{c.get('max_abs_diff', float('nan')):.2g})" if "error" not in c else f"{p} FAILED {c['error']}"
                     for p, c in checks.items())


def _level_line(r: dict) -> str:
    return (f"  round {r['round']} {r['server']:8s} {r['path']:10s} c={r['connections']:<3d} "
            f"{r['ok_per_s']:8.1f} req/s (2xx)  p50 {r['p50_ms']:8.2f} ms  p99 {r['p99_ms']:8.2f} ms  "
            f"non-2xx {r['non_2xx']}  socket errors {sum(r['socket_errors'].values())}")
