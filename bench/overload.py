"""`vitserve bench --mode overload`: the server asked for twice what it can do, in an open loop.

Saturation is measured first, by the closed loop of bench/load.py (`saturation_clients` clients, each sending its
next request when the last is answered). Then a fresh server gets an open loop at `overload_factor` x that rate:
requests leave on a fixed schedule whatever the answers, so the queue the server must refuse builds up as it would
with real users. Every request scheduled in the measured window is followed to its outcome (200, 429, another
status, a client timeout at the server's deadline plus a margin, a connection error, or not sent when the
client's connection cap is reached), so offered = the sum of the outcomes. The moment the schedule ends, one
client sends a few requests one at a time: how soon the server answers them as fast as it did unloaded is its
recovery.

The open loop (`OpenLoop`) is also the soak's and the head-of-line test's load (bench/soak.py). It uses bench/
load.py's minimal HTTP client over a pool of keep-alive connections: about 0.15 ms of CPU per request, so on two
cores the generator takes little from the server it measures; how late it sent (its lag behind the schedule) is
reported with the CPU each party used.
"""
from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import HttpConnection, closed_loop, encode_request, make_images, settle
from vitserve.bench.measure import CpuSnapshot, latency_summary
from vitserve.bench.presets import resolve_model
from vitserve.bench.reliability import (
    ReliabilityConfig,
    ServerUnderTest,
    TreeSampler,
    alternated,
    contention,
    number,
    pin_load_generator,
    preamble,
    servers_under_test,
    table,
    verdict,
)
from vitserve.bench.servers import STAGE_METRICS, free_port, scrape_metrics, server_stages

TIMEOUT = "timeout"
CONNECTION_ERROR = "connection error"
NOT_SENT = "not sent (connection cap)"
HUNG_UP = "hung up (on purpose)"
_CLIENT_ERRORS = (OSError, ValueError, EOFError, asyncio.LimitOverrunError)  # EOFError: IncompleteReadError


@dataclass(frozen=True)
class Request:
    """One request of a load: its label in the report, its bytes, and whether the client hangs up after sending
    them (an abandoned upload: `payload` then holds less body than its Content-Length promises)."""

    kind: str
    payload: bytes
    hang_up: bool = False


class Answer(NamedTuple):
    kind: str
    outcome: str  # the status code as text, or TIMEOUT, CONNECTION_ERROR, NOT_SENT, HUNG_UP
    sent: float  # event-loop time the request left
    latency_s: float


class ConnectionPool:
    """Keep-alive connections, the most recently used first; at most `limit` open at once."""

    IDLE_LIMIT_S = 4.0  # uvicorn closes a connection idle for 5 s: one idle this long is not reused

    def __init__(self, host: str, port: int, limit: int):
        self.host, self.port, self.limit = host, port, limit
        self.idle: list[tuple[HttpConnection, float]] = []
        self.open = 0

    def take(self, now: float) -> HttpConnection | None:
        """An idle connection that is still open, or a new one (connected on first use); None at the cap."""
        while self.idle:
            conn, since = self.idle.pop()
            # an idle connection has answered a request, so it is connected
            assert conn.reader is not None and conn.writer is not None
            if now - since < self.IDLE_LIMIT_S and not conn.reader.at_eof():
                return conn
            conn.writer.close()  # stale: the server may have hung up already
            self.open -= 1
        if self.open >= self.limit:
            return None
        self.open += 1
        return HttpConnection(self.host, self.port)

    def give_back(self, conn: HttpConnection, now: float) -> None:
        if conn.writer is None:  # the server asked to close it
            self.open -= 1
        else:
            self.idle.append((conn, now))

    async def discard(self, conn: HttpConnection) -> None:
        await conn.close()
        self.open -= 1

    async def close(self) -> None:
        for conn, _ in self.idle:
            await conn.close()
        self.open -= len(self.idle)
        self.idle.clear()


