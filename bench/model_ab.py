"""`python -m vitserve.bench.model_ab A.onnx B.onnx`: the same server code serving two model files, side by side:
does a re-export (new outputs, a new opset, other weights) cost the served latency? With `--query-a` / `--query-b`
each arm asks its own query of /v1/classify, so one file against itself compares two kinds of answer (e.g.
`--query-a map=rollout --query-b map=relevance`: what the relevance map costs served).

Each round starts `vitserve serve --model FILE --engine process` for A, then for B (B first in even rounds), and
drives each with Debian's wrk at every client count on /v1/classify (one Fashion-MNIST test image as PNG): 2 s
settling, then the measured window. Reports answers/s, p50 and p99 per arm, and B's medians over the rounds as ratios
to the same round's A. Writes a Markdown report and its JSON.

With `--profile-seconds N`, after the rounds each file is served once more at the largest client count while
py-spy samples every process of the server for N seconds (outside the measured rounds: the sampler costs CPU):
the report then says where B's time goes that A's does not, as each function's share of the samples of the
engine and of the frontend, the functions whose share moved most first.
"""
from __future__ import annotations

import argparse
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import httpx

from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.wrk import find_wrk, run_wrk, write_script, wrk_argv
from vitserve.bench.report import publish
from vitserve.bench.servers import free_port
from vitserve.bench.shadow import machine, png, test_images
from vitserve.machine import process_cpu_seconds, process_tree
from vitserve.service.engine.server import PROCESS_NAME as ENGINE_PROCESS_NAME


