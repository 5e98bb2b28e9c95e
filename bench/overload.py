"""`vitserve bench --mode overload`: the server asked for more than it can do (twice, by default), in an open loop.

Saturation is measured first, by the closed loop of bench/load.py (`saturation_clients` clients, each sending its
next request when the last is answered). Then a fresh server gets an open loop at each of `overload_factors` x that
rate: requests leave on a fixed schedule whatever the answers, so the queue the server must refuse (or, degrading,
answer at a cheaper token budget) builds up as it would with real users. Every request scheduled in the measured
window is followed to its outcome (200, 429, another status, a client timeout at the server's deadline plus a
margin, a connection error, or not sent when the client's connection cap is reached), so offered = the sum of the
outcomes. The moment the schedule ends, one client sends a few requests one at a time: how soon the server answers
them as fast as it did unloaded is its recovery.

Arms (`--arms refuse,degrade`) compare refusing with degrading: the same code, `degrade_under_load` false or true.
Saturation is then measured once, on the refusing arm (every answer at the full budget), and the arms alternate
round by round at each factor of it. The server's token-budget counters, read at the measured window's edges, say
which budget its answers ran at and the estimated accuracy of what it served.

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
    DEGRADING_ARM,
    FULL_BUDGET_ARM,
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
from vitserve.bench.servers import STAGE_METRICS, free_port, metric_samples, scrape_metrics, server_stages

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


# The server's token-budget counters (service/ground/metrics.py)
BUDGET_ANSWERS = "vitserve_budget_answers_total"  # labels tokens, reason ("" at the full budget, asked, load)
ACCURACY_SUM = "vitserve_budget_estimated_accuracy_total"
MEASURED_ANSWERS = "vitserve_budget_measured_answers_total"


def edge_counters(port: int) -> tuple[dict[str, float], dict[str, float]]:
    """The server's batch counters and its token-budget counters, read together at a window's edge."""
    return scrape_metrics(port, STAGE_METRICS), scrape_budgets(port)


def scrape_budgets(port: int) -> dict[str, float]:
    """The token-budget counters summed over model versions: answers keyed "TOKENS/REASON", then the accuracy sum
    and the answers it covers; empty for a server that has none (or did not answer)."""
    values: dict[str, float] = {}
    for sample in metric_samples(port):
        if sample.name == BUDGET_ANSWERS:
            key = f"{sample.labels['tokens']}/{sample.labels['reason']}"
        elif sample.name in (ACCURACY_SUM, MEASURED_ANSWERS):
            key = sample.name
        else:
            continue
        values[key] = values.get(key, 0.0) + sample.value
    return values


def budget_summary(before: dict[str, float], after: dict[str, float]) -> dict:
    """The answers the server gave between two readings, by token budget and why: each (tokens, reason)'s share,
    the share degraded under load, and the estimated accuracy of what was served (the accuracy sum over the answers
    it covers). None where there is nothing to divide by: no answer, or none whose budget has a measured accuracy."""
    delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
    by_rung = {key: count for key, count in delta.items() if "/" in key and count > 0}
    answers = sum(by_rung.values())
    rungs = []
    for key, count in sorted(by_rung.items(), key=lambda item: _rung_order(item[0])):
        tokens, reason = key.split("/")
        rungs.append({"tokens": int(tokens), "reason": reason, "answers": int(count), "share": count / answers})
    measured = delta.get(MEASURED_ANSWERS, 0.0)
    degraded = sum(count for key, count in by_rung.items() if key.endswith("/load"))
    return {"answers": int(answers), "rungs": rungs, "degraded_share": degraded / answers if answers else None,
            "estimated_accuracy": delta.get(ACCURACY_SUM, 0.0) / measured if measured > 0 else None,
            "measured_answers": int(measured)}


def _rung_order(key: str) -> tuple[int, str]:
    """The most tokens first; at the same tokens the full budget, then asked, then load."""
    tokens, reason = key.split("/")
    return -int(tokens), reason


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
        servers = servers_under_test(cfg, overrides)  # a set that cannot be compared fails before a model is made
        model_path = resolve_model(cfg.model, cfg.cache_dir)
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
    """Saturation at the full budget, then at each load (a factor of it, or the rate given) the open loop on every
    server under test, rounds alternated; the degrading arm's targets when arms ran."""
    setup = Setup.prepare(cfg, overrides)
    payloads = [encode_request("POST", "/v1/classify", data, "image/png") for data in setup.pngs(cfg)]
    measured = [] if cfg.rate else saturation_servers(setup, cfg)
    calibration = [{"server": s.label, **saturation(s, setup.model_path, payloads, cfg, overrides)} for s in measured]
    saturation_per_s = max((c["requests_per_s"] for c in calibration), default=None)
    loads = overload_loads(cfg, saturation_per_s)
    runs = []
    for load in loads:
        for round_, server in alternated(setup.servers, cfg.rounds):
            row = overload_run(server, round_, setup, payloads, load, cfg, overrides)
            runs.append({"server": server.label, "round": round_ + 1, "factor": load["factor"], **row,
                         "over_saturation": row["goodput_per_s"] / saturation_per_s if saturation_per_s else None})
            print(_run_line(runs[-1]), flush=True)
    report = {**setup.report("overload", command, cfg, overrides, [r["cpu"]["other_cores"] for r in runs]),
              "calibration": calibration, "saturation_per_s": saturation_per_s,
              "saturation_of": _saturation_of(cfg, measured), "loads": loads, "runs": runs}
    return {**report, "arm_targets": arm_targets(report)}