class OpenLoop:
    """`rate` requests per second on a fixed schedule, whatever the answers, cycling through `requests`.

    Those scheduled in the first `warmup_s` only fill the server; the next `duration_s` worth are measured, each
    followed to its outcome in `answers`. `send` returns when the schedule ends (or `stop` is set); `drain` then
    waits for the outstanding answers (a request gets `timeout_s`).
    """

    def __init__(self, host: str, port: int, requests: list[Request], rate: float, duration_s: float,
                 timeout_s: float, warmup_s: float = 0.0, max_connections: int = 4000):
        self.host, self.port, self.requests, self.rate = host, port, requests, rate
        self.duration_s, self.warmup_s, self.timeout_s = duration_s, warmup_s, timeout_s
        self.pool = ConnectionPool(host, port, max_connections)
        self.answers: list[Answer] = []
        self.warmup_answers: list[Answer] = []
        self.lags: list[float] = []  # how late each request left, against its schedule
        self.measured_sent = 0
        self._tasks: set[asyncio.Task] = set()

    @property
    def window_s(self) -> float:
        """The measured window's length: the span of the schedule its requests occupied."""
        return self.measured_sent / self.rate

    async def send(self, stop: asyncio.Event | None = None, on_window: Callable[[str], None] | None = None) -> None:
        """Send on schedule; `on_window("start")` as the first measured request is due, `on_window("end")` after
        the last one left."""
        loop = asyncio.get_running_loop()
        warm = round(self.rate * self.warmup_s)
        start = loop.time()
        for i in range(warm + round(self.rate * self.duration_s)):
            due = start + i / self.rate
            if due > loop.time():
                await asyncio.sleep(due - loop.time())
            if i == warm and on_window:
                on_window("start")
            if stop is not None and stop.is_set():
                break
            self.lags.append(loop.time() - due)
            self.measured_sent += i >= warm
            task = loop.create_task(self._one(self.requests[i % len(self.requests)], i >= warm))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if on_window:
            on_window("end")

    async def drain(self) -> None:
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.pool.close()

    async def _one(self, request: Request, measured: bool) -> None:
        loop = asyncio.get_running_loop()
        answers = self.answers if measured else self.warmup_answers
        if request.hang_up:
            answers.append(await _hang_up(self.host, self.port, request))
            return
        conn = self.pool.take(loop.time())
        if conn is None:
            answers.append(Answer(request.kind, NOT_SENT, loop.time(), 0.0))
            return
        outcome, sent = await exchange(conn, request.payload, self.timeout_s)
        answers.append(Answer(request.kind, outcome, sent, loop.time() - sent))
        if outcome in (TIMEOUT, CONNECTION_ERROR):
            await self.pool.discard(conn)
        else:
            self.pool.give_back(conn, loop.time())


async def exchange(conn: HttpConnection, payload: bytes, timeout_s: float) -> tuple[str, float]:
    """(outcome, loop time sent) of one request on `conn`; a failure is an outcome, never raised.

    A kept-alive connection the server closed while it sat idle (uvicorn closes one after an unhandled error
    without saying so) fails before any answer: the request then goes once more on a new connection, within the
    same time limit, as HTTP clients do; a failure on a new connection, or after part of an answer, counts.
    """
    sent = asyncio.get_running_loop().time()
    reused = conn.writer is not None
    try:
        async with asyncio.timeout(timeout_s):
            try:
                status, _ = await conn.request(payload)
            except (ConnectionError, asyncio.IncompleteReadError) as e:
                partial = e.partial if isinstance(e, asyncio.IncompleteReadError) else b""
                if not reused or partial:
                    raise
                await conn.close()
                status, _ = await conn.request(payload)
        return str(status), sent
    except TimeoutError:  # before the client errors: asyncio's TimeoutError is an OSError
        return TIMEOUT, sent
    except _CLIENT_ERRORS:
        return CONNECTION_ERROR, sent


async def _hang_up(host: str, port: int, request: Request) -> Answer:
    """Send part of a request on a connection of its own, then close it: an upload abandoned half-way."""
    loop = asyncio.get_running_loop()
    sent = loop.time()
    try:
        _, writer = await asyncio.open_connection(host, port)
        writer.write(request.payload)
        await writer.drain()
        writer.close()
        await writer.wait_closed()
        outcome = HUNG_UP
    except _CLIENT_ERRORS:
        outcome = CONNECTION_ERROR
    return Answer(request.kind, outcome, sent, loop.time() - sent)


async def one_at_a_time(port: int, payloads: list[bytes], count: int, timeout_s: float,
                        kind: str = "probe") -> list[Answer]:
    """`count` requests from one client, each sent when the last is answered, on one keep-alive connection."""
    conn, answers = HttpConnection(LOOPBACK, port), []
    loop = asyncio.get_running_loop()
    try:
        for i in range(count):
            outcome, sent = await exchange(conn, payloads[i % len(payloads)], timeout_s)
            answers.append(Answer(kind, outcome, sent, loop.time() - sent))
            if outcome in (TIMEOUT, CONNECTION_ERROR):
                await conn.close()
    finally:
        await conn.close()
    return answers


