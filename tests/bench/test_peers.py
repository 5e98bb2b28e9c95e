"""`vitserve bench --mode peers` (bench/peers/): the request bodies each server is sent, wrk's scripts and its report
parsed (samples captured from real wrk 4.1.0 runs on this machine), the rounds' order, the medians, the answer
checks, the report, the flags, and the per-image work the peers run held equal to vitserve's. No server starts
here: Triton and LitServe live in their own venvs, which CI does not have."""
from __future__ import annotations

import email.parser
import email.policy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vitserve.bench.load import make_images
from vitserve.bench.peers.answers import TOLERANCE, answer_values, compare
from vitserve.bench.peers.bodies import (TRITON_IMAGE_MODEL, TRITON_TENSOR_MODEL, multipart_image, peer_request,
                                triton_image_request)
from vitserve.bench.peers.cli import build_parser, config_from, config_from_bench_args
from vitserve.bench.peers.config import KNOWN_SERVERS, QUICK, SERVED_PATHS, PeersConfig
from vitserve.bench.peers.image_classifier import LIMITS, ImageClassifier, session_options, softmax
from vitserve.bench.peers.report import ratios_by_round, render, served_of_alone, summarise
from vitserve.bench.peers.venvs import REQUIREMENTS
from vitserve.bench.peers.wrk import (lua_script, parse_statuses, parse_wrk, steady_rate, take_answer_times,
                                      threads_for, wrk_argv, write_script)
from vitserve.bench.reliability import alternated
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH, join_body, split_body, take_sections, tensor_bytes, unpack_bytes

# `wrk -t2 -c8 -d3s --timeout 30s --latency -s multipart.lua http://127.0.0.1:18200/predict` against LitServe
WRK_OK = """Running 3s test @ http://127.0.0.1:18200/predict
  2 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency    25.80ms    8.00ms  56.03ms   72.91%
    Req/Sec   154.68     25.29   202.00     76.67%
  Latency Distribution
     50%   24.96ms
     75%   30.02ms
     90%   35.46ms
     99%   50.14ms
  941 requests in 3.05s, 829.81KB read
Requests/sec:    308.43
Transfer/sec:    271.99KB
"""
# the same script against a path LitServe does not have: every answer a 404
WRK_NOT_FOUND = """Running 2s test @ http://127.0.0.1:18200/nope
  2 threads and 8 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency     2.29ms    2.69ms  35.60ms   88.85%
    Req/Sec     2.31k   788.32     5.02k    72.50%
  Latency Distribution
     50%    1.18ms
     75%    2.97ms
     90%    5.24ms
     99%   11.45ms
  9247 requests in 2.02s, 1.36MB read
  Non-2xx or 3xx responses: 9247
Requests/sec:   4586.49
Transfer/sec:    689.83KB
"""
# `wrk -t1 -c2 -d2s --timeout 1s --latency` against a socket that answers 503 and hangs up
WRK_SOCKET_ERRORS = """Running 2s test @ http://127.0.0.1:18399/
  1 threads and 2 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   141.55us  345.36us   4.39ms   95.83%
    Req/Sec    10.08k   631.22    10.78k    76.19%
  Latency Distribution
     50%   67.00us
     75%  107.00us
     90%  129.00us
     99%    2.12ms
  21056 requests in 2.10s, 1.14MB read
  Socket errors: connect 0, read 21056, write 0, timeout 0
  Non-2xx or 3xx responses: 21056
Requests/sec:  10029.31
Transfer/sec:    558.27KB
"""
# `wrk -t2 -c4 -d1s --timeout 10s --latency -s x.times.lua` against a server answering what it holds every 250 ms:
# four batches of four in 1.10 s, which wrk counts as 14.54 answers a second; the batches say 16
WRK_ANSWER_TIMES = """Running 1s test @ http://127.0.0.1:18779/p
  2 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   214.07ms   65.96ms 251.08ms   75.00%
    Req/Sec     9.00      1.85    10.00     75.00%
  Latency Distribution
     50%  250.90ms
     75%  250.99ms
     90%  251.04ms
     99%  251.08ms
  16 requests in 1.10s, 640.00B read
Requests/sec:     14.54
Transfer/sec:     581.77B
""" + "".join(f"answered at {t}\n" for t in (
    "71542.938185", "71542.938254", "71543.189191", "71543.189224", "71543.440187", "71543.440265", "71543.691301",
    "71543.691312", "71542.938381", "71542.938398", "71543.189238", "71543.189264", "71543.440244", "71543.440388",
    "71543.691309", "71543.691319"))


@pytest.fixture(scope="module")
def png() -> bytes:
    return make_images("png", (8, 8), channels=3, count=1)[0]


@pytest.fixture
def pixels() -> np.ndarray:
    return np.random.default_rng(0).normal(size=(1, 3, 8, 8)).astype(np.float32)  # (1, C, H, W)


# ---------------------------------------------------------------------------------------------------- bodies


def test_multipart_image_is_a_form_whose_file_field_is_the_png_byte_for_byte(png):
    body, headers = multipart_image(png)
    message = email.parser.BytesParser(policy=email.policy.default).parsebytes(
        f"Content-Type: {headers['Content-Type']}\r\n\r\n".encode() + body)
    (part,) = message.iter_parts()
    assert part.get_param("name", header="content-disposition") == "file"
    assert part.get_content_type() == "image/png"
    assert part.get_payload(decode=True) == png