def overload_loads(cfg: ReliabilityConfig, saturation_per_s: float | None) -> list[dict]:
    """The open loop's rates: each factor x the full-budget saturation, or (none measured) the rate given."""
    if saturation_per_s is None:
        return [{"factor": None, "rate": cfg.rate}]
    return [{"factor": factor, "rate": factor * saturation_per_s} for factor in cfg.overload_factors]


def saturation_servers(setup: Setup, cfg: ReliabilityConfig) -> list[ServerUnderTest]:
    """Whose closed loop is measured: with arms, the refusing one alone (it answers at the full budget whatever
    the load, and the factors are of that); else every server under test, the best counting."""
    return [ServerUnderTest(arm=FULL_BUDGET_ARM)] if cfg.arms else setup.servers


def _saturation_of(cfg: ReliabilityConfig, measured: list[ServerUnderTest]) -> str:
    if cfg.rate:
        return "not measured (the rate was given)"
    if cfg.arms:
        return f"the {FULL_BUDGET_ARM} arm's closed loop (degrade_under_load=false: every answer at the full budget)"
    return "the best closed loop of the servers under test" if len(measured) > 1 else "the server's closed loop"


def saturation(server: ServerUnderTest, model_path: Path, payloads: list[bytes], cfg: ReliabilityConfig,
               overrides: dict[str, str]) -> dict:
    """What a fresh server can do: the best closed-loop level of `saturation_clients` clients (each sends its next
    request when the last is answered), with the other levels beside it."""
    port = free_port()
    print(f"saturation of {server.label}: closed loop, {cfg.saturation_clients} clients", flush=True)
    levels = []
    with server.start(model_path, port, cfg, overrides, f"{cfg.mode}-saturation-{server.slug}"):
        for clients in cfg.saturation_clients:
            (before, budgets), started = edge_counters(port), time.monotonic()
            r = asyncio.run(closed_loop(LOOPBACK, port, payloads, clients, warmup_s=1.0, duration_s=cfg.saturation_s,
                                        timeout_s=120.0))
            after, budgets_after = edge_counters(port)
            stages = server_stages(before, after, time.monotonic() - started)
            settle(port, payloads[0], 120.0)
            answered = r["completed"] + sum(r["errors"].values())  # 200s and the rest (a mix with bad inputs)
            levels.append({**{k: r[k] for k in ("concurrency", "completed", "errors", "window_s", "requests_per_s",
                                                "p50_ms", "p99_ms")}, "answered_per_s": answered / r["window_s"],
                           "stages": stages, "budgets": budget_summary(budgets, budgets_after)})
            print(f"  {clients} clients: {r['requests_per_s']:.1f} req/s answered 200 "
                  f"({levels[-1]['answered_per_s']:.1f} answered), p50 {r['p50_ms']:.1f} ms, p99 {r['p99_ms']:.1f} ms",
                  flush=True)
    best = max(levels, key=lambda level: level["answered_per_s"])
    return {**best, "levels": levels}


