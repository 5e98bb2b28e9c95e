"""The open-loop generator against a scripted loopback server (schedule, every outcome counted once), the overload
mode's summaries and targets, the token-budget counters and the degrading arm's targets, and short overload runs on
the tiny model: one server, then the refusing and degrading arms. No timing is asserted: speed is what the
benchmark measures, never what a test checks."""
from __future__ import annotations

import asyncio
import json
import os
import re

import pytest

from vitserve.bench.cli import reliability_config_from_args
from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import HttpConnection, encode_request
from vitserve.bench.overload import (
    CONNECTION_ERROR,
    HUNG_UP,
    NOT_SENT,
    TIMEOUT,
    Answer,
    OpenLoop,
    Request,
    arm_targets,
    budget_summary,
    degrading_targets,
    exchange,
    load_summary,
    overload_loads,
    overload_targets,
    recovery,
    render_overload,
    run_overload,
)
from vitserve.bench.reliability import ReliabilityConfig, write_report
from vitserve.cli import build_parser


async def _scripted_server(answers: dict[bytes, str], delay_s: float = 0.0):
    """A loopback HTTP/1.1 server that answers each request by its body: a status, 'drop' (close without an answer)
    or 'hang' (never answer). Returns (server, port, bodies received in full)."""
    received = []

    async def handle(reader, writer):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.split(b"Content-Length: ")[1].split(b"\r\n")[0])
                body = await reader.readexactly(length)
                received.append(body)
                action = answers[body]
                if action == "hang":
                    await asyncio.sleep(3600)
                if action == "drop":
                    break
                await asyncio.sleep(delay_s)
                writer.write(f"HTTP/1.1 {action} X\r\nContent-Length: 2\r\n\r\nok".encode())
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client hung up
        finally:
            writer.close()

    server = await asyncio.start_server(handle, LOOPBACK, 0)
    return server, server.sockets[0].getsockname()[1], received


def _request(body: bytes) -> Request:
    return Request(body.decode(), encode_request("POST", "/", body))


@pytest.mark.slow
def test_open_loop_follows_every_scheduled_request_to_exactly_one_outcome():
    answers = {b"ok": "200", b"busy": "429", b"oops": "503", b"drop": "drop", b"slow": "hang"}
    abandoned = Request("abandon", encode_request("POST", "/", b"0123456789")[:-7], hang_up=True)
    requests = [_request(b) for b in answers] + [abandoned]  # 6 kinds, cycled

    async def scenario():
        server, port, received = await _scripted_server(answers)
        load = OpenLoop(LOOPBACK, port, requests, rate=120.0, duration_s=0.5, timeout_s=0.5, warmup_s=0.1)
        windows = []
        await load.send(on_window=windows.append)
        await load.drain()
        server.close()
        return load, windows, received

    load, windows, received = asyncio.run(scenario())
    assert windows == ["start", "end"]
    assert (len(load.warmup_answers), len(load.answers), load.measured_sent) == (12, 60, 60)
    assert load.window_s == pytest.approx(0.5) and len(load.lags) == 72
    summary = load_summary(load.answers, load.window_s)
    counts = {o: v["count"] for o, v in summary["outcomes"].items()}
    assert counts == {"200": 10, "429": 10, "503": 10, CONNECTION_ERROR: 10, TIMEOUT: 10, HUNG_UP: 10}
    assert summary["offered"] == sum(counts.values()) == 60
    assert summary["answered_share"] == pytest.approx(20 / 60)
    assert summary["goodput_per_s"] == pytest.approx(10 / 0.5)
    assert {a.kind for a in load.answers if a.outcome == TIMEOUT} == {"slow"}
    assert b"0123456789" not in received  # the abandoned upload never arrived whole


