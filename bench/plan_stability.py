"""`python -m vitserve.bench.plan_stability`: the same file, the same answer, the same speed. A real `vitserve serve
--model-repository` (explicit control mode) serves one file as version 1, loaded at idle; `clients` closed-loop
clients post images to it; meanwhile the same file is loaded `loads` times as a new version (the latest-1 policy
retires the one before), and a second server is started on the same repository while the clients run. Each loaded
version is asked the same probe tensor (/v2 infer, float32, the logits), and its card says how it is served, why,
and what its load took.

Reports: each version's plan (runtime, precision, source, key), its load request's seconds and the server's own
ready time with its stages, and whether every version of both servers answered the probe with the same bits.
Writes a Markdown report and its JSON.
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from vitserve.bench.repository import Server, closed_loop, place, sample_png
from vitserve.machine import cpu_model_name, load_average

PROBE_IMAGES = 4


def probe_body(channels: int, height: int, width: int) -> dict:
    """A fixed float32 tensor of PROBE_IMAGES normalised images, asking for the logits."""
    pixels = np.random.default_rng(0).normal(size=(PROBE_IMAGES, channels, height, width)).astype(np.float32)
    return {"inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                        "data": pixels.ravel().tolist()}], "outputs": [{"name": "logits"}]}


def answer_of(url: str, model: str, version: str, body: dict) -> dict:
    """One version's probe answer (its logits' SHA-256 and first values) and its card's `serving`."""
    reply = httpx.post(f"{url}/v2/models/{model}/versions/{version}/infer", json=body, timeout=60)
    reply.raise_for_status()
    logits = np.asarray(reply.json()["outputs"][0]["data"], np.float32)
    card = httpx.get(f"{url}/v1/model", params={"model": model, "version": version}, timeout=60).json()
    serving = card["serving"]
    return {"version": version, "logits_sha256": hashlib.sha256(logits.tobytes()).hexdigest()[:16],
            "first_logits": [float(v) for v in logits[:3]], "provider": serving["provider"],
            "plan": f"{serving['runtime']}/{serving['precision_hint']}", "source": serving["source"],
            "key": serving["key"], "ready_s": serving["ready_s"], "stages_s": serving["load_stages_s"]}


async def routed_after(url: str, model: str, version: str, started: float) -> float:
    """Seconds from `started` until the HTTP front end says `version` is ready (polled every 20 ms): when a client
    can use it. The load request itself returns later: it also retires the version before (its admitted requests
    finish, and frontends in other processes have a grace period to hear of the change)."""
    async with httpx.AsyncClient(base_url=url, timeout=10) as client:
        while (await client.get(f"/v2/models/{model}/versions/{version}/ready")).status_code != 200:
            await asyncio.sleep(0.02)
    return time.perf_counter() - started


async def run(model: Path, loads: int, clients: int, tuning_dir: Path | None) -> dict:
    """`tuning_dir`: the servers' tuning records (None: a new empty one, so the plan is the declared one)."""
    png = sample_png()
    with tempfile.TemporaryDirectory(prefix="vitserve-plan-") as folder:
        os.environ["VITSERVE_TUNING_DIR"] = str(tuning_dir or Path(folder) / "tuning")  # the servers' environment
        root = Path(folder) / "repository"
        place(root, "fmnist", 1, model)
        first = Server(root, ["fmnist"])  # started at idle
        second = None
        try:
            card = httpx.get(f"{first.url}/v1/model", params={"model": "fmnist"}, timeout=60).json()
            body = probe_body(card["channels"], card["image_height"], card["image_width"])
            answers = [{**answer_of(first.url, "fmnist", "1", body), "server": "A (started idle)",
                        "load_request_s": None}]
            stop = asyncio.Event()
            traffic = asyncio.create_task(closed_loop(first.url, "fmnist", clients, 10_000, png, stop=stop))
            await asyncio.sleep(2)
            for version in range(2, loads + 2):
                place(root, "fmnist", version, model)
                started = time.perf_counter()
                request = asyncio.create_task(asyncio.to_thread(first.control, "load", "fmnist"))
                routed_s = await routed_after(first.url, "fmnist", str(version), started)
                seconds = await request
                answers.append({**answer_of(first.url, "fmnist", str(version), body), "server": "A, under load",
                                "load_request_s": round(seconds, 3), "routed_s": round(routed_s, 3)})
            second = await asyncio.to_thread(Server, root, ["fmnist"])  # started under the clients' load
            answers.append({**answer_of(second.url, "fmnist", str(loads + 1), body), "server": "B (started under "
                            "load)", "load_request_s": None})
            stop.set()
            served = await traffic
        finally:
            first.stop()
            if second is not None:
                second.stop()
    under_load = [a["ready_s"] for a in answers if a["server"] == "A, under load"]
    routed = [a["routed_s"] for a in answers if a["server"] == "A, under load"]
    return {"model": str(model), "loads": loads, "clients": clients, "answers": answers,
            "bit_identical": len({a["logits_sha256"] for a in answers}) == 1,
            "one_plan": len({(a["provider"], a["plan"], a["key"]) for a in answers}) == 1,
            "ready_s_under_load": {"median": statistics.median(under_load), "max": max(under_load)},
            "routed_s_under_load": {"median": statistics.median(routed), "max": max(routed)},
            "client_answers": len(served), "client_statuses": sorted({s for s, _, _ in served}),
            "machine": f"{cpu_model_name()}, {platform.machine()}", "load_average_after": load_average(),
            "date": time.strftime("%Y-%m-%d")}