def overload_run(server: ServerUnderTest, round_: int, setup: Setup, payloads: list[bytes], load: dict,
                 cfg: ReliabilityConfig, overrides: dict[str, str]) -> dict:
    """A fresh server: unloaded latency, then the open loop at `load["rate"]`, then recovery probes; targets
    checked."""
    port, rate, deadline_s = free_port(), load["rate"], setup.deadline_s(server)
    tag = f"{load['factor']:g}x-round{round_ + 1}" if load["factor"] else f"round{round_ + 1}"
    print(f"overload of {server.label}, {load_name(load['factor'])}, round {round_ + 1}: open loop at {rate:.1f} "
          f"req/s", flush=True)
    with server.start(setup.model_path, port, cfg, overrides, f"overload-{server.slug}-{tag}") as process:
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
        counters[edge] = asyncio.ensure_future(asyncio.to_thread(edge_counters, port))

    async with TreeSampler(pid, 0.5) as memory:
        await load.send(on_window=at_edge)
        stopped = asyncio.get_running_loop().time()
        probes = asyncio.create_task(one_at_a_time(port, payloads, cfg.probes, timeout_s))
        await load.drain()
        probe_answers = await probes
    (stages_before, budgets_before), (stages_after, budgets_after) = await counters["start"], await counters["end"]
    unloaded_ms = latency_summary([a.latency_s for a in unloaded if a.outcome == "200"])
    lag_ms = latency_summary(load.lags)
    summary = load_summary(load.answers, load.window_s)
    return {"rate": rate, "server_cpus": sorted(os.sched_getaffinity(pid)),
            "client_cpus": sorted(os.sched_getaffinity(0)), **summary, "unloaded": unloaded_ms,
            "recovery": recovery(probe_answers, stopped, unloaded_ms["p99_ms"]),
            "generator": {"lag_p50_ms": lag_ms["p50_ms"], "lag_p99_ms": lag_ms["p99_ms"],
                          "lag_max_ms": max(load.lags) * 1000.0, "warmup_requests": len(load.warmup_answers)},
            "cpu": edges["start"].usage(edges["end"]),
            "server_cpu_ms_per_200": cpu_ms_per_200(edges["start"], edges["end"], summary),
            "peak_rss_mb": memory.peak_rss_mb, "stages": server_stages(stages_before, stages_after, load.window_s),
            "budgets": budget_summary(budgets_before, budgets_after)}


def cpu_ms_per_200(start: CpuSnapshot, end: CpuSnapshot, summary: dict) -> float | None:
    """The server's CPU time over the window, per request of the window answered 200 (None: none was)."""
    answered = summary["outcomes"].get("200", {}).get("count", 0)
    return 1000 * (end.server - start.server) / answered if answered else None


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


ARM_TARGET_FACTORS = (2.0, 4.0)  # the loads the degrading arm has targets at (x the full-budget saturation)


def arm_targets(report: dict) -> list[dict]:
    """The degrading arm's targets at 2x and 4x saturation, round by round, each against the refusing arm's same
    round; empty without that arm."""
    if DEGRADING_ARM not in report["settings"]["arms"]:
        return []
    runs = report["runs"]
    checked = []
    for run in runs:
        if run["server"] != DEGRADING_ARM or run["factor"] not in ARM_TARGET_FACTORS:
            continue
        refusing = next((r for r in runs if r["server"] == FULL_BUDGET_ARM
                         and (r["factor"], r["round"]) == (run["factor"], run["round"])), None)
        checked.append({"factor": run["factor"], "round": run["round"], "targets": degrading_targets(run, refusing)})
    return checked