def test_a_request_on_a_connection_the_server_closed_while_idle_goes_again_on_a_new_one():
    """The server closes each connection after its answer without saying so (as uvicorn does after an unhandled
    error): the next request on that connection fails before any answer and is sent once more."""
    connections = []

    async def handle(reader, writer):
        connections.append(writer)
        await reader.readuntil(b"\r\n\r\n")
        await reader.readexactly(2)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_server(handle, LOOPBACK, 0)
        conn = HttpConnection(LOOPBACK, server.sockets[0].getsockname()[1])
        first = await exchange(conn, _request(b"ok").payload, 5.0)
        await asyncio.sleep(0.05)  # the server's close arrives
        second = await exchange(conn, _request(b"ok").payload, 5.0)
        await conn.close()
        server.close()
        return first[0], second[0]

    assert asyncio.run(scenario()) == ("200", "200")
    assert len(connections) == 2


@pytest.mark.slow
def test_requests_finding_every_connection_busy_are_counted_not_sent():
    async def scenario():
        server, port, _ = await _scripted_server({b"ok": "200"}, delay_s=1.0)
        load = OpenLoop(LOOPBACK, port, [_request(b"ok")], rate=50.0, duration_s=0.2, timeout_s=5.0,
                        max_connections=1)
        await load.send()
        await load.drain()
        server.close()
        return load

    load = asyncio.run(scenario())
    assert sorted(a.outcome for a in load.answers) == ["200"] + [NOT_SENT] * 9  # (in the order answered)


def test_setting_stop_ends_the_schedule_early():
    async def scenario():
        server, port, _ = await _scripted_server({b"ok": "200"})
        load, stop = OpenLoop(LOOPBACK, port, [_request(b"ok")], rate=100.0, duration_s=60.0, timeout_s=5.0), \
            asyncio.Event()
        asyncio.get_running_loop().call_later(0.2, stop.set)
        await load.send(stop)
        await load.drain()
        server.close()
        return load

    load = asyncio.run(scenario())
    assert 0 < load.measured_sent < 6000 and len(load.answers) == load.measured_sent
    assert load.window_s == pytest.approx(load.measured_sent / 100.0)


def test_recovery_is_the_first_probe_as_fast_as_unloaded_counted_from_the_stop():
    probes = [Answer("probe", "200", 10.0, 0.5), Answer("probe", "429", 10.5, 0.001),
              Answer("probe", "200", 10.6, 0.02), Answer("probe", "200", 10.7, 0.01)]
    r = recovery(probes, stopped=10.0, unloaded_p99_ms=10.0)  # within 30 ms counts
    assert r["statuses"] == ["200", "429", "200", "200"] and r["probes_ms"] == [500.0, 1.0, 20.0, 10.0]
    assert r["first_ms"] == pytest.approx(500.0)
    assert r["recovered_after_ms"] == pytest.approx(620.0)
    assert recovery(probes[:2], 10.0, 10.0)["recovered_after_ms"] is None


def test_overload_targets_compare_each_figure_with_the_issue():
    row = {"outcomes": {"200": {"p99_ms": 40.0}, "429": {"p99_ms": 12.0}}, "answered_share": 0.995,
           "unloaded": {"p99_ms": 10.0}, "recovery": {"first_ms": 25.0}}
    met = {t["name"]: t["met"] for t in overload_targets(row, deadline_s=10.0)}
    assert list(met.values()) == [False, True, True, False, True]
    no_rejections = {**row, "outcomes": {"200": {"p99_ms": 20.0}}}
    assert [t["met"] for t in overload_targets(no_rejections, 10.0)][:4] == [None, True, True, True]
    short_deadline = [t["met"] for t in overload_targets(row, deadline_s=0.02)]
    assert short_deadline[2:4] == [False, None]  # 3x unloaded p99 above the deadline: that target does not apply


