"""`python -m vitserve.bench.shadow`: what a shadow version costs the version that answers, and whether the
agreement figures it reports are right. Measured on a real `vitserve serve --model-repository` (explicit control
mode) as a user starts it.

- cost: `clients` closed-loop wrk connections on /v1/classify (one Fashion-MNIST test image as PNG) with no
  shadow, a shadow at each of `fractions`, alternating arms over `rounds` rounds on one server (each arm's config is
  written and loaded, which leaves the served version's session in place). Per arm: the served version's answers/s
  and p50/p99, the engine process's CPU time per answer, and the shadow's copies offered, compared and dropped.
- agreement: `agreement_images` Fashion-MNIST test images, normalised here, sent as /v2 FP32 tensors one at a
  time with the shadow at 100%; GET /v1/models/{name}/shadow against the same figures computed offline from each
  file alone in ONNX Runtime with scipy's Jensen-Shannon distance and Spearman correlation.

The shadow is by default the distilled student (training/vit-fmnist-distilled), exported on first use (needs
torch). Writes a Markdown report and its JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx
import numpy as np

from vitserve.bench.config import add_config_flags
from vitserve.bench.peers.bodies import PeerRequest
from vitserve.bench.peers.wrk import find_wrk, run_wrk, write_script, wrk_argv
from vitserve.bench.report import publish
from vitserve.bench.repository import AUTH, ENGINE_NAME, Server, place

MODEL = "vit-fmnist"
FASHION_MNIST_TEST = Path("/usr/share/datasets/fashion-mnist/t10k-images-idx3-ubyte.gz")


@dataclass
class ShadowBenchConfig:
    primary: str = "models/vit-fmnist/model.onnx"
    shadow: str = "training/vit-fmnist-distilled/checkpoint"  # an ONNX file, or a checkpoint exported on first use
    clients: str = "32,4"  # saturating, and with headroom
    rounds: int = 3
    seconds: float = 10.0
    fractions: str = "0.1,1"
    shadow_priority: str = "idle"  # the shadow's cpu_priority in its config.json
    agreement_images: int = 1000
    out: Path = Path("build/bench/shadow.md")  # a section of docs/results/bench-shadow.md by bench/pages.py `put`
    cache_dir: Path = Path("build/bench/models")


@dataclass
class Report:
    config: dict
    machine: str = ""
    arms: list[dict] = field(default_factory=list)  # one per (round, fraction)
    agreement: dict = field(default_factory=dict)


def shadow_file(cfg: ShadowBenchConfig) -> Path:
    given = Path(cfg.shadow)
    if given.suffix == ".onnx":
        return given
    out = cfg.cache_dir / f"shadow-{given.parent.name}.onnx"
    if not out.is_file():
        print(f"exporting {given} to {out} ...", flush=True)
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_suffix(".partial.onnx")
        subprocess.run([sys.executable, "-m", "vitserve.cli", "export", str(given), "--out", str(partial)],
                       check=True, timeout=1800)
        partial.replace(out)
    return out


def test_images(count: int) -> np.ndarray:
    from vitserve.model.data import read_idx
    return read_idx(FASHION_MNIST_TEST)[:count]


def png(image: np.ndarray) -> bytes:
    import io

    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, "PNG")
    return buffer.getvalue()


def config_for(fraction: float, priority: str = "idle", **shadow) -> dict:
    config = {"version_policy": {"specific": {"versions": [1]}}}
    if not fraction:
        return config
    return {**config, "shadow": {"version": 2, "fraction": fraction, "cpu_priority": priority, **shadow}}


def engine_cpu_s(server: Server) -> float:
    """The engine process's user + system CPU seconds so far."""
    import os
    for status in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = status.read_text().rsplit(")", 1)
            name = fields[0].split("(", 1)[1]
        except (OSError, IndexError):
            continue
        rest = fields[1].split()
        if name == ENGINE_NAME and int(rest[1]) == server.process.pid:
            return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")
    raise RuntimeError("no engine process found")