def degrading_targets(run: dict, refusing: dict | None) -> list[dict]:
    """At 2x: nearly every request answered 200, far more 200s than saturation, their p99 near unloaded; at 4x:
    more still, fast refusals for the rest, no 5xx. At both: more 200s than refusing gives, at an accuracy kept."""
    outcomes = run["outcomes"]
    if run["factor"] == 2.0:
        unloaded = run["unloaded"]["p99_ms"]
        slower = outcomes["200"]["p99_ms"] / unloaded if "200" in outcomes and unloaded > 0 else None
        checks = [_check("share of offered answered 200", answered_200_share(run), "%", ">= 99%", 0.99),
                  _check("200s/s over the full-budget saturation", run["over_saturation"], "x", ">= 1.8x", 1.8),
                  _check("p99 of the 200s over the unloaded p99", slower, "x", "<= 3x", 3.0, at_most=True)]
    else:
        server_errors = sum(v["count"] for o, v in outcomes.items() if o.startswith("5"))
        checks = [_check("200s/s over the full-budget saturation", run["over_saturation"], "x", ">= 2.5x", 2.5),
                  _check("p99 of the 429s", outcomes.get("429", {}).get("p99_ms"), "ms", "<= 10 ms", 10.0,
                         at_most=True),
                  _check("5xx answers", server_errors, "", "none", 0, at_most=True)]
    versus = run["goodput_per_s"] / refusing["goodput_per_s"] if refusing and refusing["goodput_per_s"] else None
    return checks + [
        _check("200s/s over the refusing arm's (same round)", versus, "x", ">= 1.3x", 1.3),
        _check("estimated accuracy of the 200s", run["budgets"]["estimated_accuracy"], "%", ">= 92%", 0.92)]


def _check(name: str, value: float | None, unit: str, target: str, limit: float, at_most: bool = False) -> dict:
    """One target: `value` against `limit` (at least it, or with `at_most` at most it); met None without a value."""
    met = None if value is None else bool(value <= limit if at_most else value >= limit)
    return {"name": name, "value": value, "unit": unit, "target": target, "met": met}


def answered_200_share(run: dict) -> float:
    return run["outcomes"].get("200", {}).get("count", 0) / run["offered"] if run["offered"] else float("nan")


def load_name(factor: float | None) -> str:
    return f"{factor:g}x saturation" if factor else "the given rate"


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


def arm_target_lines(report: dict) -> list[str]:
    """The degrading arm's targets, one line each (for the console)."""
    return [f"{DEGRADING_ARM} at {t['factor']:g}x, round {t['round']}: {c['name']}: {_shown(c)} (target "
            f"{c['target']}): {verdict(c['met'])}" for t in report.get("arm_targets", []) for c in t["targets"]]


def render_overload(report: dict) -> str:
    lines = [*preamble(report, f"open loop at {_loads_title(report['loads'])}"), _method(report), "",
             "## Saturation (closed loop)", "", *_saturation_table(report["calibration"]), ""]
    for load in report["loads"]:
        runs = [r for r in report["runs"] if r["factor"] == load["factor"]]
        lines += [f"## At {load_name(load['factor'])}: {load['rate']:.1f} req/s offered", "",
                  *_compared_table(report, runs), "", *_arm_target_table(report, load["factor"])]
    lines += [_compared_legend(report), "",
              "## Open loop: outcomes", "", *_outcome_table(report["runs"]), "",
              "## Open loop: latency (ms)", "", *_latency_table(report["runs"]), "",
              "## The engine's batches (the server's /metrics)", "", *_stages_table(report), "",
              "*images per batch* and *runner busy* (its calls' time over the wall time) as the server counted them: "
              "under overload, the admitted work against what saturation kept the engine doing. *ms per image*: a "
              "call's time over its images.", ""]
    for r in report["runs"]:
        lines += [f"### Targets: {r['server']}, {_load_short(r['factor'])}, round {r['round']}", "",
                  *target_lines(r["targets"]),
                  f"- recovery probes (ms, in order): {', '.join(map(str, r['recovery']['probes_ms']))}", ""]
    lines += ["*answered*: share of offered requests answered 200 or 429; *goodput*: 200s per second of the window; "
              "*cores*: CPU seconds per second of the server's processes, this load generator, and everything else "
              "on the machine; *send lag*: how late the generator sent, against its schedule (p99); *recovered "
              "after*: from the end of the schedule until a probe came back within 3x the unloaded p99.", ""]
    return "\n".join(lines)