def test_triton_image_request_is_one_binary_bytes_element_with_json_outputs(png):
    body, headers = triton_image_request(png)
    header, binary = split_body(body, headers[HEADER_LENGTH])
    doc = json.loads(header)
    (tensor,) = doc["inputs"]
    assert (tensor["name"], tensor["datatype"], tensor["shape"]) == ("image", "BYTES", [1, 1])  # a batch of one
    (section,) = take_sections(binary, [tensor["parameters"]["binary_data_size"]])
    assert unpack_bytes(section, 1, max_element_bytes=len(png)) == [png]
    assert doc["outputs"] == [{"name": "top_index"}, {"name": "top_score"}, {"name": "rollout"}]  # JSON, not binary


def test_tensor_paths_send_vitserve_and_triton_the_same_bytes(png, pixels):
    for path in ("oip-json", "oip-binary"):
        mine, theirs = (peer_request(s, path, png, pixels, "vit-fmnist") for s in ("vitserve", "triton"))
        assert mine.body == theirs.body and mine.headers == theirs.headers
        assert (mine.target, theirs.target) == ("/v2/models/vit-fmnist/infer",
                                                f"/v2/models/{TRITON_TENSOR_MODEL}/infer")
    binary = peer_request("triton", "oip-binary", png, pixels, "")
    assert binary.body.endswith(tensor_bytes(pixels, "FP32"))


def test_image_path_per_server(png, pixels):
    vitserve, triton, litserve = (peer_request(s, "image", png, pixels, "m") for s in ("vitserve", "triton",
                                                                                       "litserve"))
    assert (vitserve.target, vitserve.body, vitserve.headers) == ("/v1/classify", png, {"Content-Type": "image/png"})
    assert triton.target == f"/v2/models/{TRITON_IMAGE_MODEL}/infer" and png in triton.body
    assert litserve.target == "/predict" and litserve.headers["Content-Type"].startswith("multipart/form-data")
    with pytest.raises(ValueError, match="no Open Inference Protocol"):
        peer_request("litserve", "oip-json", png, pixels, "m")
    assert SERVED_PATHS["litserve"] == ("image",)


# ---------------------------------------------------------------------------------------------------- wrk


def test_parse_wrk_reads_rate_percentiles_and_counts():
    r = parse_wrk(WRK_OK)
    assert (r["requests"], r["seconds"], r["requests_per_s"]) == (941, 3.05, 308.43)
    assert r["ok_per_s"] == pytest.approx(941 / 3.05)
    assert (r["p50_ms"], r["p75_ms"], r["p90_ms"], r["p99_ms"]) == (24.96, 30.02, 35.46, 50.14)
    assert (r["non_2xx"], r["socket_errors"]) == (0, {})


def test_parse_wrk_counts_only_2xx_as_served():
    r = parse_wrk(WRK_NOT_FOUND)
    assert r["non_2xx"] == 9247 and r["ok_per_s"] == 0.0 and r["requests_per_s"] == 4586.49
    assert r["p50_ms"] == 1.18


def test_parse_wrk_reads_microseconds_and_socket_errors():
    r = parse_wrk(WRK_SOCKET_ERRORS)
    assert r["p50_ms"] == pytest.approx(0.067) and r["p99_ms"] == pytest.approx(2.12)
    assert r["socket_errors"] == {"connect": 0, "read": 21056, "write": 0, "timeout": 0}
    assert r["non_2xx"] == 21056


def test_parse_wrk_reads_minutes_and_refuses_what_is_not_a_report():
    assert parse_wrk(WRK_OK.replace("in 3.05s", "in 1.50m"))["seconds"] == 90.0
    with pytest.raises(ValueError, match="not a wrk report"):
        parse_wrk("unable to connect to 127.0.0.1:1 Connection refused\n")


def test_wrk_command_and_script(tmp_path, png, pixels):
    request = peer_request("triton", "oip-binary", png, pixels, "")
    script = write_script(tmp_path, "triton-oip-binary", request)
    assert (tmp_path / "triton-oip-binary.body").read_bytes() == request.body
    text = script.read_text()
    assert f'io.open("{(tmp_path / "triton-oip-binary.body").resolve()}", "rb")' in text
    assert 'wrk.method = "POST"' in text and 'wrk.body = f:read("*a")' in text
    assert f'wrk.headers["{HEADER_LENGTH}"] = "{request.headers[HEADER_LENGTH]}"' in text
    timed = script.with_suffix(".times.lua").read_text()
    assert timed.startswith(text) and "clock_gettime(CLOCK_MONOTONIC" in timed and 'string.format("answered at' in timed
    assert [threads_for(c) for c in (1, 8, 32, 64)] == [1, 2, 2, 2]
    assert wrk_argv("wrk", "http://h:1/p", 32, 5, 60, script) == [
        "wrk", "-t", "2", "-c", "32", "-d", "5s", "--timeout", "60s", "--latency", "-s", str(script), "http://h:1/p"]


def test_the_status_counting_script_and_its_output(tmp_path, png, pixels):
    script = write_script(tmp_path, "vitserve-image", peer_request("vitserve", "image", png, pixels, ""))
    counting = script.with_suffix(".status.lua").read_text()
    assert counting.startswith(script.read_text()) and "function response(status, headers, body)" in counting
    # printed by that script after `wrk -c64 -d5s` against vitserve shedding load
    output = "Requests/sec:    260.82\nTransfer/sec:    197.13KB\nstatus 429: 438\nstatus 200: 877\n"
    assert parse_statuses(output) == {"200": 877, "429": 438}
    assert parse_statuses(WRK_OK) == {}


def test_answer_times_are_taken_out_of_wrk_s_report_and_give_the_batches_rate():
    times, report = take_answer_times(WRK_ANSWER_TIMES)
    assert len(times) == 16 and times == sorted(times) and "answered at" not in report
    assert parse_wrk(report)["ok_per_s"] == pytest.approx(16 / 1.10)  # the window: the last batch's time lost
    assert steady_rate(times, 0.005) == pytest.approx(12 / (71543.691301 - 71542.938185))
    assert steady_rate(times, 0.005) == pytest.approx(16.0, rel=0.01)  # four answers every 250 ms