# ---------------------------------------------------------------------------------------------------- summaries


def outcome_summary(answers: list[Answer]) -> dict[str, dict]:
    """Per outcome: how many, and their latency percentiles and maximum (ms)."""
    groups: dict[str, list[float]] = {}
    for a in answers:
        groups.setdefault(a.outcome, []).append(a.latency_s)
    return {outcome: {"count": len(lat), **latency_summary(lat), "max_ms": max(lat) * 1000.0}
            for outcome, lat in sorted(groups.items())}


def load_summary(answers: list[Answer], window_s: float) -> dict:
    """Offered requests and their outcomes; the share answered 200 or 429; goodput (200s per second)."""
    outcomes = outcome_summary(answers)
    count = {o: v["count"] for o, v in outcomes.items()}
    offered = len(answers)
    answered = count.get("200", 0) + count.get("429", 0)
    return {"offered": offered, "window_s": window_s, "offered_per_s": offered / window_s if window_s else 0.0,
            "outcomes": outcomes, "answered_share": answered / offered if offered else float("nan"),
            "goodput_per_s": count.get("200", 0) / window_s if window_s else 0.0}


def model_summary(model_path: Path) -> dict:
    from vitserve.onnx_header import read_model_info

    info = read_model_info(model_path)
    return {"name": info.name, "version": info.version, "path": str(model_path), "height": info.image_size[0],
            "width": info.image_size[1], "channels": info.channels, "patch_size": info.patch_size}


# ---------------------------------------------------------------------------------------------------- the mode


@dataclass
class Setup:
    """What every reliability mode starts from: the machine, the model, the servers under test and what they run."""

    env: dict
    model_path: Path
    model: dict
    servers: list[ServerUnderTest]
    described: list[dict]

    @classmethod
    def prepare(cls, cfg: ReliabilityConfig, overrides: dict[str, str]) -> Setup:
        from vitserve.bench.run import environment

        env = environment()  # before anything runs: the load average at the start
        pin_load_generator(cfg)
        model_path = resolve_model(cfg.model, cfg.cache_dir)
        servers = servers_under_test(cfg)
        return cls(env, model_path, model_summary(model_path), servers,
                   [s.describe(overrides, cfg.server_args) for s in servers])

    def deadline_s(self, server: ServerUnderTest) -> float:
        """The server's request deadline (request_timeout_ms), as its own code reads it."""
        return self.described[self.servers.index(server)]["settings"].get("request_timeout_ms", 10_000) / 1000

    def pngs(self, cfg: ReliabilityConfig) -> list[bytes]:
        """`num_images` PNGs at the model's size and channels."""
        m = self.model
        return make_images("png", (m["height"], m["width"]), m["channels"], cfg.num_images, cfg.seed)

    def report(self, mode: str, command: str, cfg: ReliabilityConfig, overrides: dict[str, str],
               other_cores: list[float]) -> dict:
        """The head every mode's report shares; the mode adds its own rows."""
        return {"mode": mode, "command": command, "model": self.model,
                "environment": contention(self.env, other_cores),
                "settings": {**asdict(cfg), "server_overrides": overrides}, "servers": self.described}


def run_overload(cfg: ReliabilityConfig, overrides: dict[str, str], command: str) -> dict:
    """Saturation of every server under test, then the open loop at one rate for all, rounds alternated."""
    setup = Setup.prepare(cfg, overrides)
    payloads = [encode_request("POST", "/v1/classify", data, "image/png") for data in setup.pngs(cfg)]
    calibration = [] if cfg.rate else [
        {"server": s.label, **saturation(s, setup.model_path, payloads, cfg, overrides)} for s in setup.servers]
    rate = cfg.rate or cfg.overload_factor * max(c["requests_per_s"] for c in calibration)
    runs = []
    for round_, server in alternated(setup.servers, cfg.rounds):
        runs.append({"server": server.label, "round": round_ + 1,
                     **overload_run(server, round_, setup.model_path, payloads, rate, setup.deadline_s(server), cfg,
                                    overrides)})
        print(_run_line(runs[-1]), flush=True)
    return {**setup.report("overload", command, cfg, overrides, [r["cpu"]["other_cores"] for r in runs]),
            "calibration": calibration, "rate": rate, "runs": runs}