@pytest.mark.slow
def test_a_short_overload_run_on_the_tiny_model_accounts_for_every_request(tiny_onnx, tmp_path):
    # the server and the load generator on cores of their own, where there are two
    every = tuple(sorted(os.sched_getaffinity(0)))
    server_cpus, client_cpus = (every[:1], every[1:]) if len(every) > 1 else (every, every)
    cfg = ReliabilityConfig(mode="overload", model=str(tiny_onnx), saturation_clients=[4], saturation_s=0.5,
                            overload_warmup_s=0.2, overload_s=1.0, unloaded_requests=5, probes=3,
                            log_dir=tmp_path / "logs", out=tmp_path / "overload.md", server_cpus=server_cpus,
                            client_cpus=client_cpus)
    try:
        report = run_overload(cfg, {"max_queue_size": "8"}, command="test")
    finally:
        os.sched_setaffinity(0, every)  # the generator's pinning is this (pytest's) process's
    (c,), (r,) = report["calibration"], report["runs"]
    assert (r["server_cpus"], r["client_cpus"]) == (list(server_cpus), list(client_cpus))
    (load,) = report["loads"]
    assert load["rate"] == pytest.approx(2 * c["requests_per_s"]) and c["concurrency"] == 4 and r["factor"] == 2.0
    assert report["saturation_per_s"] == c["requests_per_s"] and report["arm_targets"] == []
    assert r["offered"] == sum(v["count"] for v in r["outcomes"].values()) == round(load["rate"] * 1.0)
    assert r["over_saturation"] == pytest.approx(r["goodput_per_s"] / c["requests_per_s"])
    assert set(r["outcomes"]) <= {"200", "429", "503", "504", TIMEOUT, CONNECTION_ERROR, NOT_SENT}
    assert len(r["recovery"]["probes_ms"]) == 3 and len(r["targets"]) == 5
    (server,) = report["servers"]
    assert server["label"] == "this code" and server["settings"]["max_queue_size"] == 8  # what the server read
    paths = write_report(report, render_overload(report), cfg.report_path)
    assert [p.name for p in paths] == ["overload.md", "overload.json"]
    text = paths[0].read_text()
    assert "## Open loop: outcomes" in text and "### Targets: this code, 2x, round 1" in text
    assert "## At 2x saturation: " in text and "|  | this code, round 1 |" in text
    assert f"- cores: the servers on {','.join(map(str, server_cpus))}, the load generator on" in text
    # the engine's own account, from the server's counters: the batches of both phases
    for stages in (c["stages"], r["stages"]):
        assert stages["mean_batch"] >= 1.0 and stages["runner_busy"] > 0 and stages["call_ms"] > 0
    assert "| this code | saturation, 4 clients |" in text and "| this code | open loop 2x, round 1 |" in text
    assert json.loads(paths[1].read_text())["runs"][0]["offered"] == r["offered"]


def test_the_budget_counters_give_each_rungs_share_and_the_estimated_accuracy_of_the_window():
    before = {"196/": 100.0, "vitserve_budget_estimated_accuracy_total": 90.0,
              "vitserve_budget_measured_answers_total": 100.0}
    after = {"196/": 160.0, "100/load": 30.0, "144/load": 10.0, "144/asked": 0.0,
             "vitserve_budget_estimated_accuracy_total": 90.0 + 60 * 0.95 + 40 * 0.90,
             "vitserve_budget_measured_answers_total": 200.0}
    b = budget_summary(before, after)
    assert [(g["tokens"], g["reason"], g["answers"]) for g in b["rungs"]] == [(196, "", 60), (144, "load", 10),
                                                                              (100, "load", 30)]
    assert [g["share"] for g in b["rungs"]] == pytest.approx([0.6, 0.1, 0.3])
    assert (b["answers"], b["measured_answers"]) == (100, 100) and b["degraded_share"] == pytest.approx(0.4)
    assert b["estimated_accuracy"] == pytest.approx(0.93)
    unmeasured = budget_summary({"16/": 5.0}, {"16/": 9.0, "9/load": 2.0})  # a file exported without --eval
    assert unmeasured["estimated_accuracy"] is None and unmeasured["degraded_share"] == pytest.approx(2 / 6)
    assert budget_summary({}, {}) == {"answers": 0, "rungs": [], "degraded_share": None, "estimated_accuracy": None,
                                      "measured_answers": 0}  # a server without the counters


