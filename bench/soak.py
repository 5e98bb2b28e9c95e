"""`vitserve bench --mode hol` and `--mode soak`: what the server holds, in memory and file descriptors, and whether
small requests still get through, while heavy requests run (head-of-line) and over minutes of mixed traffic (soak).

Both read the server's whole process tree from /proc (bench/reliability.py), so a server that starts helper
processes is counted in full. Both put their load on the open loop of bench/overload.py: requests leave on a fixed
schedule, so a stalled server shows as latency, not as a client that politely waits.

- **head-of-line**: small requests (a PNG at the model's size) at 20 per second (fewer for a slow model: half what
  one client gets one at a time; or `hol_rate`), first alone, then while two heavy requests run together (a
  `hol_png_side`-pixel-square greyscale PNG with `?rollout=png`, and an Open Inference request of
  `hol_oip_shape`), `hol_repeats` times, then alone again. Memory idle, at its peak (sampled every 0.1 s) and
  after `settle_s` idle.
- **soak**: for `soak_minutes`, a fixed mix of good requests (PNG, JPEG with a rollout PNG, multipart batch, Open
  Inference) and bad ones (not an image, a truncated PNG, wrong tensors, an unknown model, a bad parameter, an
  upload abandoned half-way) at `soak_load` x the mix's saturation; memory and descriptors every `sample_s`: start,
  end, peak and slope. Outcomes per kind of request, with those a correct server would not give counted apart.
"""
from __future__ import annotations

import asyncio
import io
import json
import random
from dataclasses import dataclass

import numpy as np
from PIL import Image

from vitserve.artifact import INPUT_NAME
from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import HttpConnection, encode_request, make_images
from vitserve.bench.measure import CpuSnapshot, latency_summary
from vitserve.bench.overload import (
    HUNG_UP,
    Answer,
    OpenLoop,
    Request,
    Setup,
    exchange,
    one_at_a_time,
    outcome_summary,
    saturation,
    target_lines,
)
from vitserve.bench.reliability import (
    ReliabilityConfig,
    ServerUnderTest,
    TreeSample,
    TreeSampler,
    alternated,
    number,
    preamble,
    sample_tree,
    table,
)
from vitserve.bench.servers import free_port

_STREAM_LIMIT_S = 86_400.0  # the head-of-line test's small requests run until told to stop; this only bounds them


# ---------------------------------------------------------------------------------------------------- requests