def test_steady_rate_counts_whole_batches_however_a_window_cuts_them():
    # batches of 16 every 0.86 s (a compute-bound model at 32 clients), each batch's answers 0.3 ms apart
    batches = [start * 0.86 + i * 3e-4 for start in range(1, 18) for i in range(16)]
    assert steady_rate(batches, 0.005) == pytest.approx(16 / 0.86, rel=1e-3)
    assert len(batches) / 15 < 0.98 * 16 / 0.86  # what a 15 s window counts: 17 batches, not 17.4
    one_at_a_time = [0.066 * i for i in range(200)]  # one client: each answer a batch of one
    assert steady_rate(one_at_a_time, 0.005) == pytest.approx(1 / 0.066)
    assert steady_rate([1.0, 1.001, 1.002], 0.005) is None  # one batch: no interval to measure
    assert steady_rate([], 0.005) is None


def test_lua_strings_are_escaped():
    from vitserve.bench.peers.bodies import PeerRequest

    text = lua_script(Path('/tmp/a "b"\\c.body'), PeerRequest("/", b"", {"X-Quote": 'say "hi"'}))
    assert r'io.open("/tmp/a \"b\"\\c.body", "rb")' in text
    assert r'wrk.headers["X-Quote"] = "say \"hi\""' in text


# ---------------------------------------------------------------------------------------------------- rounds, medians


def test_rounds_alternate_the_servers_order():
    order = [s for _, s in alternated(["vitserve", "triton", "litserve"], 3)]
    assert order == ["vitserve", "triton", "litserve", "litserve", "triton", "vitserve",
                     "vitserve", "triton", "litserve"]


def _row(server: str, round_: int, ok: float, p50: float, non_2xx: int = 0, path: str = "image",
         connections: int = 8, cpu_ms: float | None = None) -> dict:
    row = {"server": server, "round": round_, "path": path, "connections": connections, "ok_per_s": ok,
           "p50_ms": p50, "p99_ms": 2 * p50, "non_2xx": non_2xx, "socket_errors": {"read": 0, "timeout": 1},
           "load1_before": 0.4}
    return row if cpu_ms is None else {**row, "server_cpu_ms_per_answer": cpu_ms}


def test_summarise_takes_medians_over_rounds_and_the_ratio_of_medians():
    rows = [_row("vitserve", 1, 300, 3), _row("vitserve", 2, 330, 4), _row("vitserve", 3, 310, 9, non_2xx=2),
            _row("triton", 1, 100, 10), _row("triton", 2, 200, 20),
            {"server": "triton", "round": 3, "path": "image", "connections": 8, "skipped": "time limit"},
            _row("litserve", 1, 50, 1)]
    (entry,) = summarise(rows, ["vitserve", "triton", "litserve"], ["image"], [8])
    assert entry["vitserve"] == {"ok_per_s": 310, "p50_ms": 4, "p99_ms": 8, "cpu_ms": None, "rounds": 3,
                                 "non_2xx": 2, "socket_errors": 3}
    assert entry["triton"]["ok_per_s"] == 150 and entry["triton"]["rounds"] == 2  # the skipped round left out
    assert entry["vitserve_over_triton"] == pytest.approx(310 / 150)
    assert entry["litserve"]["ok_per_s"] == 50


def test_each_rounds_ratio_stands_beside_the_ratio_of_the_medians():
    """The servers take turns within a round: the ratio in each round shows what the machine's drift did to it."""
    rows = [_row("vitserve", 1, 600, 3), _row("triton", 1, 400, 4), _row("triton", 2, 500, 4),
            _row("vitserve", 2, 450, 3), _row("vitserve", 3, 500, 3),
            {"server": "triton", "round": 3, "path": "image", "connections": 8, "skipped": "time limit"}]
    (entry,) = summarise(rows, ["vitserve", "triton"], ["image"], [8])
    assert entry["vitserve_over_triton"] == pytest.approx(500 / 450)
    by_round = ratios_by_round(rows, "vitserve", "triton", "image", 8)
    assert by_round == pytest.approx([1.5, 0.9])  # round 3: Triton did not run
    report = _fake_report()
    report["settings"]["servers"] = ["vitserve", "triton"]
    report["models"][0].update(rounds=rows, summary=[entry])
    text = render(report)
    assert "| image | 8 | 500 (3.0 / 6.0) | 450 (4.0 / 8.0) | 1.11 (1.50, 0.90) |" in text
    assert "in brackets, the same ratio in each round" in text
    assert "in brackets" not in render(_fake_report())  # one round each: nothing to show


def test_cpu_per_answer_is_a_median_over_rounds_in_its_own_table_and_absent_from_older_reports():
    rows = [_row("vitserve", 1, 300, 3, cpu_ms=2.9), _row("vitserve", 2, 330, 4, cpu_ms=2.7),
            _row("vitserve", 3, 310, 9, cpu_ms=3.5), _row("triton", 1, 100, 10, cpu_ms=2.0),
            _row("triton", 2, 200, 20, cpu_ms=2.2)]
    (entry,) = summarise(rows, ["vitserve", "triton"], ["image"], [8])
    assert entry["vitserve"]["cpu_ms"] == 2.9 and entry["triton"]["cpu_ms"] == pytest.approx(2.1)
    report = _fake_report()
    report["settings"]["servers"] = ["vitserve", "triton"]
    report["models"][0].update(rounds=rows, summary=[entry])
    text = render(report)
    assert "CPU time per answer, ms" in text and "| image | 8 | 2.900 | 2.100 |" in text
    assert "| vit-fmnist | 3 | vitserve | image | 8 | 310.0 | 9.00 | 18.00 | 3.500 | 0 |" in text
    assert "CPU time per answer, ms" not in render(_fake_report())  # rounds measured before it was


