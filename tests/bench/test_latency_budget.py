"""The latency budget bench's own arithmetic (bench/latency_budget.py); the servers it starts are the ones every
other bench test starts."""
from __future__ import annotations

from vitserve.bench import latency_budget


def test_a_stage_that_repeats_is_summed_and_the_header_read_in_order():
    stages = latency_budget.stages_of("accept;dur=0.100, decode;dur=0.400, decode;dur=0.600, total;dur=2.000")
    assert list(stages) == ["accept", "decode", "total"]
    assert stages == {"accept": 0.1, "decode": 1.0, "total": 2.0}


def test_the_report_gives_the_budget_and_what_the_server_adds_to_the_work():
    def arm(p50, stages=None):
        return {"p50_ms": p50, "p99_ms": p50 * 2, "mean_ms": p50, **({"stages_p50_us": stages} if stages else {})}

    rounds = [{"order": ["in-process", "FastAPI app", "vitserve"], "in-process": arm(3.0), "FastAPI app": arm(5.0),
               "vitserve": arm(6.0 + shift, {"decode": 400.0, "inference": 2500.0, "total": 5000.0 + 1000 * shift})}
              for shift in (0.0, 0.5, 1.0)]
    text = latency_budget.markdown({"command": "python -m vitserve.bench.latency_budget", "machine": "m",
                                    "model": "x.onnx", "image": "a.png", "requests": 10, "rounds": rounds})
    assert "| vitserve | 6.50 | 13.00 |" in text and "| in-process | 3.00 | 6.00 |" in text
    assert "at p50: **3.50 ms**" in text and "**1.30x** (6.50 against 5.00 ms)" in text
    assert "| inference | 2500 |" in text and "| total | 5500 |" in text
    assert "| outside the app (client p50 less the server's total) | 1000 |" in text


def test_the_multipart_body_is_one_file_field():
    body = latency_budget.multipart(b"\x89PNG")
    assert body.startswith(b"--vitserve-budget\r\nContent-Disposition: form-data; name=\"file\"")
    assert body.endswith(b"\x89PNG\r\n--vitserve-budget--\r\n")


def test_with_a_baseline_the_report_sets_each_stage_before_beside_after():
    def arm(p50, stages):
        return {"p50_ms": p50, "p99_ms": p50 * 2, "mean_ms": p50, "stages_p50_us": stages}

    before = "vitserve at 0123456789ab"
    rounds = [{"order": ["in-process", "FastAPI app", "vitserve", before], "in-process": {"p50_ms": 3.0, "p99_ms": 6.0},
               "FastAPI app": {"p50_ms": 5.0, "p99_ms": 10.0},
               "vitserve": arm(4.5, {"decode": 300.0, "total": 4000.0}),
               before: arm(6.0, {"decode": 300.0, "decode_wait": 300.0, "total": 5500.0})} for _ in range(3)]
    text = latency_budget.markdown({"command": "c", "machine": "m", "model": "x.onnx", "image": "a.png",
                                    "requests": 10, "rounds": rounds, "baseline": before,
                                    "runs_on": {"vitserve": "OpenVINO/CPU/bf16", before: "CPUExecutionProvider"}})
    assert "vitserve ran on OpenVINO/CPU/bf16. vitserve at 0123456789ab ran on CPUExecutionProvider." in text
    assert "| stage | vitserve µs | vitserve at 0123456789ab µs |" in text
    assert "| decode | 300 | 300 |" in text and "| decode_wait |  | 300 |" in text  # a stage the change removed
    assert "| total | 4000 | 5500 |" in text and "| outside the app (client p50 less the server's total) | 500 | 500 |" in text
    assert "4.50 against 6.00 ms (0.75x)" in text and "then 3.00 ms, against the FastAPI app 1.20x" in text


def test_a_commit_that_is_not_there_stops_the_run_in_one_line_before_any_server_starts(monkeypatch):
    import pytest

    from vitserve.bench import servers

    monkeypatch.setattr(servers.ServerProcess, "__enter__", lambda self: pytest.fail("a server was started"))
    with pytest.raises(SystemExit, match="^no commit 'no-such-commit' in this repository$"):
        latency_budget.main(["--baseline-commit", "no-such-commit", "--rounds", "1"])


def test_each_arm_measures_on_a_fresh_connection_and_hangs_up_after_it():
    # one client is one connection: an idle keep-alive connection left by another arm would be a second client to
    # the server (a lone request on its server's only connection runs on the worker's event loop)
    import http.server
    import threading

    class Echo(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"
        opened: list = []

        def setup(self):
            super().setup()
            Echo.opened.append(self.connection)

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        client = latency_budget.Client(server.server_address[1], "/x", b"png", "image/png")
        client.send()  # a connection before the arm: replaced by the arm's own
        result = latency_budget.measure(client.send, requests=5, warmup=2)
        assert result["p50_ms"] > 0 and len(Echo.opened) == 2  # the arm's 7 requests on one new connection
        assert client.connection.sock is None  # hung up
    finally:
        server.shutdown()
        server.server_close()


def test_where_a_vitserve_runs_is_read_from_its_model_info_series():
    metrics = (b'# TYPE vitserve_model_info gauge\n'
               b'vitserve_model_info{name="m",opset="20",provider="OpenVINO/CPU/bf16",version="1"} 1.0\n')
    assert latency_budget.runs_on_of(metrics) == "OpenVINO/CPU/bf16"
    assert latency_budget.runs_on_of(b"vitserve_up 1\n") == "unknown"