def shadow_report(server: Server) -> dict | None:
    reply = httpx.get(f"{server.url}/v1/models/{MODEL}/shadow", headers=AUTH, timeout=30)
    return reply.json() if reply.status_code == 200 else None


def _shadow_pair(server: Server) -> dict:
    """The one shadow pair's counts and figures, from a server that has loaded the shadow."""
    report = shadow_report(server)
    if report is None:
        raise RuntimeError(f"{MODEL} has no shadow report: is its shadow loaded?")
    return report["pairs"][0]


def cost_arm(server: Server, root: Path, fraction: float, clients: int, script: Path, wrk: str,
             cfg: ShadowBenchConfig) -> dict:
    (root / MODEL / "config.json").write_text(json.dumps(config_for(fraction, cfg.shadow_priority)))
    server.control("load", MODEL)
    target = f"{server.url}/v1/classify?model={MODEL}"
    run_wrk(wrk_argv(wrk, target, clients, 2, 30, script), 60)  # settle: batcher sizes, caches
    time.sleep(1)
    before_cpu, before = engine_cpu_s(server), shadow_report(server)
    result = run_wrk(wrk_argv(wrk, target, clients, round(cfg.seconds), 30, script), cfg.seconds + 60)
    cpu = engine_cpu_s(server) - before_cpu
    after = shadow_report(server)
    arm = {"clients": clients, "fraction": fraction, "ok_per_s": result["ok_per_s"], "p50_ms": result.get("p50_ms"),
           "p99_ms": result.get("p99_ms"), "non_2xx": result["non_2xx"],
           "engine_cpu_ms_per_answer": 1000 * cpu / max(1, result["requests"] - result["non_2xx"])}
    if after is not None:
        pair, earlier = after["pairs"][0] if after["pairs"] else {}, (before or {}).get("pairs") or [{}]
        arm.update({k: pair.get(k, 0) - earlier[0].get(k, 0) for k in ("offered", "compared", "dropped", "failed")})
    return arm


async def send_tensors(url: str, pixels: np.ndarray) -> list[str]:
    """Each image as one /v2 FP32 tensor request, one at a time; the versions that answered."""
    versions = []
    async with httpx.AsyncClient(base_url=url, timeout=60) as client:
        for image in pixels:
            body = {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, *image.shape],
                                "data": image.ravel().tolist()}]}
            reply = await client.post(f"/v2/models/{MODEL}/infer", json=body)
            reply.raise_for_status()
            versions.append(reply.json()["model_version"])
    return versions


def offline(primary: Path, shadow: Path, pixels: np.ndarray) -> dict:
    """The figures from each file alone (batch 1, ONNX Runtime's CPU provider) and scipy's formulas."""
    import onnxruntime as ort
    from scipy.spatial.distance import jensenshannon
    from scipy.stats import spearmanr

    from vitserve.service.engine.inference_model import read_model_file_info
    runs = []
    for path in (primary, shadow):
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        info = read_model_file_info(path)
        outputs = [session.run(["logits", "rollout"], {"pixel_values": image[None]}) for image in pixels]
        runs.append(([o[0][0].astype(np.float64) for o in outputs], [o[1][0] for o in outputs], info))
    (logits_a, maps_a, info_a), (logits_b, maps_b, info_b) = runs

    def probabilities(logits, temperature):
        scaled = logits / temperature
        e = np.exp(scaled - scaled.max())
        return e / e.sum()
    agreed = [info_a.labels[int(np.argmax(a))] == info_b.labels[int(np.argmax(b))] for a, b in zip(logits_a, logits_b)]
    divergences = [jensenshannon(probabilities(a, info_a.temperature), probabilities(b, info_b.temperature), base=2)
                   ** 2 for a, b in zip(logits_a, logits_b)]
    correlations = [spearmanr(a.ravel(), b.ravel()).statistic for a, b in zip(maps_a, maps_b)]
    return {"compared": len(pixels), "top1_agreement": float(np.mean(agreed)),
            "mean_js_divergence": float(np.mean(divergences)),
            "mean_map_rank_correlation": float(np.nanmean(correlations))}