def _loads_title(loads: list[dict]) -> str:
    if loads[0]["factor"] is None:
        return f"{loads[0]['rate']:.1f} req/s"
    return " and ".join(f"{load['factor']:g}x" for load in loads) + " saturation"


def _load_short(factor: float | None) -> str:
    return f"{factor:g}x" if factor else "given"


def _method(report: dict) -> str:
    s, m = report["settings"], report["model"]
    loads = ", ".join(f"{load['factor']:g}x ({load['rate']:.1f} req/s)" if load["factor"] else
                      f"{load['rate']:.1f} req/s (given)" for load in report["loads"])
    measured = (f"the best level of {', '.join(map(str, s['saturation_clients']))} clients, {s['saturation_s']:g} s "
                f"each after 1 s of warm-up, on a fresh server: **{number(report['saturation_per_s'])} req/s** "
                f"answered 200" if report["calibration"] else "")
    arms = (f" The arms ({', '.join(s['arms'])}: this code, each with its own settings) alternate round by round at "
            f"each load." if s["arms"] else "")
    return (f"Saturation: {report['saturation_of']}{', ' + measured if measured else ''}. Overload, at each load "
            f"({loads}): a fresh server gets {s['unloaded_requests']} requests one at a time (unloaded latency), then "
            f"an open loop at that rate: {s['overload_warmup_s']:g} s to fill the queue, then {s['overload_s']:g} s "
            f"measured; every request scheduled in the window is followed to its outcome (client timeout: the "
            f"deadline + {s['timeout_margin_s']:g} s). From the moment the schedule ends, {s['probes']} requests one "
            f"at a time (recovery).{arms} Requests: `POST /v1/classify`, a {m['height']}x{m['width']} PNG as the "
            f"body, default parameters; keep-alive connections, at most {s['max_connections']} open.")


def _saturation_table(calibration: list[dict]) -> list[str]:
    rows = [[c["server"], f"{level['concurrency']}{' (best)' if level['concurrency'] == c['concurrency'] else ''}",
             number(level["requests_per_s"]), number(level["p50_ms"], ".2f"), number(level["p99_ms"], ".2f"),
             str(sum(level["errors"].values())), _full_budget_share(level.get("budgets", {}))]
            for c in calibration for level in c["levels"]]
    return table(["server", "clients", "req/s", "p50 ms", "p99 ms", "errors", "at the full budget"], rows,
                 text_columns=2)


def _full_budget_share(budgets: dict) -> str:
    if not budgets.get("answers"):
        return "n/a"
    return _percent(sum(r["share"] for r in budgets["rungs"] if r["reason"] == ""))


def _percent(value: float | None) -> str:
    return "n/a" if value is None or value != value else f"{value:.2%}"  # None or NaN


def _shown(check: dict) -> str:
    """A target's value in its unit; "n/a" without one."""
    value, unit = check["value"], check["unit"]
    if value is None:
        return "n/a"
    return {"%": _percent(value), "x": f"{value:.2f}x", "ms": f"{value:.1f} ms"}.get(unit, str(value))