def render(report: dict, command: str) -> str:
    lines = ["# The same file: the same answer, the same speed", "",
             f"`{command}`, {report['date']}, on {report['machine']}: the file `{report['model']}` served by a "
             f"repository server started at idle (A), loaded again as a new version {report['loads']} times while "
             f"{report['clients']} closed-loop clients post images to it, and by a second server started under that "
             f"load (B). Each version answered one fixed float32 tensor of {PROBE_IMAGES} images.", "",
             f"- **bit-identical logits on every load and on both servers: {report['bit_identical']}**; one plan "
             f"(provider, runtime/precision, record key) everywhere: {report['one_plan']}",
             f"- ready after a load request under load (the server's own clock, from the load's start to warm-up's "
             f"end): median {report['ready_s_under_load']['median']:.2f} s, max "
             f"{report['ready_s_under_load']['max']:.2f} s",
             f"- routed to (its /v2 ready endpoint answers 200) after the load request was sent: median "
             f"{report['routed_s_under_load']['median']:.2f} s, max {report['routed_s_under_load']['max']:.2f} s; "
             f"the load request returns later, once the version before is retired (its admitted requests finished, "
             f"and a 0.5 s grace for frontends to hear of the change)",
             f"- the clients' answers meanwhile: {report['client_answers']}, statuses {report['client_statuses']}", "",
             "| server | version | provider | plan (source) | logits SHA-256 | routed after s | load request s | "
             "ready s | stages s |",
             "| --- | --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for a in report["answers"]:
        stages = ", ".join(f"{name} {s:.2f}" for name, s in a["stages_s"].items())
        request = "" if a["load_request_s"] is None else f"{a['load_request_s']:.2f}"
        routed = "" if a.get("routed_s") is None else f"{a['routed_s']:.2f}"
        lines.append(f"| {a['server']} | {a['version']} | {a['provider']} | {a['plan']} ({a['source']}, key "
                     f"{a['key'][:8]}) | {a['logits_sha256']} | {routed} | {request} | {a['ready_s']:.2f} | "
                     f"{stages} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitserve.bench.plan_stability", description=__doc__)
    parser.add_argument("--model", type=Path, default=Path("models/vit-fmnist/model.onnx"))
    parser.add_argument("--loads", type=int, default=6)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--tuning-dir", type=Path, default=None,
                        help="the servers' tuning records (vitserve tune); default: none, the declared plan")
    parser.add_argument("--out", type=Path, default=Path("build/bench/plan-stability.md"))
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.model, args.loads, args.clients, args.tuning_dir))
    command = " ".join(["python -m vitserve.bench.plan_stability", *(argv if argv is not None else sys.argv[1:])])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render(report, command))
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(render(report, command))
    return 0 if report["bit_identical"] and report["one_plan"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