def saturation(server: ServerUnderTest, model_path: Path, payloads: list[bytes], cfg: ReliabilityConfig,
               overrides: dict[str, str]) -> dict:
    """What a fresh server can do: the best closed-loop level of `saturation_clients` clients (each sends its next
    request when the last is answered), with the other levels beside it."""
    port = free_port()
    print(f"saturation of {server.label}: closed loop, {cfg.saturation_clients} clients", flush=True)
    levels = []
    with server.start(model_path, port, cfg, overrides, f"{cfg.mode}-saturation-{server.slug}"):
        for clients in cfg.saturation_clients:
            before, started = scrape_metrics(port, STAGE_METRICS), time.monotonic()
            r = asyncio.run(closed_loop(LOOPBACK, port, payloads, clients, warmup_s=1.0, duration_s=cfg.saturation_s,
                                        timeout_s=120.0))
            stages = server_stages(before, scrape_metrics(port, STAGE_METRICS), time.monotonic() - started)
            settle(port, payloads[0], 120.0)
            answered = r["completed"] + sum(r["errors"].values())  # 200s and the rest (a mix with bad inputs)
            levels.append({**{k: r[k] for k in ("concurrency", "completed", "errors", "window_s", "requests_per_s",
                                                "p50_ms", "p99_ms")}, "answered_per_s": answered / r["window_s"],
                           "stages": stages})
            print(f"  {clients} clients: {r['requests_per_s']:.1f} req/s answered 200 "
                  f"({levels[-1]['answered_per_s']:.1f} answered), p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms",
                  flush=True)
    best = max(levels, key=lambda level: level["answered_per_s"])
    return {**best, "levels": levels}


def overload_run(server: ServerUnderTest, round_: int, model_path: Path, payloads: list[bytes], rate: float,
                 deadline_s: float, cfg: ReliabilityConfig, overrides: dict[str, str]) -> dict:
    """A fresh server: unloaded latency, then the open loop at `rate`, then recovery probes; targets checked."""
    port = free_port()
    print(f"overload of {server.label}, round {round_ + 1}: open loop at {rate:.1f} req/s", flush=True)
    with server.start(model_path, port, cfg, overrides, f"overload-{server.slug}-round{round_ + 1}") as process:
        row = asyncio.run(_overload(process.pid, port, payloads, rate, deadline_s, cfg))
    row["targets"] = overload_targets(row, deadline_s)
    return row


async def _overload(pid: int, port: int, payloads: list[bytes], rate: float, deadline_s: float,
                    cfg: ReliabilityConfig) -> dict:
    timeout_s = deadline_s + cfg.timeout_margin_s
    await one_at_a_time(port, payloads, 5, timeout_s)  # warm: first requests pay for lazy imports
    unloaded = await one_at_a_time(port, payloads, cfg.unloaded_requests, timeout_s)
    load = OpenLoop(LOOPBACK, port, [Request("png", p) for p in payloads], rate, cfg.overload_s, timeout_s,
                    warmup_s=cfg.overload_warmup_s, max_connections=cfg.max_connections)
    edges: dict[str, CpuSnapshot] = {}
    counters: dict[str, asyncio.Future] = {}  # the server's own counters at the window's edges (off the send loop)

    def at_edge(edge: str) -> None:
        edges[edge] = CpuSnapshot.take(pid)
        counters[edge] = asyncio.ensure_future(asyncio.to_thread(scrape_metrics, port, STAGE_METRICS))

    async with TreeSampler(pid, 0.5) as memory:
        await load.send(on_window=at_edge)
        stopped = asyncio.get_running_loop().time()
        probes = asyncio.create_task(one_at_a_time(port, payloads, cfg.probes, timeout_s))
        await load.drain()
        probe_answers = await probes
    stages = server_stages(await counters["start"], await counters["end"], load.window_s)
    unloaded_ms = latency_summary([a.latency_s for a in unloaded if a.outcome == "200"])
    lag_ms = latency_summary(load.lags)
    return {"rate": rate, "server_cpus": sorted(os.sched_getaffinity(pid)),
            "client_cpus": sorted(os.sched_getaffinity(0)),
            **load_summary(load.answers, load.window_s), "unloaded": unloaded_ms,
            "recovery": recovery(probe_answers, stopped, unloaded_ms["p99_ms"]),
            "generator": {"lag_p50_ms": lag_ms["p50_ms"], "lag_p99_ms": lag_ms["p99_ms"],
                          "lag_max_ms": max(load.lags) * 1000.0, "warmup_requests": len(load.warmup_answers)},
            "cpu": edges["start"].usage(edges["end"]), "peak_rss_mb": memory.peak_rss_mb, "stages": stages}