def big_png(side: int) -> bytes:
    """A smooth greyscale `side` x `side` PNG: a small upload, every one of its pixels to decode."""
    ramp = (np.arange(side, dtype=np.uint32) * 255 // max(side - 1, 1)).astype(np.uint8)
    pixels = ramp[:, None] // 2 + ramp[None, :] // 2  # (side, side) uint8, a diagonal gradient
    buf = io.BytesIO()
    Image.fromarray(pixels, "L").save(buf, format="PNG", compress_level=1)
    return buf.getvalue()


def oip_body(shape: tuple[int, ...], seed: int = 0) -> bytes:
    """An Open Inference Protocol request: `pixel_values` of `shape`, random normalised values, 3 decimals."""
    data = np.round(np.random.default_rng(seed).normal(0, 1, int(np.prod(shape))), 3)
    tensor = {"name": INPUT_NAME, "shape": list(shape), "datatype": "FP32", "data": []}
    head, tail = json.dumps({"inputs": [tensor]}).split("[]", 1)  # the data list written directly: 10x faster
    return (head + "[" + ",".join(map(str, data.tolist())) + "]" + tail).encode()


def multipart(files: list[bytes], content_type: str = "image/png") -> tuple[bytes, str]:
    """A multipart/form-data body with each file as a `file` field, and its Content-Type."""
    boundary = "vitserve-bench-boundary"
    parts = [(f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="{i}"\r\n'
              f"Content-Type: {content_type}\r\n\r\n").encode() + data + b"\r\n" for i, data in enumerate(files)]
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def heavy_requests(setup: Setup, cfg: ReliabilityConfig) -> list[Request]:
    """The two heavy requests of the head-of-line test."""
    side, (batch, h, w), m = cfg.hol_png_side, cfg.hol_oip_shape, setup.model
    shape = (batch, m["channels"], h, w)
    return [Request(f"{side}x{side} PNG, rollout=png",
                    encode_request("POST", "/v1/classify?rollout=png", big_png(side), "image/png")),
            Request(f"Open Inference {'x'.join(map(str, shape))}",
                    encode_request("POST", f"/v2/models/{m['name']}/infer", oip_body(shape), "application/json"))]


@dataclass(frozen=True)
class MixItem:
    """One kind of request in the soak's mix: how often it comes, and the outcomes a correct server gives it."""

    request: Request
    weight: int
    expect: tuple[str, ...]


def soak_mix(setup: Setup, cfg: ReliabilityConfig) -> list[MixItem]:
    m, busy = setup.model, ("429",)  # a good request may meet a full queue
    png = setup.pngs(cfg)[0]
    jpeg = make_images("jpeg", (m["height"], m["width"]), m["channels"], 1, cfg.seed)[0]
    batch, batch_type = multipart(setup.pngs(cfg)[:4])
    shape = (1, m["channels"], m["height"] // m["patch_size"] * m["patch_size"],
             m["width"] // m["patch_size"] * m["patch_size"])
    infer = f"/v2/models/{m['name']}/infer"
    post = encode_request
    return [
        MixItem(Request("png", post("POST", "/v1/classify", png, "image/png")), 10, ("200", *busy)),
        MixItem(Request("jpeg 640x480, rollout=png", post("POST", "/v1/classify?rollout=png", jpeg, "image/jpeg")), 2,
                ("200", *busy)),
        MixItem(Request("batch of 4 (multipart)", post("POST", "/v1/classify/batch", batch, batch_type)), 1,
                ("200", *busy)),
        MixItem(Request("open inference 1 image", post("POST", infer, oip_body(shape), "application/json")), 2,
                ("200", *busy)),
        MixItem(Request("bad: not an image", post("POST", "/v1/classify", b"not an image " * 40, "image/png")), 1,
                ("400", "415", "422")),
        MixItem(Request("bad: truncated png", post("POST", "/v1/classify", png[: len(png) // 2], "image/png")), 1,
                ("400", "422")),
        MixItem(Request("bad: top_k=0", post("POST", "/v1/classify?top_k=0", png, "image/png")), 1, ("422",)),
        MixItem(Request("bad: tensor of wrong channels",
                        post("POST", infer, oip_body((1, m["channels"] + 1, *shape[2:])), "application/json")), 1,
                ("400", "422")),
        MixItem(Request("bad: json not json", post("POST", infer, b'{"inputs": [', "application/json")), 1,
                ("400", "422")),
        MixItem(Request("bad: unknown model", post("POST", "/v2/models/no-such-model/infer", oip_body(shape),
                                                   "application/json")), 1, ("404",)),
        MixItem(Request("hang up mid-upload", post("POST", "/v1/classify", png, "image/png")[: -len(png) // 2],
                        hang_up=True), 1, (HUNG_UP,)),
    ]


def mix_sequence(mix: list[MixItem], seed: int) -> list[Request]:
    """Every item `weight` times, in a fixed shuffled order (the open loop cycles through it)."""
    sequence = [item.request for item in mix for _ in range(item.weight)]
    random.Random(seed).shuffle(sequence)
    return sequence


# ---------------------------------------------------------------------------------------------------- memory


def resources(samples: list[TreeSample]) -> dict:
    """RSS (MB) and open descriptors: median of `samples` (several, so one odd reading does not decide)."""
    return {"rss_mb": float(np.median([s.rss_mb for s in samples])),
            "fds": int(np.median([s.fds for s in samples])), "threads": int(np.median([s.threads for s in samples])),
            "processes": max(s.processes for s in samples)}


async def steady_resources(pid: int, count: int = 5, gap_s: float = 0.2) -> dict:
    samples = []
    for _ in range(count):
        samples.append(await asyncio.to_thread(sample_tree, pid))
        await asyncio.sleep(gap_s)
    return resources(samples)


def slope_per_minute(samples: list[TreeSample], attribute: str) -> float:
    """The least-squares slope of `attribute` against time, per minute (NaN with fewer than 3 samples)."""
    if len(samples) < 3:
        return float("nan")
    t = np.array([s.t for s in samples]) / 60.0
    return float(np.polyfit(t - t[0], [getattr(s, attribute) for s in samples], 1)[0])


# ---------------------------------------------------------------------------------------------------- head-of-line


def run_head_of_line(cfg: ReliabilityConfig, overrides: dict[str, str], command: str) -> dict:
    setup = Setup.prepare(cfg, overrides)
    small = [Request("small png", encode_request("POST", "/v1/classify", data, "image/png"))
             for data in setup.pngs(cfg)]
    heavy = heavy_requests(setup, cfg)
    runs = []
    for round_, server in alternated(setup.servers, cfg.rounds):
        runs.append({"server": server.label, "round": round_ + 1,
                     **head_of_line_run(server, setup, small, heavy, cfg, overrides, f"round{round_ + 1}")})
        r = runs[-1]
        print(f"  small requests during heavy: max {number(r['small']['during']['max_ms'])} ms; RSS idle "
              f"{r['memory']['idle']['rss_mb']:.0f} MB, peak {r['memory']['peak_rss_mb']:.0f} MB, after "
              f"{r['memory']['after']['rss_mb']:.0f} MB", flush=True)
    return {**setup.report("hol", command, cfg, overrides, [r["cpu"]["other_cores"] for r in runs]),
            "heavy": [{"kind": h.kind, "bytes": len(h.payload)} for h in heavy], "runs": runs}


def head_of_line_run(server: ServerUnderTest, setup: Setup, small: list[Request], heavy: list[Request],
                     cfg: ReliabilityConfig, overrides: dict[str, str], tag: str) -> dict:
    port = free_port()
    print(f"head-of-line on {server.label}, {tag.replace('round', 'round ')}", flush=True)
    with server.start(setup.model_path, port, cfg, overrides, f"hol-{server.slug}-{tag}") as process:
        row = asyncio.run(_head_of_line(process.pid, port, small, heavy, setup.deadline_s(server), cfg))
    row["targets"] = head_of_line_targets(row, cfg)
    return row


async def _head_of_line(pid: int, port: int, small: list[Request], heavy: list[Request], deadline_s: float,
                        cfg: ReliabilityConfig) -> dict:
    timeout_s = deadline_s + cfg.timeout_margin_s
    await one_at_a_time(port, [r.payload for r in small], 5, timeout_s)  # warm
    alone = await one_at_a_time(port, [r.payload for r in small], 10, timeout_s)
    rate = cfg.hol_rate or min(20.0, 0.5 / float(np.median([a.latency_s for a in alone])))
    idle = await steady_resources(pid)
    stream, stop = OpenLoop(LOOPBACK, port, small, rate, _STREAM_LIMIT_S, timeout_s), asyncio.Event()
    edges: dict[str, CpuSnapshot] = {}
    async with TreeSampler(pid, 0.1) as memory:
        sending = asyncio.create_task(stream.send(stop, on_window=lambda e: edges.__setitem__(e,
                                                                                       CpuSnapshot.take(pid))))
        await asyncio.sleep(cfg.hol_phase_s)
        heavy_answers: list[Answer] = []
        for _ in range(cfg.hol_repeats):  # the two together, then the next two
            heavy_answers += await asyncio.gather(*(_heavy(port, r, cfg.heavy_timeout_s) for r in heavy))
        await asyncio.sleep(cfg.hol_phase_s)
        stop.set()
        await sending
        await stream.drain()
    await asyncio.sleep(cfg.settle_s)
    after = await steady_resources(pid)
    return {"small_rate": rate, "small": phases(stream.answers, heavy_answers),
            "heavy": by_kind(heavy_answers, [r.kind for r in heavy]),
            "memory": {"idle": idle, "peak_rss_mb": memory.peak_rss_mb,
                       "peak_fds": max(s.fds for s in memory.samples), "after": after},
            "cpu": edges["start"].usage(edges["end"])}


async def _heavy(port: int, request: Request, timeout_s: float) -> Answer:
    conn = HttpConnection(LOOPBACK, port)
    try:
        outcome, sent = await exchange(conn, request.payload, timeout_s)
    finally:
        await conn.close()
    return Answer(request.kind, outcome, sent, asyncio.get_running_loop().time() - sent)


def phases(small: list[Answer], heavy: list[Answer]) -> dict:
    """Small requests by when they were sent: before the first heavy request, while heavy ones ran (from the first
    sent to the last answered), after."""
    start = min(a.sent for a in heavy)
    end = max(a.sent + a.latency_s for a in heavy)
    groups = {"before": [a for a in small if a.sent < start], "during": [a for a in small if start <= a.sent <= end],
              "after": [a for a in small if a.sent > end]}
    return {name: _phase(answers) for name, answers in groups.items()} | {"heavy_phase_s": end - start}


def _phase(answers: list[Answer]) -> dict:
    ok = [a.latency_s for a in answers if a.outcome == "200"]
    return {"count": len(answers), "ok": len(ok), "outcomes": {o: v["count"] for o, v in
                                                               outcome_summary(answers).items()},
            **latency_summary(ok), "max_ms": max(ok) * 1000.0 if ok else float("nan")}


def head_of_line_targets(row: dict, cfg: ReliabilityConfig) -> list[dict]:
    during, memory = row["small"]["during"], row["memory"]
    idle, peak, after = memory["idle"]["rss_mb"], memory["peak_rss_mb"], memory["after"]["rss_mb"]
    back = idle + max(20.0, 0.25 * (peak - idle))
    return [
        {"name": f"small requests during the heavy ones, slowest of those answered 200 ({during['ok']} of "
                 f"{during['count']}; all must be)", "value_ms": during["max_ms"], "target": "<= 250 ms",
         "met": during["count"] > 0 and during["ok"] == during["count"] and during["max_ms"] <= 250.0},
        {"name": "server memory at its peak (RSS, all processes)", "value_mb": peak,
         "target": f"< {cfg.memory_limit_mb:.0f} MB", "met": peak < cfg.memory_limit_mb},
        {"name": "server memory after (idle again)", "value_mb": after,
         "target": f"<= {back:.0f} MB (idle + the larger of 20 MB and a quarter of the rise)", "met": after <= back},
    ]


# ---------------------------------------------------------------------------------------------------- soak


def run_soak(cfg: ReliabilityConfig, overrides: dict[str, str], command: str) -> dict:
    setup = Setup.prepare(cfg, overrides)
    mix = soak_mix(setup, cfg)
    sequence = mix_sequence(mix, cfg.seed)
    answerable = [r.payload for r in sequence if not r.hang_up]
    calibration = [] if cfg.soak_rate else [
        {"server": s.label, **saturation(s, setup.model_path, answerable, cfg, overrides)} for s in setup.servers]
    rate = cfg.soak_rate or cfg.soak_load * min(c["answered_per_s"] for c in calibration)
    runs = []
    for server in setup.servers:
        runs.append({"server": server.label, **soak_run(server, setup, sequence, mix, rate, cfg, overrides)})
        s = runs[-1]["summary"]
        print(f"  RSS start {s['rss_mb']['start']:.0f} MB, end {s['rss_mb']['end']:.0f}, peak {s['rss_mb']['peak']:.0f}"
              f", slope {s['rss_mb']['slope_per_min']:+.2f} MB/min; fds start {s['fds']['start']}, end "
              f"{s['fds']['end']}, peak {s['fds']['peak']}", flush=True)
    return {**setup.report("soak", command, cfg, overrides, [r["cpu"]["other_cores"] for r in runs]),
            "calibration": calibration, "rate": rate,
            "mix": [{"kind": i.request.kind, "weight": i.weight, "expect": i.expect} for i in mix], "runs": runs}


def soak_run(server: ServerUnderTest, setup: Setup, sequence: list[Request], mix: list[MixItem], rate: float,
             cfg: ReliabilityConfig, overrides: dict[str, str]) -> dict:
    port = free_port()
    print(f"soak of {server.label}: {cfg.soak_minutes:g} min at {rate:.1f} req/s", flush=True)
    with server.start(setup.model_path, port, cfg, overrides, f"soak-{server.slug}") as process:
        return asyncio.run(_soak(process.pid, port, sequence, mix, rate, setup.deadline_s(server), cfg))


async def _soak(pid: int, port: int, sequence: list[Request], mix: list[MixItem], rate: float, deadline_s: float,
                cfg: ReliabilityConfig) -> dict:
    await one_at_a_time(port, [mix[0].request.payload], 3, deadline_s)  # warm
    idle = await steady_resources(pid)
    load = OpenLoop(LOOPBACK, port, sequence, rate, cfg.soak_minutes * 60, deadline_s + cfg.timeout_margin_s)
    edges: dict[str, CpuSnapshot] = {}
    async with TreeSampler(pid, cfg.sample_s) as sampler:
        await load.send(on_window=lambda e: edges.__setitem__(e, CpuSnapshot.take(pid)))
        await load.drain()
    await asyncio.sleep(cfg.settle_s)  # the connections closed, the last requests' buffers freed
    after = await steady_resources(pid)
    t0 = sampler.samples[0].t
    kinds = by_kind(load.answers, [i.request.kind for i in mix], {i.request.kind: i.expect for i in mix})
    return {"offered": len(load.answers), "window_s": load.window_s, "kinds": kinds,
            "summary": soak_summary(sampler.samples, idle, after), "cpu": edges["start"].usage(edges["end"]),
            "samples": [{"t_s": round(s.t - t0, 2), "rss_mb": round(s.rss_mb, 2), "fds": s.fds, "threads": s.threads,
                         "processes": s.processes, "cpu_s": round(s.cpu_s, 2)} for s in sampler.samples]}


def by_kind(answers: list[Answer], kinds: list[str], expect: dict[str, tuple[str, ...]] | None = None) -> list[dict]:
    """Per kind of request: outcomes, latency of those answered (any status), and with `expect` (kind -> outcomes a
    correct server gives it) how many got another."""
    rows = []
    for kind in kinds:
        mine = [a for a in answers if a.kind == kind]
        outcomes = {o: v["count"] for o, v in outcome_summary(mine).items()}
        answered = [a.latency_s for a in mine if a.outcome.isdigit()]
        row = {"kind": kind, "count": len(mine), "outcomes": outcomes, **latency_summary(answered),
               "max_ms": max(answered) * 1000.0 if answered else float("nan")}
        if expect is not None:
            row["unexpected"] = sum(n for o, n in outcomes.items() if o not in expect[kind])
        rows.append(row)
    return rows


def soak_summary(samples: list[TreeSample], idle: dict, after: dict) -> dict:
    """RSS and descriptors: idle before, start and end of the load, peak, after, and the slope (per minute) over all
    samples and over the second half (past the warm-up: a leak shows there)."""
    half = samples[len(samples) // 2:]
    out = {}
    for key in ("rss_mb", "fds", "threads"):
        values = [getattr(s, key) for s in samples]
        out[key] = {"idle": idle[key], "start": values[0], "end": values[-1], "peak": max(values),
                    "after": after[key], "slope_per_min": slope_per_minute(samples, key),
                    "second_half_slope_per_min": slope_per_minute(half, key)}
    return out


# ---------------------------------------------------------------------------------------------------- Markdown


def render_head_of_line(report: dict) -> str:
    s, m = report["settings"], report["model"]
    heavy = " and ".join(f"{h['kind']} ({h['bytes'] / 2**20:.1f} MiB)" for h in report["heavy"])
    rates = " and ".join(format(r["small_rate"], ".1f") for r in report["runs"])
    lines = [*preamble(report, "small requests while heavy ones run"),
             f"Small requests: `POST /v1/classify`, a {m['height']}x{m['width']} PNG, open loop at "
             f"{rates}/s: {s['hol_phase_s']:g} s alone, then while the heavy pair runs ({heavy}, sent "
             f"together, {s['hol_repeats']} pair(s) one after the other), then {s['hol_phase_s']:g} s alone. "
             f"Memory: RSS summed over the server's processes from /proc; idle = median of 5 readings before the "
             f"load, peak = highest reading every 0.1 s during it, after = median of 5 readings {s['settle_s']:g} s "
             f"after it.", "",
             "## Small requests (ms, those answered 200)", "", *_small_table(report["runs"]), "",
             "## Heavy requests and memory", "", *_heavy_table(report["runs"]), ""]
    for r in report["runs"]:
        lines += [f"### Targets: {r['server']}, round {r['round']}", "", *target_lines(r["targets"]), ""]
    return "\n".join(lines)


def _counts(outcomes: dict[str, int]) -> str:
    return ", ".join(f"{o}: {n}" for o, n in outcomes.items()) or "-"


def _small_table(runs: list[dict]) -> list[str]:
    rows = [[r["server"], str(r["round"]), phase, str(p["count"]), _counts(p["outcomes"]), number(p["p50_ms"]),
             number(p["p99_ms"]), number(p["max_ms"])]
            for r in runs for phase, p in r["small"].items() if phase != "heavy_phase_s"]
    return table(["server", "round", "phase", "requests", "outcomes", "p50", "p99", "max"], rows, text_columns=3)


def _heavy_table(runs: list[dict]) -> list[str]:
    header = ["server", "round", "heavy outcomes", "heavy max ms", "heavy phase s", "RSS idle MB", "RSS peak MB",
              "RSS after MB", "fds idle", "fds peak", "fds after", "server cores", "other cores"]
    rows = []
    for r in runs:
        memory = r["memory"]
        rows.append([r["server"], str(r["round"]), "; ".join(f"{h['kind']}: {_counts(h['outcomes'])}"
                                                             for h in r["heavy"]),
                     ", ".join(number(h["max_ms"], ".0f") for h in r["heavy"]), number(r["small"]["heavy_phase_s"]),
                     *(number(v, ".0f") for v in (memory["idle"]["rss_mb"], memory["peak_rss_mb"],
                                                   memory["after"]["rss_mb"])),
                     *(str(v) for v in (memory["idle"]["fds"], memory["peak_fds"], memory["after"]["fds"])),
                     number(r["cpu"]["server_cores"], ".2f"), number(r["cpu"]["other_cores"], ".2f")])
    return table(header, rows, text_columns=3)


def render_soak(report: dict) -> str:
    s = report["settings"]
    lines = [*preamble(report, "mixed traffic, memory and file descriptors over time"),
             f"Open loop at **{report['rate']:.1f} req/s** (given, or {s['soak_load']:g}x the lowest saturation of "
             f"the same mix: the best closed-loop level of {', '.join(map(str, s['saturation_clients']))} clients) "
             f"for {s['soak_minutes']:g} min, cycling through a shuffled mix: "
             + ", ".join(f"{m['kind']} x{m['weight']}" for m in report["mix"]) + ". RSS (summed over the server's "
             f"processes), open descriptors (/proc/PID/fd) and threads every {s['sample_s']:g} s; idle = before the "
             f"load, after = {s['settle_s']:g} s after it; slopes by least squares, per minute.", "",
             "## Saturation of the mix (closed loop)", "",
             *table(["server", "answered/s", "200/s", "errors"],
                    [[c["server"], number(c["answered_per_s"]), number(c["requests_per_s"]),
                      str(sum(c["errors"].values()))] for c in report["calibration"]]), "",
             "## Memory and descriptors", "",
             *table(["server", "measure", "idle", "start", "end", "peak", "after", "slope /min", "2nd half slope /min"],
                    [[r["server"], key, *(number(v[q], ".1f") for q in ("idle", "start", "end", "peak", "after")),
                      number(v["slope_per_min"], "+.2f"), number(v["second_half_slope_per_min"], "+.2f")]
                     for r in report["runs"] for key, v in r["summary"].items()], text_columns=2), "",
             "## Requests by kind", ""]
    for r in report["runs"]:
        lines += [f"{r['server']}: {r['offered']} requests in {r['window_s']:.0f} s; server "
                  f"{r['cpu']['server_cores']:.2f} cores, other processes {r['cpu']['other_cores']:.2f} cores.", "",
                  *table(["kind", "requests", "outcomes", "unexpected", "p50 ms", "p99 ms"],
                         [[k["kind"], str(k["count"]), _counts(k["outcomes"]), str(k["unexpected"]),
                           number(k["p50_ms"]), number(k["p99_ms"])] for k in r["kinds"]]), ""]
    lines += ["*unexpected*: outcomes a correct server would not give that request (the expected ones are in the "
              "JSON: 200 or 429 for good requests, the right 4xx for bad ones); *p50/p99*: of the requests answered, "
              "whatever the status.", ""]
    return "\n".join(lines)