def test_the_degrading_arms_targets_at_2x_and_4x_compare_with_saturation_and_the_refusing_arm():
    run = {"factor": 2.0, "offered": 1000, "goodput_per_s": 195.0, "over_saturation": 1.95,
           "unloaded": {"p99_ms": 10.0}, "outcomes": {"200": {"count": 995, "p99_ms": 35.0}, "429": {"count": 5}},
           "budgets": {"estimated_accuracy": 0.93}}
    refusing = {"goodput_per_s": 100.0}
    met = {t["name"]: (t["value"], t["met"]) for t in degrading_targets(run, refusing)}
    assert met == {"share of offered answered 200": (pytest.approx(0.995), True),
                   "200s/s over the full-budget saturation": (1.95, True),
                   "p99 of the 200s over the unloaded p99": (pytest.approx(3.5), False),
                   "200s/s over the refusing arm's (same round)": (pytest.approx(1.95), True),
                   "estimated accuracy of the 200s": (0.93, True)}
    four = {**run, "factor": 4.0, "over_saturation": 2.4, "budgets": {"estimated_accuracy": None},
            "outcomes": {"200": {"count": 900}, "429": {"count": 90, "p99_ms": 4.0}, "503": {"count": 10}}}
    assert [(t["name"], t["met"]) for t in degrading_targets(four, None)] == [
        ("200s/s over the full-budget saturation", False), ("p99 of the 429s", True), ("5xx answers", False),
        ("200s/s over the refusing arm's (same round)", None), ("estimated accuracy of the 200s", None)]


def _args(*flags: str):
    return build_parser().parse_args(["bench", *flags])


def test_arms_and_checkouts_do_not_combine_and_arms_are_named(tmp_path):
    (tmp_path / "service").mkdir()
    with pytest.raises(SystemExit, match="--arms and --checkout do not combine"):
        reliability_config_from_args(_args("--mode", "overload", "--arms", "refuse,degrade", "--checkout",
                                           str(tmp_path)))
    with pytest.raises(SystemExit, match="--arms and --checkout do not combine"):  # before any model is made
        run_overload(ReliabilityConfig(model="no-such-model", arms=["refuse"], checkouts=[tmp_path]), {}, "test")
    with pytest.raises(SystemExit, match="distinct names among refuse, degrade"):
        reliability_config_from_args(_args("--mode", "overload", "--arms", "refuse,shed"))
    with pytest.raises(SystemExit, match="set degrade_under_load themselves"):
        reliability_config_from_args(_args("--mode", "overload", "--arms", "refuse,degrade", "--set",
                                           "degrade_under_load=false"))
    cfg = reliability_config_from_args(_args("--mode", "overload", "--arms", "refuse,degrade", "--overload-factor",
                                             "2,4", "--set", "budget_unmeasured_rungs=true"))
    assert (cfg.arms, cfg.overload_factors) == (["refuse", "degrade"], [2.0, 4.0])


_PERCENT_OR_NA = r"(\d+\.\d\d%|n/a)"