def recovery(probes: list[Answer], stopped: float, unloaded_p99_ms: float) -> dict:
    """The probes sent one at a time from the moment the load stopped, and when the first came back as fast as
    unloaded (200 within 3x the unloaded p99), counted from the stop."""
    limit_s = 3 * unloaded_p99_ms / 1000
    fast = [a for a in probes if a.outcome == "200" and a.latency_s <= limit_s]
    return {"probes_ms": [round(a.latency_s * 1000, 2) for a in probes], "statuses": [a.outcome for a in probes],
            "first_ms": probes[0].latency_s * 1000 if probes else float("nan"),
            "recovered_after_ms": (fast[0].sent + fast[0].latency_s - stopped) * 1000 if fast else None}


def overload_targets(row: dict, deadline_s: float) -> list[dict]:
    """The overload targets at twice saturation (docs/reliability.md), each with this run's value and whether it was
    met."""
    def p99(outcome: str) -> float | None:
        return row["outcomes"].get(outcome, {}).get("p99_ms")

    three_x = 3 * row["unloaded"]["p99_ms"]
    admitted, refused, first = p99("200"), p99("429"), row["recovery"]["first_ms"]
    return [
        {"name": "429 answered within (p99)", "value_ms": refused, "target": "<= 10 ms",
         "met": None if refused is None else refused <= 10.0},
        {"name": "share of offered answered 200 or 429", "value": row["answered_share"], "target": ">= 99%",
         "met": row["answered_share"] >= 0.99},
        {"name": "admitted (200) p99 within the deadline", "value_ms": admitted,
         "target": f"<= {deadline_s * 1000:.0f} ms", "met": None if admitted is None else admitted <= deadline_s * 1e3},
        {"name": "admitted (200) p99 within 3x unloaded p99", "value_ms": admitted, "target": f"<= {three_x:.1f} ms",
         "met": None if admitted is None or three_x > deadline_s * 1e3 else admitted <= three_x},
        {"name": "first request after the load stops (recovery)", "value_ms": first,
         "target": f"<= {three_x:.1f} ms (3x unloaded p99)", "met": first <= three_x},
    ]


# ---------------------------------------------------------------------------------------------------- Markdown


def outcome_cells(outcomes: dict[str, dict], named: tuple[str, ...]) -> list[str]:
    """Counts of the `named` outcomes, then of all the others together (as 'status: n' pairs)."""
    others = ", ".join(f"{o}: {v['count']}" for o, v in outcomes.items() if o not in named) or "0"
    return [str(outcomes.get(o, {}).get("count", 0)) for o in named] + [others]


def target_lines(targets: list[dict]) -> list[str]:
    lines = []
    for t in targets:
        if "value" in t:
            value = f"{t['value']:.2%}"
        else:
            value = f"{number(t['value_ms'], '.1f')} ms" if "value_ms" in t else f"{number(t['value_mb'], '.0f')} MB"
        lines.append(f"- {t['name']}: {value} (target {t['target']}): {verdict(t['met'])}")
    return lines


def render_overload(report: dict) -> str:
    lines = [*preamble(report, "open loop at twice saturation"), _method(report), "",
             "## Saturation (closed loop)", "", *_saturation_table(report["calibration"]), "",
             "## Open loop: outcomes", "", *_outcome_table(report["runs"]), "",
             "## Open loop: latency (ms)", "", *_latency_table(report["runs"]), "",
             "## The engine's batches (the server's /metrics)", "", *_stages_table(report), "",
             "*images per batch* and *runner busy* (its calls' time over the wall time) as the server counted them: "
             "under overload, the admitted work against what saturation kept the engine doing. *ms per image*: a "
             "call's time over its images.", ""]
    for r in report["runs"]:
        lines += [f"### Targets: {r['server']}, round {r['round']}", "", *target_lines(r["targets"]),
                  f"- recovery probes (ms, in order): {', '.join(map(str, r['recovery']['probes_ms']))}", ""]
    lines += ["*answered*: share of offered requests answered 200 or 429; *goodput*: 200s per second of the window; "
              "*cores*: CPU seconds per second of the server's processes, this load generator, and everything else "
              "on the machine; *send lag*: how late the generator sent, against its schedule (p99); *recovered "
              "after*: from the end of the schedule until a probe came back within 3x the unloaded p99.", ""]
    return "\n".join(lines)