def test_a_compute_bound_model_is_served_as_a_share_of_the_session_measured_in_the_same_round():
    """Each round's req/s over that round's session alone (its best batch size), then the median: a machine that
    drifts between rounds moves the session and the server together."""
    rows = [_row("vitserve", 1, 15.0, 500), _row("vitserve", 2, 12.0, 600), _row("vitserve", 3, 14.0, 550),
            _row("triton", 1, 12.0, 600), _row("triton", 2, 9.0, 700),
            {"server": "triton", "round": 3, "path": "image", "connections": 8, "skipped": "time limit"}]
    alone = [{"round": 1, "raw": [{"batch_size": 1, "images_per_s": 15.5, "p50_ms": 64.0},
                                  {"batch_size": 8, "images_per_s": 16.0, "p50_ms": 500.0}]},
             {"round": 2, "raw": [{"batch_size": 1, "images_per_s": 12.0, "p50_ms": 83.0},
                                  {"batch_size": 8, "images_per_s": 11.0, "p50_ms": 720.0}]},
             {"round": 3, "raw": [{"batch_size": 1, "images_per_s": 20.0, "p50_ms": 50.0}]}]
    report = _fake_report()
    report["settings"]["servers"] = ["vitserve", "triton"]
    report["models"][0].update(rounds=rows, summary=summarise(rows, ["vitserve", "triton"], ["image"], [8]),
                               session_alone_rounds=alone)
    entry = report["models"][0]
    assert served_of_alone(entry, "vitserve", "image", 8) == pytest.approx(15 / 16)  # of 15/16, 12/12, 14/20
    assert served_of_alone(entry, "triton", "image", 8) == pytest.approx((12 / 16 + 9 / 12) / 2)
    assert served_of_alone(entry, "triton", "image", 32) is None
    text = render(report)
    assert "| image | 8 | 0.94 | 0.75 |" in text
    assert "round 1 15.5 at 1, 16.0 at 8; round 2 12.0 at 1, 11.0 at 8; round 3 20.0 at 1" in text
    assert "share of the session alone" not in render(_fake_report())  # an HTTP-bound model: no session turns


def test_the_share_of_the_session_counts_from_the_first_answer_to_the_last_where_the_run_timed_them():
    """A run that timed its answers (`steady_ok_per_s`) is judged by that, wrk's window beside it in brackets."""
    rows = [{**_row("vitserve", 1, 15.0, 500), "steady_ok_per_s": 15.5},
            {**_row("vitserve", 2, 12.0, 600), "steady_ok_per_s": 12.4},
            {**_row("triton", 1, 12.0, 600), "steady_ok_per_s": None}, _row("triton", 2, 9.0, 700)]
    alone = [{"round": 1, "raw": [{"batch_size": 8, "images_per_s": 16.0, "p50_ms": 500.0}]},
             {"round": 2, "raw": [{"batch_size": 8, "images_per_s": 12.0, "p50_ms": 720.0}]}]
    report = _fake_report()
    report["settings"]["servers"] = ["vitserve", "triton"]
    report["models"][0].update(rounds=rows, summary=summarise(rows, ["vitserve", "triton"], ["image"], [8]),
                               session_alone_rounds=alone)
    entry = report["models"][0]
    steady = served_of_alone(entry, "vitserve", "image", 8, "steady_ok_per_s")
    assert steady == pytest.approx((15.5 / 16 + 12.4 / 12) / 2)
    assert served_of_alone(entry, "vitserve", "image", 8) == pytest.approx((15 / 16 + 1.0) / 2)
    assert served_of_alone(entry, "triton", "image", 8, "steady_ok_per_s") is None  # never timed: wrk's alone
    assert f"| image | 8 | {steady:.2f} (0.97) | 0.75 |" in render(report)


def test_the_session_alone_takes_a_turn_in_each_rounds_alternating_order(monkeypatch, tmp_path):
    from vitserve.bench.peers import run
    from vitserve.bench.run import Budget

    order = []

    class NoServer:  # each start fails at once: its rows say so, and the round goes on
        def __init__(self, spec, log, timeout_s):
            self.spec = spec

        def start(self):
            order.append(self.spec)
            raise RuntimeError("not in this test")

    monkeypatch.setattr(run, "RunningServer", NoServer)
    cfg = PeersConfig(servers=["vitserve", "triton"], rounds=2, work_dir=tmp_path, log_dir=tmp_path)

    def session() -> list[dict]:
        order.append("session")
        return [{"batch_size": 1, "images_per_s": 10.0 + len(order), "p50_ms": 100.0}]

    m = run.ModelUnderTest(tmp_path / "m.onnx", b"", np.zeros((1, 1, 4, 4), np.float32), np.zeros(2), [1, 1],
                           ("image",), [1], 1, tmp_path)
    rows, _, _, alone = run.run_rounds(cfg, m, "wrk", lambda server: server, Budget(3600), session)
    assert order == ["vitserve", "triton", "session", "session", "triton", "vitserve"]
    assert [a["round"] for a in alone] == [1, 2] and alone[1]["raw"][0]["images_per_s"] == 14.0
    assert [(r["round"], r["server"]) for r in rows] == [(1, "vitserve"), (1, "triton"), (2, "triton"),
                                                         (2, "vitserve")]
    _, _, _, none = run.run_rounds(cfg, m, "wrk", lambda server: server, Budget(0.0), session)
    assert none == [] and order.count("session") == 2  # past the time limit the session waits its turn out too


