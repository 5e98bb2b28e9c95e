"""What the token-budget controller does on a step in load: one server, an open loop at half its saturation, then
at twice it, then at half again, while its /metrics are read every `sample_s`; the answers' budgets (tokens, and
why) over time beside the offered rate, as a JSON record and a plot (docs/token-budgets.md).

    python -m vitserve.bench.budget_step --out docs/results/budget-step      # the default model, 2 cores

The saturation (answers a second at the full budget) is measured first, by a closed loop of 64 clients on a server
that does not degrade; the step then runs on a fresh server with the settings given.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import closed_loop, encode_request, make_images
from vitserve.bench.overload import OpenLoop, Request
from vitserve.bench.servers import ServerProcess, free_port, metric_samples, serve_argv
from vitserve.onnx_header import read_model_info

PHASES = ((0.5, 6.0), (2.0, 10.0), (0.5, 6.0))  # (x saturation, seconds)


def budget_counts(port: int) -> dict[str, dict[str, float]]:
    """vitserve_budget_answers_total now, by tokens and by reason (summed over versions)."""
    counts: dict[str, dict[str, float]] = {"tokens": {}, "reason": {}}
    for sample in metric_samples(port):
        if sample.name == "vitserve_budget_answers_total":
            for key in ("tokens", "reason"):
                label = sample.labels[key] or "full"
                counts[key][label] = counts[key].get(label, 0.0) + sample.value
    return counts


async def sample(port: int, every_s: float, stop: asyncio.Event, samples: list[dict]) -> None:
    started = time.monotonic()
    while not stop.is_set():
        counts = await asyncio.to_thread(budget_counts, port)
        samples.append({"t": time.monotonic() - started, **counts})
        await asyncio.sleep(every_s)


async def run_phases(port: int, payloads: list[bytes], saturation: float, sample_s: float) -> dict:
    samples: list[dict] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample(port, sample_s, stop, samples))
    phases, started = [], time.monotonic()
    for factor, seconds in PHASES:
        rate = factor * saturation
        load = OpenLoop(LOOPBACK, port, [Request("png", p) for p in payloads], rate, seconds, timeout_s=15.0)
        begun = time.monotonic() - started
        await load.send()
        ended = time.monotonic() - started
        asyncio.create_task(load.drain())  # its late answers need not hold the next phase
        statuses: dict[str, int] = {}
        for answer in load.answers:
            statuses[str(answer.outcome)] = statuses.get(str(answer.outcome), 0) + 1
        phases.append({"factor": factor, "rate": rate, "start_s": begun, "end_s": ended, "outcomes": statuses})
    await asyncio.sleep(2 * sample_s)
    stop.set()
    await sampler
    return {"phases": phases, "samples": samples}


def intervals(samples: list[dict], window_s: float = 1.0) -> list[dict]:
    """At each sample, over the `window_s` before it (batches answer in bursts): answers a second, their mean tokens,
    the share degraded by load."""
    rows = []
    for j, b in enumerate(samples):
        a = next((s for s in reversed(samples[:j]) if b["t"] - s["t"] >= window_s), None)
        if a is None:
            continue
        by_tokens = {k: b["tokens"].get(k, 0) - a["tokens"].get(k, 0) for k in b["tokens"]}
        answered = sum(by_tokens.values())
        load = b["reason"].get("load", 0) - a["reason"].get("load", 0)
        rows.append({"t": b["t"], "answers_per_s": answered / (b["t"] - a["t"]),
                     "mean_tokens": sum(int(k) * n for k, n in by_tokens.items()) / answered if answered else None,
                     "degraded_share": load / answered if answered else None})
    return rows


def plot(record: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in record["intervals"] if r["mean_tokens"] is not None]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5), sharex=True)
    offered_t, offered = [], []
    for phase in record["phases"]:
        offered_t += [phase["start_s"], phase["end_s"]]
        offered += [phase["rate"], phase["rate"]]
    top.plot(offered_t, offered, label="offered (req/s)", color="grey")
    top.plot([r["t"] for r in rows], [r["answers_per_s"] for r in rows], label="answered (images/s)")
    top.axhline(record["saturation_per_s"], linestyle=":", color="black", label="saturation, full budget")
    top.set_ylabel("per second")
    top.legend(loc="upper left", fontsize=8)
    bottom.step([r["t"] for r in rows], [r["mean_tokens"] for r in rows], where="post", label="mean tokens")
    bottom.set_ylabel("tokens per answer")
    bottom.set_xlabel("seconds")
    bottom.set_ylim(0, record["full_tokens"] * 1.1)
    fig.suptitle(f"{record['model']}: the budget under a step in load")
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.budget_step", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="models/vit-fmnist/model.onnx")
    p.add_argument("--out", default="build/bench/budget-step", help="writes OUT.json and OUT.png")
    p.add_argument("--sample-s", type=float, default=0.25)
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", help="a server setting")
    args = p.parse_args(argv)
    model = Path(args.model)
    info = read_model_info(str(model))
    settings = dict(s.split("=", 1) for s in args.set)
    pngs = make_images("png", info.image_size, info.channels, 64, 0)
    payloads = [encode_request("POST", "/v1/classify?map=rollout", data, "image/png") for data in pngs]
    with served(model, {**settings, "degrade_under_load": "false"}) as port:  # the full budget's saturation
        closed = asyncio.run(closed_loop(LOOPBACK, port, payloads, 64, warmup_s=1.0, duration_s=5.0, timeout_s=60.0))
    saturation = closed["requests_per_s"]
    print(f"saturation at the full budget: {saturation:.1f} req/s (64 clients)", flush=True)
    with served(model, settings) as port:
        record = asyncio.run(run_phases(port, payloads, saturation, args.sample_s))
    record = {"model": info.name, "file": str(model), "full_tokens": info.ladder[0].tokens,
              "saturation_per_s": saturation, "settings": args.set, "machine": platform.processor() or
              platform.machine(), "cores": os.cpu_count(), **record}
    record["intervals"] = intervals(record.pop("samples"))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    plot(record, out.with_suffix(".png"))
    for phase in record["phases"]:
        print(f"{phase['factor']:g}x ({phase['rate']:.0f} req/s) {phase['start_s']:.1f}-{phase['end_s']:.1f} s: "
              f"{phase['outcomes']}")
    print(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")
    return 0


@contextmanager
def served(model: Path, settings: dict[str, str]) -> Iterator[int]:
    """`vitserve serve` with these settings on a free port, ready; its port."""
    port = free_port()
    env = {"VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0",
           **{f"VITSERVE_{k.upper()}": v for k, v in settings.items()}}
    with ServerProcess(serve_argv(model, port), port, env=env):
        yield port


if __name__ == "__main__":
    sys.exit(main())