def _method(report: dict) -> str:
    s, m = report["settings"], report["model"]
    return (f"Saturation: the best closed-loop level of {', '.join(map(str, s['saturation_clients']))} clients, "
            f"{s['saturation_s']:g} s each after 1 s of warm-up, on a fresh server. Overload: a fresh server gets "
            f"{s['unloaded_requests']} requests one at a time (unloaded latency), then an open loop at "
            f"**{report['rate']:.1f} req/s** (given, or {s['overload_factor']:g}x the highest saturation): "
            f"{s['overload_warmup_s']:g} s to fill the queue, then {s['overload_s']:g} s measured; every request "
            f"scheduled in the window is followed to its outcome (client timeout: the deadline + "
            f"{s['timeout_margin_s']:g} s). From the moment the schedule ends, {s['probes']} requests one at a time "
            f"(recovery). Requests: `POST /v1/classify`, a {m['height']}x{m['width']} PNG as the body, default "
            f"parameters; keep-alive connections, at most {s['max_connections']} open.")


def _saturation_table(calibration: list[dict]) -> list[str]:
    rows = [[c["server"], f"{level['concurrency']}{' (best)' if level['concurrency'] == c['concurrency'] else ''}",
             number(level["requests_per_s"]), number(level["p50_ms"], ".2f"), number(level["p99_ms"], ".2f"),
             str(sum(level["errors"].values()))] for c in calibration for level in c["levels"]]
    return table(["server", "clients", "req/s", "p50 ms", "p99 ms", "errors"], rows, text_columns=2)


def _stages_table(report: dict) -> list[str]:
    phases = [(c["server"], f"saturation, {level['concurrency']} clients", level.get("stages", {}))
              for c in report["calibration"] for level in c["levels"]]
    phases += [(r["server"], f"open loop, round {r['round']}", r.get("stages", {})) for r in report["runs"]]

    def per_image(stages: dict) -> str:
        return number(stages["call_ms"] / stages["mean_batch"], ".3f") if stages.get("mean_batch") else "-"

    rows = [[server, phase, number(stages.get("mean_batch"), ".1f"), number(stages.get("runner_busy"), ".2f"),
             number(stages.get("call_ms"), ".2f"), per_image(stages), number(stages.get("queue_wait_ms"), ".1f"),
             number(stages.get("preprocess_ms"), ".2f")] for server, phase, stages in phases]
    return table(["server", "phase", "images per batch", "runner busy", "ms per call", "ms per image",
                  "queue wait ms", "preprocess ms"], rows, text_columns=2)


def _outcome_table(runs: list[dict]) -> list[str]:
    header = ["server", "round", "offered", "req/s", "200", "429", "timeout", "connection error", "other", "answered",
              "goodput req/s", "server cores", "client cores", "other cores", "peak RSS MB", "send lag ms"]
    rows = [[r["server"], str(r["round"]), str(r["offered"]), number(r["offered_per_s"]),
             *outcome_cells(r["outcomes"], ("200", "429", TIMEOUT, CONNECTION_ERROR)), f"{r['answered_share']:.2%}",
             number(r["goodput_per_s"]), *(number(r["cpu"][k], ".2f") for k in ("server_cores", "client_cores",
                                                                                  "other_cores")),
             number(r["peak_rss_mb"], ".0f"), number(r["generator"]["lag_p99_ms"], ".1f")] for r in runs]
    return table(header, rows)


def _latency_table(runs: list[dict]) -> list[str]:
    header = ["server", "round", "unloaded p50", "unloaded p99", "200 p50", "200 p99", "200 max", "429 p50",
              "429 p99", "429 max", "first probe", "recovered after"]
    rows = [[r["server"], str(r["round"]), number(r["unloaded"]["p50_ms"], ".2f"),
             number(r["unloaded"]["p99_ms"], ".2f"),
             *(number(r["outcomes"].get(o, {}).get(q), ".1f") for o in ("200", "429") for q in ("p50_ms", "p99_ms",
                                                                                               "max_ms")),
             number(r["recovery"]["first_ms"], ".1f"), number(r["recovery"]["recovered_after_ms"], ".0f")]
            for r in runs]
    return table(header, rows)


def _run_line(r: dict) -> str:
    o = r["outcomes"]
    return (f"  offered {r['offered']} ({r['offered_per_s']:.1f}/s): 200 {o.get('200', {}).get('count', 0)}, 429 "
            f"{o.get('429', {}).get('count', 0)}, answered {r['answered_share']:.2%}; 200 p99 "
            f"{number(o.get('200', {}).get('p99_ms'))} ms, 429 p99 {number(o.get('429', {}).get('p99_ms'))} ms; "
            f"first probe {r['recovery']['first_ms']:.1f} ms")