def serve(model: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # with the engine process, whatever `--engine auto` would choose for the file: the profile's two roles
    process = subprocess.Popen([sys.executable, "-m", "vitserve.cli", "serve", "--model", str(model), "--port",
                                str(port), "--grpc-port", "0", "--log-level", "warning", "--engine", "process"],
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


def process_role(pid: int) -> str | None:
    """"engine" (a process named the engine's PROCESS_NAME) or "frontend" (the supervisor and HTTP workers), None
    for a process gone meanwhile: which side of the process boundary a cost lies on."""
    try:
        return "engine" if Path(f"/proc/{pid}/comm").read_text().strip() == ENGINE_PROCESS_NAME else "frontend"
    except OSError:
        return None


def engine_and_frontend_cpu_seconds(pid: int) -> tuple[float, float]:
    """CPU seconds of the server's engine processes and of the rest of its tree (`process_role`)."""
    seconds = {"engine": 0.0, "frontend": 0.0}
    for child in process_tree(pid):
        role = process_role(child)
        if role is not None:
            seconds[role] += process_cpu_seconds(child)
    return seconds["engine"], seconds["frontend"]


def arm(model: Path, label: str, clients: list[int], seconds: int, script: Path, wrk: str, round_: int,
        query: str = "") -> list[dict]:
    process, url = serve(model)
    try:
        rows = []
        for count in clients:
            target = f"{url}/v1/classify" + (f"?{query}" if query else "")
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


# A py-spy raw line: "frame;frame;... COUNT", a frame "function (path:line)"
_FRAME_LINE = re.compile(r":\d+\)$")
# a layer's file as the server imported it (vitserve/service/..., through vitserve/'s link) -> its path in the
# repository
_LAYER_LINK = re.compile(r"\(vitserve/(model|export|service|evaluation|bench)/")
PROFILE_ROWS = 12


def find_py_spy() -> str | None:
    """py-spy beside this Python (the dev extras install it there), else on PATH; None without it."""
    return shutil.which("py-spy", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}")


def inclusive_shares(raw: str) -> tuple[Counter, int]:
    """py-spy's raw (collapsed) stacks -> (samples in which each function is on the stack, at any depth, counted
    once per sample; all samples). A function is its name and file, its line dropped, so a function's lines add
    up."""
    counts: Counter[str] = Counter()
    total = 0
    for line in raw.splitlines():
        stack, _, number = line.rpartition(" ")
        if not stack or not number.isdigit():
            continue
        samples = int(number)
        total += samples
        for frame in {_LAYER_LINK.sub(r"(\1/", _FRAME_LINE.sub(")", f)) for f in stack.split(";")}:
            counts[frame] += samples
    return counts, total


def profile_arm(model: Path, label: str, clients: int, seconds: int, script: Path, wrk: str, spy: str,
                directory: Path) -> dict:
    """Serve `model` under wrk at `clients` while py-spy samples each of the server's processes for `seconds`:
    {"file", "roles": {role: {"total": samples, "functions": {function: samples}}}}."""
    process, url = serve(model)
    try:
        target = f"{url}/v1/classify"
        run_wrk(wrk_argv(wrk, target, clients, 2, 30, script), 60)
        load = subprocess.Popen(wrk_argv(wrk, target, clients, seconds + 3, 30, script), stdout=subprocess.DEVNULL)
        time.sleep(1)
        samplers = []
        for pid in process_tree(process.pid):
            role, raw = process_role(pid), directory / f"{label}-{pid}.txt"
            if role is not None:
                samplers.append((role, raw, subprocess.Popen(
                    [spy, "record", "--pid", str(pid), "--duration", str(seconds), "--rate", "100", "--format",
                     "raw", "--nonblocking", "--output", str(raw)], stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE)))
        roles: dict[str, dict] = {}
        for role, raw, sampler in samplers:
            _, err = sampler.communicate(timeout=seconds + 60)
            if sampler.returncode != 0 and not raw.exists():
                raise SystemExit(f"py-spy could not sample {role} process: {err.decode(errors='replace')[-500:]}")
            counts, total = inclusive_shares(raw.read_text() if raw.exists() else "")
            into = roles.setdefault(role, {"total": 0, "functions": Counter()})
            into["total"] += total
            into["functions"].update(counts)
        load.wait(seconds + 60)
        return {"file": label, "roles": {r: {"total": v["total"], "functions": dict(v["functions"])}
                                         for r, v in roles.items()}}
    finally:
        process.terminate()
        process.wait(60)


def share_moves(a: dict, b: dict) -> list[tuple[str, float, float, float]]:
    """(function, A's share, B's share, z) of every function sampled in either, the most certain moves first: z is
    the two-proportion z statistic of the shares (the pooled share's binomial noise), so a function that appears
    only in B (a new output's code) outranks the wrappers whose shares move a few per cent with the noise."""
    moves = []
    for function in set(a["functions"]) | set(b["functions"]):
        share_a, share_b = a["functions"].get(function, 0) / a["total"], b["functions"].get(function, 0) / b["total"]
        pooled = (a["functions"].get(function, 0) + b["functions"].get(function, 0)) / (a["total"] + b["total"])
        noise = math.sqrt(pooled * (1 - pooled) * (1 / a["total"] + 1 / b["total"]))
        moves.append((function, share_a, share_b, (share_b - share_a) / noise if noise else 0.0))
    return sorted(moves, key=lambda m: (-abs(m[3]), m[0]))


def render_profile(profiles: list[dict], clients: int, seconds: int) -> list[str]:
    """Per role, the functions whose share of the samples moved most certainly between A and B."""
    by_file = {p["file"]: p["roles"] for p in profiles}
    lines = ["", f"## Where the time goes: py-spy, {seconds} s per file at {clients} clients", "",
             "Each function's share of its processes' samples (the function anywhere on the stack), A and B, served "
             "once more after the rounds with py-spy sampling at 100 Hz (outside the measured rounds). The "
             f"{PROFILE_ROWS} moves least likely to be sampling noise first: z is the difference over its binomial "
             "standard error (|z| under 2 is within the noise).", ""]
    for role in ("frontend", "engine"):
        a, b = by_file["A"].get(role), by_file["B"].get(role)
        if not a or not b or not a["total"] or not b["total"]:
            continue
        lines += [f"{role}: {a['total']:,} samples of A, {b['total']:,} of B", "",
                  "| function | A | B | B - A | z |", "| --- | ---: | ---: | ---: | ---: |"]
        lines += [f"| `{f}` | {share_a:.2%} | {share_b:.2%} | {share_b - share_a:+.2%} | {z:+.1f} |"
                  for f, share_a, share_b, z in share_moves(a, b)[:PROFILE_ROWS]]
        lines.append("")
    return lines


def render(a: Path, b: Path, rows: list[dict], rounds: int, seconds: int, profile: Sequence[str] = (),
           queries: tuple[str, str] = ("", "")) -> str:
    named = [f"`{path}`" + (f" asked `?{query}`" if query else "") for path, query in zip((a, b), queries)]
    lines = ["# One server, two model files (`python -m vitserve.bench.model_ab`)", "",
             f"Machine: {machine()}. A: {named[0]}; B: {named[1]}. wrk on `/v1/classify` (one Fashion-MNIST test "
             f"image as PNG), "
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
        ratios: dict[str, list[float]] = {key: [] for key in ("ok_per_s", "p50_ms", "p99_ms", "cpu_ms", "engine_cpu_ms",
                                                              "frontend_cpu_ms")}
        for round_ in sorted({r["round"] for r in rows}):
            pair = {r["file"]: r for r in rows if (r["round"], r["clients"]) == (round_, count)}
            for key in ratios:
                ratios[key].append(pair["B"][key] / pair["A"][key])
        lines.append(f"| {count} | " + " | ".join(f"{statistics.median(v):.3f}x" for v in ratios.values()) + " |")
        spreads.append(f"| {count} | " + " | ".join("{:.3f}-{:.3f}x".format(*median_interval(v))
                                                    for v in ratios.values()) + " |")
    lines += ["", "How far those medians can be trusted: a 95% interval of each (the rounds resampled 2,000 times). A "
                  "difference is resolved only where the interval leaves 1.0x out; run more rounds to narrow it. The "
                  "resampling sees the rounds' spread, not drift that favours one arm: a file against a copy of "
                  "itself shows how far this machine moves with no difference at all:", "",
              "| clients | answers/s | p50 | p99 | server CPU / answer | engine | frontend |",
              "| --- | --- | --- | --- | --- | --- | --- |", *spreads, *profile]
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
    p.add_argument("--query-a", default="", help="A's query string on /v1/classify, e.g. map=rollout (default none)")
    p.add_argument("--query-b", default="", help="B's query string, e.g. map=relevance (default none)")
    p.add_argument("--profile-seconds", type=int, default=0,
                   help="after the rounds, sample each file's server with py-spy for this long (default 0: not)")
    args = p.parse_args(argv)
    clients, wrk, rows, profiles = [int(c) for c in args.clients.split(",")], find_wrk(), [], []
    spy = find_py_spy()
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    if args.profile_seconds and spy is None:
        p.error("--profile-seconds needs py-spy (pip install py-spy)")
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-ab-") as directory:
        script = write_script(Path(directory), "ab", PeerRequest("/v1/classify", png(test_images(1)[0]),
                                                                 {"Content-Type": "image/png"}))
        for round_ in range(1, args.rounds + 1):
            arms = [("A", args.a, args.query_a), ("B", args.b, args.query_b)]
            for label, model, query in arms if round_ % 2 else arms[::-1]:
                rows += arm(model, label, clients, args.seconds, script, wrk, round_, query)
                print(rows[-1], flush=True)
        if args.profile_seconds:
            assert spy is not None  # p.error refused --profile-seconds without py-spy
            for label, model in [("A", args.a), ("B", args.b)]:
                profiles.append(profile_arm(model, label, max(clients), args.profile_seconds, script, wrk, spy,
                                            Path(directory)))
    profile = render_profile(profiles, max(clients), args.profile_seconds) if profiles else []
    publish(render(args.a, args.b, rows, args.rounds, args.seconds, profile, (args.query_a, args.query_b)),
            {"a": str(args.a), "b": str(args.b), "query_a": args.query_a, "query_b": args.query_b, "rows": rows,
             "profiles": profiles}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
