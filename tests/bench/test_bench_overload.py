"""The open-loop generator against a scripted loopback server (schedule, every outcome counted once), the overload
mode's summaries and targets, and one short overload run on the tiny model. No timing is asserted: speed is what
the benchmark measures, never what a test checks."""
from __future__ import annotations

import asyncio
import json
import os

import pytest

from vitserve.bench.config import LOOPBACK
from vitserve.bench.load import HttpConnection, encode_request
from vitserve.bench.overload import (CONNECTION_ERROR, HUNG_UP, NOT_SENT, TIMEOUT, Answer, OpenLoop, Request, exchange,
                            load_summary, overload_targets, recovery, render_overload, run_overload)
from vitserve.bench.reliability import ReliabilityConfig, write_report


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
    assert report["rate"] == pytest.approx(2 * c["requests_per_s"]) and c["concurrency"] == 4
    assert r["offered"] == sum(v["count"] for v in r["outcomes"].values()) == round(report["rate"] * 1.0)
    assert set(r["outcomes"]) <= {"200", "429", "503", "504", TIMEOUT, CONNECTION_ERROR, NOT_SENT}
    assert len(r["recovery"]["probes_ms"]) == 3 and len(r["targets"]) == 5
    (server,) = report["servers"]
    assert server["label"] == "this code" and server["settings"]["max_queue_size"] == 8  # what the server read
    paths = write_report(report, render_overload(report), cfg.report_path)
    assert [p.name for p in paths] == ["overload.md", "overload.json"]
    text = paths[0].read_text()
    assert "## Open loop: outcomes" in text and "### Targets: this code, round 1" in text
    assert f"- cores: the servers on {','.join(map(str, server_cpus))}, the load generator on" in text
    # the engine's own account, from the server's counters: the batches of both phases
    for stages in (c["stages"], r["stages"]):
        assert stages["mean_batch"] >= 1.0 and stages["runner_busy"] > 0 and stages["call_ms"] > 0
    assert "| this code | saturation, 4 clients |" in text and "| this code | open loop, round 1 |" in text
    assert json.loads(paths[1].read_text())["runs"][0]["offered"] == r["offered"]