def agreement(server: Server, root: Path, primary: Path, shadow: Path, count: int) -> dict:
    from vitserve.service.engine.inference_model import read_model_file_info
    # a queue for every image (none is dropped), and a config unlike the cost arms': the comparison starts afresh
    (root / MODEL / "config.json").write_text(json.dumps(config_for(1.0, max_queue_size=count)))
    server.control("load", MODEL)
    info = read_model_file_info(primary)
    images = test_images(count).astype(np.float32) / 255
    pixels = ((images[:, None] - np.array(info.mean, np.float32)[:, None, None]) /
              np.array(info.std, np.float32)[:, None, None]).astype(np.float32)
    versions = asyncio.run(send_tensors(server.url, pixels))
    deadline = time.monotonic() + 120
    while (served := _shadow_pair(server))["compared"] + served["dropped"] + served["failed"] < count \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    expected = offline(primary, shadow, pixels)
    return {"answered_by": sorted(set(versions)), "served": {k: served[k] for k in (
        "offered", "compared", "dropped", "failed", "top1_agreement", "mean_js_divergence",
        "mean_map_rank_correlation", "shadow_latency_ms")}, "offline": expected,
        "differences": {k: abs(served[k] - expected[k]) for k in ("top1_agreement", "mean_js_divergence",
                                                                   "mean_map_rank_correlation")}}


def render(report: Report) -> str:
    cfg = report.config
    lines = ["# A shadow version's cost and figures (`python -m vitserve.bench.shadow`)", "",
             f"Machine: {report.machine}. Served version 1: `{cfg['primary']}`; shadow version 2: `{cfg['shadow']}`. "
             f"{cfg['clients']} wrk connections (closed loop) on `/v1/classify` (one Fashion-MNIST test image as PNG), "
             f"{cfg['seconds']} s per arm after a 2 s settling run, arms alternating over {cfg['rounds']} rounds on "
             f"one `vitserve serve` (default workers and engine process; the shadow's `cpu_priority` "
             f"{cfg['shadow_priority']}).", "", "## Cost to the served version", "",
             "| round | clients | shadow fraction | answers/s | p50 ms | p99 ms | non-2xx | engine CPU ms / answer | "
             "copies offered | compared | dropped | failed |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- "
             "| --- | --- | --- |"]
    for arm in report.arms:
        lines.append(f"| {arm['round']} | {arm['clients']} | {arm['fraction']:g} | {arm['ok_per_s']:.1f} | "
                     f"{arm['p50_ms']:.2f} | "
                     f"{arm['p99_ms']:.2f} | {arm['non_2xx']} | {arm['engine_cpu_ms_per_answer']:.3f} | "
                     f"{arm.get('offered', '')} | {arm.get('compared', '')} | {arm.get('dropped', '')} | "
                     f"{arm.get('failed', '')} |")
    lines += ["", "Medians over the rounds, as a ratio of no shadow:", "",
              "| clients | shadow fraction | answers/s | p99 | engine CPU / answer | share of copies compared |",
              "| --- | --- | --- | --- | --- | --- |"]
    for (clients, fraction), row in summary(report).items():
        lines.append(f"| {clients} | {fraction:g} | {row['throughput']:.3f}x | {row['p99']:.3f}x | {row['cpu']:.3f}x | "
                     f"{row['compared_share']} |")
    a = report.agreement
    if a:
        lines += ["", "## The figures against an offline computation", "",
                  f"{a['served']['offered']} test images sent one at a time as /v2 FP32 tensors (answered by version "
                  f"{', '.join(a['answered_by'])}), the shadow at 100%: {a['served']['compared']} compared, "
                  f"{a['served']['dropped']} dropped, {a['served']['failed']} failed.", "",
                  "| figure | served (GET /v1/models/{name}/shadow) | offline (ONNX Runtime per file, scipy) | "
                  "difference |", "| --- | --- | --- | --- |"]
        for key in ("top1_agreement", "mean_js_divergence", "mean_map_rank_correlation"):
            lines.append(f"| {key} | {a['served'][key]:.6f} | {a['offline'][key]:.6f} | {a['differences'][key]:.2e} |")
        lines += ["", f"The shadow's latency (offer to result): {a['served']['shadow_latency_ms']} ms."]
    return "\n".join(lines)