def test_cpu_seconds_counts_every_process_under_the_server(tmp_path):
    """The parent sleeps; its child burns CPU: the server's time is the child's."""
    import subprocess
    import sys
    import time

    from vitserve.bench.peers.servers import RunningServer, ServerSpec

    burn = "import time; end = time.process_time() + 0.4\nwhile time.process_time() < end: pass\ntime.sleep(60)"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {burn!r}]); time.sleep(60)"
    server = RunningServer(ServerSpec("tree", [], [], []), tmp_path / "tree.log", startup_timeout_s=1)
    server.proc = subprocess.Popen([sys.executable, "-c", parent], start_new_session=True)
    try:
        give_up = time.monotonic() + 60
        while server.cpu_seconds() < 0.4 and time.monotonic() < give_up:
            time.sleep(0.05)
        import psutil
        own = psutil.Process(server.proc.pid).cpu_times()
        assert server.cpu_seconds() >= 0.4 > own.user + own.system
    finally:
        server.stop()


def test_summarise_leaves_out_levels_nobody_ran_and_has_no_ratio_without_triton():
    rows = [_row("litserve", 1, 50, 1)]
    out = summarise(rows, ["vitserve", "litserve"], ["image", "oip-json"], [1, 8])
    assert [(e["path"], e["connections"]) for e in out] == [("image", 8)]
    assert out[0]["vitserve_over_triton"] is None


# ---------------------------------------------------------------------------------------------------- answers


def test_compare_logits_within_tolerance_and_the_same_top_class():
    logits = np.array([0.1, 2.0, -1.0], np.float32)
    assert compare({"logits": logits + TOLERANCE / 2, "grid": [7, 7]}, logits, [7, 7])["ok"]
    assert not compare({"logits": logits + 3 * TOLERANCE, "grid": [7, 7]}, logits, [7, 7])["ok"]
    assert not compare({"logits": logits, "grid": [14, 14]}, logits, [7, 7])["ok"]


def test_compare_top_scores_against_the_softmax_of_the_reference():
    logits = np.array([0.1, 2.0, -1.0, 0.5], np.float32)
    probabilities = softmax(logits)
    right = {"indices": np.array([1, 3, 0]), "scores": probabilities[[1, 3, 0]], "grid": [2, 2]}
    result = compare(right, logits, [2, 2])
    assert result["ok"] and result["top1"] == 1 and result["max_abs_diff"] < 1e-12
    wrong_order = {**right, "indices": np.array([3, 1, 0]), "scores": probabilities[[3, 1, 0]]}
    assert not compare(wrong_order, logits, [2, 2])["ok"]
    # vitserve's calibrated scores are softmax(logits / T): right for the file's temperature, wrong for another
    calibrated = {**right, "scores": softmax(logits / 0.7)[[1, 3, 0]]}
    assert not compare(calibrated, logits, [2, 2])["ok"] and compare(calibrated, logits, [2, 2], 0.7)["ok"]


def test_answer_values_reads_each_servers_answer():
    classify = {"predictions": [{"index": 4, "label": "x", "score": 0.5}, {"index": 1, "label": "y", "score": 0.2}],
                "rollout": {"height": 7, "width": 5, "values": []}}
    v = answer_values("litserve", "image", json.dumps(classify).encode(), None)
    assert v["indices"].tolist() == [4, 1] and v["grid"] == [7, 5]
    triton = {"outputs": [{"name": "top_index", "datatype": "INT64", "shape": [1, 2], "data": [4, 1]},
                          {"name": "top_score", "datatype": "FP32", "shape": [1, 2], "data": [0.5, 0.2]},
                          {"name": "rollout", "datatype": "FP32", "shape": [1, 2, 3], "data": [0.0] * 6}]}
    v = answer_values("triton", "image", json.dumps(triton).encode(), None)
    assert v["indices"].dtype.kind == "i" and v["indices"].tolist() == [4, 1] and v["grid"] == [2, 3]
    logits = np.arange(3, dtype=np.float32)
    body, headers = join_body({"outputs": [
        {"name": "logits", "datatype": "FP32", "shape": [1, 3], "parameters": {"binary_data_size": 12}},
        {"name": "rollout", "datatype": "FP32", "shape": [1, 1, 2], "parameters": {"binary_data_size": 8}}]},
        [logits.tobytes(), np.zeros(2, np.float32).tobytes()])
    v = answer_values("vitserve", "oip-binary", body, headers[HEADER_LENGTH])
    np.testing.assert_array_equal(v["logits"], logits)
    assert v["grid"] == [1, 2]


# ---------------------------------------------------------------------------------------------------- the peers' work


def test_limits_and_session_options_are_vitserves_defaults():
    from vitserve.service.engine.onnx_runtime import session_options as vitserve_options
    from vitserve.service.ground.settings import Settings

    s = Settings()
    assert LIMITS == {"max_bytes": s.max_upload_bytes, "max_pixels": s.max_image_pixels,
                      "max_tokens": s.max_native_tokens}
    mine, theirs = session_options(), vitserve_options(s)
    for name in ("graph_optimization_level", "intra_op_num_threads", "inter_op_num_threads", "execution_mode"):
        assert getattr(mine, name) == getattr(theirs, name), name
    key = "session.intra_op.allow_spinning"
    assert mine.get_session_config_entry(key) == theirs.get_session_config_entry(key)