# The rows of a load's table, each run a column: (row name, its cell)
_COMPARED: tuple[tuple[str, Callable[[dict], str]], ...] = (
    ("offered req/s", lambda r: number(r["offered_per_s"])),
    ("offered", lambda r: str(r["offered"])),
    ("200", lambda r: outcome_cells(r["outcomes"], ("200",))[0]),
    ("429", lambda r: outcome_cells(r["outcomes"], ("429",))[0]),
    ("other outcomes", lambda r: outcome_cells(r["outcomes"], ("200", "429"))[-1]),
    ("answered 200", lambda r: _percent(answered_200_share(r))),
    ("200s/s", lambda r: number(r["goodput_per_s"])),
    ("200s/s over saturation", lambda r: "n/a" if r["over_saturation"] is None else f"{r['over_saturation']:.2f}x"),
    ("200 p50 ms", lambda r: number(r["outcomes"].get("200", {}).get("p50_ms"))),
    ("200 p99 ms", lambda r: number(r["outcomes"].get("200", {}).get("p99_ms"))),
    ("429 p50 ms", lambda r: number(r["outcomes"].get("429", {}).get("p50_ms"))),
    ("429 p99 ms", lambda r: number(r["outcomes"].get("429", {}).get("p99_ms"))),
    ("unloaded p99 ms", lambda r: number(r["unloaded"]["p99_ms"], ".2f")),
    ("server cores", lambda r: number(r["cpu"]["server_cores"], ".2f")),
    ("server CPU ms per 200", lambda r: number(r["server_cpu_ms_per_200"], ".2f")),
    ("estimated accuracy of the 200s", lambda r: _percent(r["budgets"]["estimated_accuracy"])),
    ("degraded under load", lambda r: _percent(r["budgets"]["degraded_share"])),
)


def _compared_table(report: dict, runs: list[dict]) -> list[str]:
    """One load's runs side by side, each server's rounds together: outcomes, speed, CPU, and the answers by token
    budget."""
    order = [s["label"] for s in report["servers"]]
    runs = sorted(runs, key=lambda r: (order.index(r["server"]), r["round"]))
    rungs = sorted({(g["tokens"], g["reason"]) for r in runs for g in r["budgets"]["rungs"]},
                   key=lambda rung: (-rung[0], rung[1]))
    rows = [[name, *(cell(r) for r in runs)] for name, cell in _COMPARED]
    rows += [[f"answers at {tokens} tokens ({reason or 'full budget'})", *(_rung_share(r, tokens, reason)
                                                                          for r in runs)] for tokens, reason in rungs]
    return table(["", *(f"{r['server']}, round {r['round']}" for r in runs)], rows)


def _rung_share(run: dict, tokens: int, reason: str) -> str:
    budgets = run["budgets"]
    if not budgets["answers"]:
        return "n/a"
    return _percent(sum(g["share"] for g in budgets["rungs"] if (g["tokens"], g["reason"]) == (tokens, reason)))


def _compared_legend(report: dict) -> str:
    return ("*answered 200*: share of offered requests answered 200; *200s/s over saturation*: 200s per second of "
            f"the window over the full-budget saturation ({number(report['saturation_per_s'])} req/s); *server CPU ms "
            "per 200*: the server's CPU time in the window per request of it answered 200; *answers at N tokens "
            "(why)*: the answers the server gave in the window (its /metrics read at the window's edges) by the token "
            "budget they ran at and why it was below the full budget (load: the server chose it; asked: the client's "
            "max_tokens); *degraded under load*: their share at a budget the server chose for load; *estimated "
            "accuracy*: the mean accuracy, measured at export, of the budgets those answers ran at (n/a: none had "
            "one, as in a file exported without --eval).")