def summary(report: Report) -> dict:
    """(clients, fraction) -> the medians over the rounds of each arm's ratio to the same round's no-shadow arm."""
    import statistics
    out: dict[tuple[int, float], dict] = {}
    for clients, fraction in sorted({(a["clients"], a["fraction"]) for a in report.arms if a["fraction"]},
                                    key=lambda key: (-key[0], key[1])):
        ratios: dict[str, list[float]] = {"throughput": [], "p99": [], "cpu": []}
        shares: list[float] = []
        for arm in (a for a in report.arms if (a["clients"], a["fraction"]) == (clients, fraction)):
            base = next(b for b in report.arms if (b["round"], b["clients"], b["fraction"]) ==
                        (arm["round"], clients, 0))
            ratios["throughput"].append(arm["ok_per_s"] / base["ok_per_s"])
            ratios["p99"].append(arm["p99_ms"] / base["p99_ms"])
            ratios["cpu"].append(arm["engine_cpu_ms_per_answer"] / base["engine_cpu_ms_per_answer"])
            if arm.get("offered"):
                shares.append(arm["compared"] / arm["offered"])
        out[clients, fraction] = {k: statistics.median(v) for k, v in ratios.items()}
        out[clients, fraction]["compared_share"] = f"{statistics.median(shares):.1%}" if shares else ""
    return out


def machine() -> str:
    import os
    import platform
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{model}, {os.cpu_count()} cores"


def run(cfg: ShadowBenchConfig) -> Report:
    primary, shadow = Path(cfg.primary), shadow_file(cfg)
    fractions = [0.0] + [float(f) for f in cfg.fractions.split(",")]
    report, wrk = Report({k: str(v) for k, v in asdict(cfg).items()}, machine()), find_wrk()
    with tempfile.TemporaryDirectory(prefix="vitserve-bench-shadow-") as directory:
        root = Path(directory) / "repository"
        place(root, MODEL, 1, primary)
        place(root, MODEL, 2, shadow)
        (root / MODEL / "config.json").write_text(json.dumps(config_for(0)))
        script = write_script(Path(directory) / "wrk", MODEL, PeerRequest(
            "/v1/classify", png(test_images(1)[0]), {"Content-Type": "image/png", "Authorization": AUTH[
                "Authorization"]}))
        server = Server(root, [MODEL])
        try:
            for round_ in range(1, cfg.rounds + 1):
                order = fractions if round_ % 2 else list(reversed(fractions))  # alternate which arm goes first
                for clients in (int(c) for c in cfg.clients.split(",")):
                    for fraction in order:
                        arm = {"round": round_, **cost_arm(server, root, fraction, clients, script, wrk, cfg)}
                        report.arms.append(arm)
                        print(json.dumps(arm), flush=True)
            if cfg.agreement_images:
                report.agreement = agreement(server, root, primary, shadow, cfg.agreement_images)
        finally:
            server.stop()
    return report


def main(argv: list[str] | None = None) -> int:
    d = ShadowBenchConfig()
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.shadow", description=__doc__.split("\n\n")[0])
    add_config_flags(p, d)
    cfg = ShadowBenchConfig(**vars(p.parse_args(argv)))
    report = run(cfg)
    publish(render(report) + "\n", asdict(report), cfg.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