def test_the_peers_work_is_vitserves_preprocessing_session_and_answer(tiny_onnx):
    from vitserve.bench.raw import preprocessed
    from vitserve.service.usecases.postprocess import encode_result
    from vitserve.service.engine.onnx_runtime import OnnxModel
    from vitserve.service.ground.settings import Settings

    vitserve = OnnxModel.load(Settings(model_path=tiny_onnx))
    peer = ImageClassifier(tiny_onnx)
    info = peer.info
    images = make_images("png", tuple(info.image_size), info.channels, count=2, seed=3)
    pixels = np.stack([peer.prepare(data) for data in images])  # (2, C, H, W)
    np.testing.assert_array_equal(pixels, preprocessed(vitserve, images))
    logits, rollout = peer.run(pixels)
    np.testing.assert_allclose(logits, vitserve.run(pixels)[0], atol=1e-5)
    answer = peer.answer(logits[0], rollout[0])
    predictions, grid = encode_result(info.labels, None, logits[0], rollout[0], k=5, rollout_format="grid")
    assert answer["predictions"] == [p.model_dump() for p in predictions]
    assert answer["rollout"] == grid.model_dump()


def test_the_peer_on_openvino_runs_the_files_fast_graph_as_vitserves_openvino_runtime_does(tiny_onnx):
    pytest.importorskip("openvino")
    from vitserve.service.engine.runtime import load_model
    from vitserve.service.ground.settings import Settings

    onnxruntime_peer, openvino_peer = ImageClassifier(tiny_onnx), ImageClassifier(tiny_onnx, openvino_precision="fp32")
    vitserve = load_model(Settings(model_path=tiny_onnx, runtime="openvino", precision_hint="fp32"))
    x = np.random.default_rng(4).standard_normal((3, 3, 32, 32)).astype(np.float32)
    logits, rollout = openvino_peer.run(x)
    np.testing.assert_array_equal(logits, vitserve.run(x)[0])
    np.testing.assert_array_equal(rollout, vitserve.run(x)[1])
    np.testing.assert_allclose(logits, onnxruntime_peer.run(x)[0], atol=1e-4)