def _arm_target_table(report: dict, factor: float | None) -> list[str]:
    rounds = [t for t in report["arm_targets"] if t["factor"] == factor]
    if not rounds:
        return []
    rows = [[check["name"], check["target"], *(_checked(t["targets"][i]) for t in rounds)]
            for i, check in enumerate(rounds[0]["targets"])]
    return [f"### Targets of the {DEGRADING_ARM} arm at {factor:g}x saturation", "",
            *table(["target", "goal", *(f"round {t['round']}" for t in rounds)], rows, text_columns=2), ""]


def _checked(check: dict) -> str:
    """A target's value and verdict; "n/a" alone when there is no value to judge."""
    return "n/a" if check["met"] is None else f"{_shown(check)} {verdict(check['met'])}"


def _stages_table(report: dict) -> list[str]:
    phases = [(c["server"], f"saturation, {level['concurrency']} clients", level.get("stages", {}))
              for c in report["calibration"] for level in c["levels"]]
    phases += [(r["server"], f"open loop {_load_short(r['factor'])}, round {r['round']}", r.get("stages", {}))
               for r in report["runs"]]

    def per_image(stages: dict) -> str:
        return number(stages["call_ms"] / stages["mean_batch"], ".3f") if stages.get("mean_batch") else "-"

    rows = [[server, phase, number(stages.get("mean_batch"), ".1f"), number(stages.get("runner_busy"), ".2f"),
             number(stages.get("call_ms"), ".2f"), per_image(stages), number(stages.get("queue_wait_ms"), ".1f"),
             number(stages.get("preprocess_ms"), ".2f")] for server, phase, stages in phases]
    return table(["server", "phase", "images per batch", "runner busy", "ms per call", "ms per image",
                  "queue wait ms", "preprocess ms"], rows, text_columns=2)


def _outcome_table(runs: list[dict]) -> list[str]:
    header = ["server", "load", "round", "offered", "req/s", "200", "429", "timeout", "connection error", "other",
              "answered", "goodput req/s", "server cores", "client cores", "other cores", "peak RSS MB",
              "send lag ms"]
    rows = [[r["server"], _load_short(r["factor"]), str(r["round"]), str(r["offered"]), number(r["offered_per_s"]),
             *outcome_cells(r["outcomes"], ("200", "429", TIMEOUT, CONNECTION_ERROR)), f"{r['answered_share']:.2%}",
             number(r["goodput_per_s"]), *(number(r["cpu"][k], ".2f") for k in ("server_cores", "client_cores",
                                                                                  "other_cores")),
             number(r["peak_rss_mb"], ".0f"), number(r["generator"]["lag_p99_ms"], ".1f")] for r in runs]
    return table(header, rows, text_columns=2)


def _latency_table(runs: list[dict]) -> list[str]:
    header = ["server", "load", "round", "unloaded p50", "unloaded p99", "200 p50", "200 p99", "200 max", "429 p50",
              "429 p99", "429 max", "first probe", "recovered after"]
    rows = [[r["server"], _load_short(r["factor"]), str(r["round"]), number(r["unloaded"]["p50_ms"], ".2f"),
             number(r["unloaded"]["p99_ms"], ".2f"),
             *(number(r["outcomes"].get(o, {}).get(q), ".1f") for o in ("200", "429") for q in ("p50_ms", "p99_ms",
                                                                                               "max_ms")),
             number(r["recovery"]["first_ms"], ".1f"), number(r["recovery"]["recovered_after_ms"], ".0f")]
            for r in runs]
    return table(header, rows, text_columns=2)


def _run_line(r: dict) -> str:
    o, degraded = r["outcomes"], r["budgets"]["degraded_share"]
    return (f"  offered {r['offered']} ({r['offered_per_s']:.1f}/s): 200 {o.get('200', {}).get('count', 0)}, 429 "
            f"{o.get('429', {}).get('count', 0)}, answered {r['answered_share']:.2%}; 200 p99 "
            f"{number(o.get('200', {}).get('p99_ms'))} ms, 429 p99 {number(o.get('429', {}).get('p99_ms'))} ms; "
            f"first probe {r['recovery']['first_ms']:.1f} ms; degraded under load {_percent(degraded)}")