@pytest.mark.slow
def test_refusing_and_degrading_arms_alternate_on_one_saturation_at_the_full_budget(tiny_onnx, tmp_path):
    # one factor keeps the test to three servers; the report of two is rendered from its runs below
    cfg = ReliabilityConfig(mode="overload", model=str(tiny_onnx), arms=["refuse", "degrade"],
                            overload_factors=[4.0], saturation_clients=[4], saturation_s=0.3,
                            overload_warmup_s=0.2, overload_s=0.5, unloaded_requests=3, probes=2,
                            log_dir=tmp_path / "logs", out=tmp_path / "overload.md")
    report = run_overload(cfg, {"max_queue_size": "8", "budget_unmeasured_rungs": "true"}, command="test")
    assert [(s["label"], s["settings"]["degrade_under_load"]) for s in report["servers"]] == [("refuse", False),
                                                                                             ("degrade", True)]
    (c,) = report["calibration"]  # saturation once, by the refusing arm: every answer at the full budget
    assert c["server"] == "refuse" and "refuse arm" in report["saturation_of"]
    assert [g["reason"] for g in c["budgets"]["rungs"]] == [""] and c["budgets"]["answers"] >= c["completed"]
    assert [load["rate"] for load in report["loads"]] == pytest.approx([4 * c["requests_per_s"]])
    assert [(r["factor"], r["server"]) for r in report["runs"]] == [(4.0, "refuse"), (4.0, "degrade")]
    for r in report["runs"]:
        assert r["offered"] == sum(v["count"] for v in r["outcomes"].values())
        assert set(r["budgets"]) == {"answers", "rungs", "degraded_share", "estimated_accuracy", "measured_answers"}
        assert r["budgets"]["estimated_accuracy"] is None  # the tiny file was exported without --eval
        assert r["budgets"]["degraded_share"] is None or 0 <= r["budgets"]["degraded_share"] <= 1
        # CPU time is read in clock ticks (10 ms): the tiny model's few answers in a short window can read 0
        assert r["server_cpu_ms_per_200"] is None or r["server_cpu_ms_per_200"] >= 0
    refusing = report["runs"][0]["budgets"]
    assert refusing["degraded_share"] in (None, 0.0) and all(g["reason"] == "" for g in refusing["rungs"])
    (checked,) = report["arm_targets"]
    assert (checked["factor"], checked["round"], len(checked["targets"])) == (4.0, 1, 5)
    assert checked["targets"][3]["value"] == pytest.approx(report["runs"][1]["goodput_per_s"]
                                                           / report["runs"][0]["goodput_per_s"])
    text = write_report(report, render_overload(report), cfg.report_path)[0].read_text()
    assert "- **refuse** degrade_under_load=false: commit" in text
    assert "## At 4x saturation: " in text and "|  | refuse, round 1 | degrade, round 1 |" in text
    for row in ("estimated accuracy of the 200s", "degraded under load", r"answers at 16 tokens \(full budget\)"):
        assert re.search(rf"^\| {row} \| {_PERCENT_OR_NA} \| {_PERCENT_OR_NA} \|$", text, re.M), row
    assert re.search(r"^\| estimated accuracy of the 200s \| >= 92% \| n/a \|$", text, re.M)
    assert json.loads(cfg.report_path.with_suffix(".json").read_text())["arm_targets"][0]["factor"] == 4.0

    two = {**report, "loads": [{"factor": 2.0, "rate": report["loads"][0]["rate"] / 2}, *report["loads"]],
           "runs": [*({**r, "factor": 2.0} for r in report["runs"]), *report["runs"]]}
    text = render_overload({**two, "arm_targets": arm_targets(two)})
    assert "# `vitserve bench --mode overload`: open loop at 2x and 4x saturation" in text
    assert text.index("## At 2x saturation: ") < text.index("## At 4x saturation: ")
    assert text.count("|  | refuse, round 1 | degrade, round 1 |") == 2
    assert "### Targets of the degrade arm at 2x saturation" in text and "| share of offered answered 200 |" in text


def test_the_loads_are_each_factor_of_the_saturation_or_the_rate_given():
    assert overload_loads(ReliabilityConfig(overload_factors=[2.0, 4.0]), 100.0) == [
        {"factor": 2.0, "rate": 200.0}, {"factor": 4.0, "rate": 400.0}]
    assert overload_loads(ReliabilityConfig(rate=50.0), None) == [{"factor": None, "rate": 50.0}]