def test_the_peers_work_imports_nothing_their_venvs_lack():
    """Triton's venv holds numpy, Pillow, onnxruntime, onnx, openvino (and pydantic, through pytriton) but not
    vitserve's web stack: the per-image work and the OpenVINO compile it runs import without pydantic-settings,
    FastAPI, Starlette, uvicorn, prometheus-client or httpx (the server's settings are annotations there only)."""
    blocked = ["pydantic_settings", "fastapi", "starlette", "uvicorn", "prometheus_client", "httpx"]
    code = (f"import sys\nfor name in {blocked!r}:\n    sys.modules[name] = None\n"
            "import vitserve.bench.peers.image_classifier\n"
            "from vitserve.service.engine.graph_paths import split_paths\n"
            "from vitserve.service.engine.openvino_runtime import OpenVinoModel\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def test_peer_venvs_are_pinned_and_hold_no_torch():
    for peer, requirements in REQUIREMENTS.items():
        assert all("==" in r for r in requirements), peer
        assert not any(r.startswith(("torch", "torchvision")) for r in requirements), peer
        assert {r.split("==")[0] for r in requirements} >= {"numpy", "pillow", "onnxruntime"}


# ---------------------------------------------------------------------------------------------------- flags, report


def test_flags_onto_the_config():
    args = build_parser().parse_args(["--models", "a.onnx,vit-s16", "--servers", "vitserve,triton", "--rounds", "2",
                                      "--concurrency", "1,64", "--duration", "3"])
    cfg = config_from(vars(args), args.quick)
    assert (cfg.models, cfg.servers, cfg.rounds, cfg.concurrency, cfg.duration_s) == (
        ["a.onnx", "vit-s16"], ["vitserve", "triton"], 2, [1, 64], 3)
    assert cfg.warmup_s == PeersConfig().warmup_s
    quick = config_from({"rounds": 2}, quick=True)
    assert quick.rounds == 2 and quick.concurrency == QUICK["concurrency"] and quick.models == QUICK["models"]
    with pytest.raises(SystemExit, match="unknown servers"):
        config_from({"servers": ["vllm"]}, quick=False)


def test_vitserve_bench_mode_peers_takes_the_shared_flags_and_refuses_the_others():
    from vitserve.cli import build_parser as vitserve_parser

    args = vitserve_parser().parse_args(["bench", "--mode", "peers", "--model", "vit-s16", "--duration", "2.4",
                                         "--rounds", "2", "--out", "x.md"])
    cfg = config_from_bench_args(args)
    assert (cfg.models, cfg.duration_s, cfg.rounds, cfg.out) == (["vit-s16"], 2, 2, Path("x.md"))
    with pytest.raises(SystemExit, match="does not use pairs"):
        config_from_bench_args(vitserve_parser().parse_args(["bench", "--mode", "peers", "--pairs", "3"]))


def _fake_report() -> dict:
    rows = [_row("vitserve", 1, 400.0, 2.5), _row("triton", 1, 320.0, 3.0), _row("litserve", 1, 250.0, 4.0, 3)]
    servers = ["vitserve", "triton", "litserve"]
    model = {"name": "vit-fmnist", "version": "1", "path": "m.onnx", "height": 28, "width": 28, "channels": 1,
             "patch_size": 4, "size_mb": 3.1, "compute_bound": False}
    right = {"ok": True, "status": 200, "top1": 8, "max_abs_diff": 1e-6, "grid": [7, 7]}
    checks = {"vitserve": {"image": [{"round": 1, **right}]},
              "triton": {"image": [{"round": 1, "ok": False, "status": 503, "error": "not ready"},
                                   {"round": 2, **right}]}}
    rows[2]["status_sample"] = {"200": 40, "429": 7}
    return {"command": "python -m vitserve.bench.peers", "settings": {**PeersConfig().__dict__, "servers": servers},
            "environment": {"date": "2026-01-01 00:00 UTC", "cpu": "AMD EPYC", "cpus": 2, "python": "3.11.7",
                            "onnxruntime": "1.32.0", "wrk": "wrk 4.1.0", "commit": "abc", "uncommitted_files": 0,
                            "loadavg_start": "0.5 / 0.5 / 0.5", "loadavg_end": "1.0 / 1.0 / 1.0",
                            "waited_for_quiet_s": 0, "triton_version": "2.51.0",
                            "peer_versions": {"triton": {"nvidia-pytriton": "0.7.0", "python": "3.11.7",
                                                         "numpy": "1.26.4", "onnxruntime": "1.32.0"},
                                              "litserve": {"litserve": "0.2.19", "fastapi": "0.165.0",
                                                           "uvicorn": "0.54.0", "python": "3.11.7",
                                                           "numpy": "2.4.6", "onnxruntime": "1.32.0"}}},
            "models": [{"model": model, "raw": [{"batch_size": 1, "p50_ms": 1.7, "images_per_s": 575.0},
                                                {"batch_size": 16, "p50_ms": 14.0, "images_per_s": 1131.0}],
                        "paths": ["image"], "concurrency": [8], "checks": checks,
                        "servers": {"vitserve": {"argv": ["vitserve", "serve"], "env": {}}},
                        "request_bytes": {"vitserve": {"image": 751}, "triton": {"image": 928},
                                          "litserve": {"image": 903}},
                        "rounds": rows, "summary": summarise(rows, servers, ["image"], [8])}]}


def test_report_has_a_table_per_model_with_the_ratio_and_the_facts():
    text = render(_fake_report())
    assert "| image | 8 | 400 (2.5 / 5.0) | 320 (3.0 / 6.0) | 250 (4.0 / 8.0) | 1.25 |" in text
    assert "## vit-fmnist (28x28), HTTP-bound" in text
    assert "Triton Inference Server** 2.51.0" in text and "LitServe** 0.2.19" in text
    assert "LitServe image at 8: 3 non-2xx, 1 socket errors" in text
    assert "- vitserve: image right in 1 of 1 round(s) (top-1 8, max abs diff 1.0e-06)" in text
    assert ("- Triton: image right in 1 of 2 round(s) (top-1 8, max abs diff 1.0e-06); round 1 **failed** (503: "
            "not ready)") in text
    assert "had some: LitServe 429 x7." in text
    assert "| vit-fmnist (28x28) | 1.70 | 575.0 | 1131.0 | 1131.0 |" in text
    assert "before 0.5 / 0.5 / 0.5" in text and "after 1.0 / 1.0 / 1.0" in text
    assert "`make bench-peers`" in text


@pytest.mark.slow
def test_export_commit_writes_that_commits_tree_once(tmp_path):
    from vitserve.bench.peers.servers import export_commit

    source, sha = export_commit("HEAD", tmp_path)
    assert len(sha) == 40 and source == tmp_path / f"vitserve-{sha[:12]}"
    assert (source / "vitserve" / "__init__.py").is_file() and (source / "bench" / "peers" / "servers.py").is_file()
    (source / "marker").write_text("kept")
    assert export_commit("HEAD", tmp_path) == (source, sha) and (source / "marker").is_file()  # not exported again


def test_a_server_that_exits_before_it_is_ready_is_reported_with_its_log(tmp_path):
    import sys

    from vitserve.bench.peers.servers import RunningServer, ServerSpec
    from vitserve.bench.servers import free_port

    spec = ServerSpec("broken", [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"], [free_port()],
                      ["/"])
    server = RunningServer(spec, tmp_path / "broken.log", startup_timeout_s=30)
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*no model here"):
        server.start()
    assert server.proc is None  # stopped: nothing left running


def test_render_writes_the_markdown_again_from_a_runs_json(tmp_path):
    from vitserve.bench.peers.cli import main

    data = tmp_path / "peers.json"
    data.write_text(json.dumps(_fake_report(), default=str))
    out = tmp_path / "peers.md"
    assert main(["--render", str(data), "--out", str(out)]) == 0
    assert out.read_text() == render(json.loads(data.read_text()))
    assert "| image | 8 | 400 (2.5 / 5.0) |" in out.read_text()


def test_vitserve_on_ray_is_a_server_on_request_with_vitserves_requests(tmp_path, png, pixels):
    from vitserve.bench.peers.config import family
    from vitserve.bench.peers.run import request_for_size
    from vitserve.bench.peers.servers import vitserve_spec
    spec = vitserve_spec(tmp_path / "m.onnx", ray_replicas=2)
    assert spec.name == "vitserve-ray2" and spec.argv[-3:] == ["--ray", "--ray-replicas", "2"]
    assert vitserve_spec(tmp_path / "m.onnx").name == "vitserve" and "--ray" not in vitserve_spec(tmp_path).argv
    assert config_from({"servers": ["vitserve-ray1", "vitserve-ray2"]}, False).servers == ["vitserve-ray1",
                                                                                        "vitserve-ray2"]
    assert PeersConfig().servers == ["vitserve", "triton", "litserve"]  # Ray only when asked for
    assert family("vitserve-ray1") == "vitserve" and family("triton") == "triton"
    assert SERVED_PATHS["vitserve-ray2"] == SERVED_PATHS["vitserve"]

    class Model:
        pass
    m = Model()
    m.png, m.pixels = png, pixels
    assert request_for_size("vitserve-ray1", "image", m) == request_for_size("vitserve", "image", m)


def test_vitserve_on_another_runtime_is_a_server_on_request_with_vitserves_requests(tmp_path, png, pixels):
    from vitserve.bench.peers.config import family
    from vitserve.bench.peers.report import LABELS
    from vitserve.bench.peers.run import server_spec
    spec = server_spec("vitserve-openvino", tmp_path / "m.onnx", {}, None)
    assert spec.name == "vitserve-openvino" and spec.env["VITSERVE_RUNTIME"] == "openvino"
    assert "VITSERVE_RUNTIME" not in server_spec("vitserve", tmp_path / "m.onnx", {}, None).env
    assert config_from({"servers": ["vitserve", "vitserve-openvino"]}, False).servers == ["vitserve",
                                                                                        "vitserve-openvino"]
    assert family("vitserve-openvino") == "vitserve" and SERVED_PATHS["vitserve-openvino"] == SERVED_PATHS["vitserve"]
    assert LABELS["vitserve-openvino"] == "vitserve on OpenVINO"
    assert set(KNOWN_SERVERS) <= set(LABELS)  # every arm the command takes has its name in the report
    bf16 = server_spec("vitserve-bf16", tmp_path / "m.onnx", {}, None)
    assert bf16.name == "vitserve-bf16"
    assert (bf16.env["VITSERVE_RUNTIME"], bf16.env["VITSERVE_PRECISION_HINT"]) == ("openvino", "bf16")


def test_the_fastapi_app_is_a_server_on_request_in_vitserves_environment(tmp_path, png, pixels):
    from vitserve.bench.peers.config import family
    from vitserve.bench.peers.run import server_spec
    spec = server_spec("fastapi", tmp_path / "m.onnx", {"fastapi": Path(sys.executable)}, None)
    assert spec.name == "fastapi" and spec.argv[0] == sys.executable and spec.ready_paths == ["/ready"]
    assert spec.argv[1:4] == ["-m", "uvicorn", "vitserve.bench.peers.fastapi_app:app"]
    assert spec.env == {"MODEL_PATH": str((tmp_path / "m.onnx").resolve())}
    assert family("fastapi") == "fastapi" and SERVED_PATHS["fastapi"] == ("image",)
    request = peer_request("fastapi", "image", png, pixels, "")
    assert request.target == "/classify" and request.body == multipart_image(png)[0]
    with pytest.raises(ValueError):
        peer_request("fastapi", "oip-json", png, pixels, "")
    assert "fastapi" not in config_from({}, False).servers  # on request only


def test_triton_on_openvino_is_tritons_requests_at_a_precision(tmp_path):
    from vitserve.bench.peers.config import family
    from vitserve.bench.peers.run import server_spec
    import sys
    python = Path(sys.executable)  # its library directory is asked of it
    spec = server_spec("triton-bf16", tmp_path / "m.onnx", {"triton": python}, None)
    assert spec.name == "triton-bf16" and spec.argv[0] == str(python)
    assert spec.argv[spec.argv.index("--openvino-precision") + 1] == "bf16"
    assert "--openvino-precision" not in server_spec("triton", tmp_path / "m.onnx", {"triton": python}, None).argv
    assert family("triton-bf16") == "triton" and SERVED_PATHS["triton-bf16"] == SERVED_PATHS["triton"]


def test_the_ratios_pair_servers_of_one_runtime_and_precision():
    rows = [_row("vitserve-bf16", 1, 300, 3), _row("triton-bf16", 1, 200, 5), _row("vitserve-onnxruntime", 1, 100, 9)]
    (entry,) = summarise(rows, ["vitserve-bf16", "triton-bf16", "vitserve-onnxruntime"], ["image"], [8])
    assert entry["vitserve_bf16_over_triton_bf16"] == pytest.approx(1.5)
    assert entry["vitserve_bf16_over_vitserve_onnxruntime"] == pytest.approx(3.0)
    assert entry["vitserve_over_triton"] is None  # neither ran
    report = _fake_report()
    report["settings"]["servers"] = ["vitserve-bf16", "triton-bf16", "vitserve-onnxruntime"]
    report["models"][0].update(rounds=rows, summary=[entry])
    text = render(report)
    assert "vitserve on OpenVINO bf16 / Triton on OpenVINO bf16" in text and "| 1.50 | 3.00 |" in text


def test_a_bf16_answer_is_checked_within_bfloat16s_tolerance(pixels):
    from vitserve.bench.peers.answers import BF16_TOLERANCE, scale

    logits = np.array([4.0, -2.0, 1.0])
    moved = {"logits": logits + 0.1, "grid": [2, 2]}  # 2.5% of the largest logit: bf16's rounding, not fp32's
    assert not compare(moved, logits, [2, 2])["ok"]
    assert compare(moved, logits, [2, 2], tolerance=BF16_TOLERANCE * scale(logits))["ok"]
    assert not compare({"logits": logits[::-1], "grid": [2, 2]}, logits, [2, 2],
                       tolerance=BF16_TOLERANCE * scale(logits))["ok"]  # another class is wrong at any precision


def test_vitserve_whose_auto_chose_bf16_is_checked_as_bf16(monkeypatch):
    from types import SimpleNamespace

    from vitserve.bench.peers import run

    cards = {"http://a": {"provider": "OpenVINO/CPU/bf16"}, "http://b": {"provider": "CPUExecutionProvider"}}
    monkeypatch.setattr(run, "_get_json", lambda url: cards[url.removesuffix("/v1/model")])
    assert run.computes_bf16("vitserve", SimpleNamespace(url="http://a"))
    assert not run.computes_bf16("vitserve", SimpleNamespace(url="http://b"))
    assert run.computes_bf16("triton-bf16", SimpleNamespace(url="http://b"))  # named so: no card to read
    assert not run.computes_bf16("triton", SimpleNamespace(url="http://b"))
