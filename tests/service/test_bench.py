"""`vitserve bench`: its parts with exact values, and one tiny end-to-end run (structure and sanity, no timings)."""
from __future__ import annotations

import asyncio
import io
import json
import math

import numpy as np
import pytest
from PIL import Image

from service import bench
from vitserve.cli import main


def test_make_images_are_distinct_and_shaped_per_kind():
    pngs = bench.make_images("png", (28, 20), channels=1, count=3)
    jpegs = bench.make_images("jpeg", (28, 20), channels=1, count=2)
    assert len(set(pngs)) == 3 and len(set(jpegs)) == 2
    with Image.open(io.BytesIO(pngs[0])) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "L", (20, 28))  # size is (height, width)
    with Image.open(io.BytesIO(jpegs[0])) as img:
        assert (img.format, img.mode, img.size) == ("JPEG", "RGB", (640, 480))
    assert bench.make_images("png", (8, 8), 3, 2, seed=5) == bench.make_images("png", (8, 8), 3, 2, seed=5)


def test_latency_summary_in_milliseconds():
    s = bench.latency_summary([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert s["p50_ms"] == pytest.approx(50.5) and s["p90_ms"] == pytest.approx(90.1)
    assert s["p99_ms"] == pytest.approx(99.01) and s["mean_ms"] == pytest.approx(50.5)
    assert all(math.isnan(v) for v in bench.latency_summary([]).values())


def test_bench_raw_cycles_samples_into_each_batch_and_counts_images():
    seen = []

    def run(batch):
        seen.append(batch[:, 0, 0, 0].tolist())

    samples = np.arange(3, dtype=np.float32).reshape(3, 1, 1, 1)
    rows = bench.bench_raw(run, samples, [1, 5], duration_s=0.0, min_calls=4)
    assert [(r["batch_size"], r["calls"]) for r in rows] == [(1, 4), (5, 4)]
    assert seen[0] == [0.0] and seen[5] == [0.0, 1.0, 2.0, 0.0, 1.0]  # 1 warm-up + 4 timed calls per size
    assert len(seen) == 10 and all(r["images_per_s"] > 0 for r in rows)


def test_encode_request_is_a_complete_http_message():
    assert bench.encode_request("POST", "/v1/classify", b"abc", "image/png") == (
        b"POST /v1/classify HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n"
        b"Content-Type: image/png\r\n\r\nabc")


def test_closed_loop_client_reads_fixed_length_and_chunked_answers():
    """A loopback server answering by Content-Length, then chunked, then 500: all parsed, errors counted."""
    answers = [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok",
               b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\nok\r\n0\r\n\r\n",
               b"HTTP/1.1 500 Oops\r\nContent-Length: 0\r\n\r\n"]
    received = []

    async def handle(reader, writer):
        for i in range(10**6):
            try:
                await reader.readuntil(b"\r\n\r\n")
                received.append(await reader.readexactly(4))
            except asyncio.IncompleteReadError:
                break
            writer.write(answers[i % 3])
            await writer.drain()
        writer.close()

    async def scenario():
        server = await asyncio.start_server(handle, bench.LOOPBACK, 0)
        port = server.sockets[0].getsockname()[1]
        conn = bench.HttpConnection(bench.LOOPBACK, port)
        request = bench.encode_request("POST", "/", b"body")
        got = [await conn.request(request) for _ in range(3)]
        await conn.close()
        result = await bench.closed_loop(bench.LOOPBACK, port, [request], concurrency=2, warmup_s=0.0,
                                         duration_s=0.3, timeout_s=5)
        server.close()
        return got, result

    got, result = asyncio.run(scenario())
    assert got == [(200, b"ok"), (200, b"ok"), (500, b"")]
    assert set(received) == {b"body"}
    assert result["concurrency"] == 2 and result["completed"] > 0 and result["errors"]["500"] > 0
    assert result["window_s"] >= 0.3
    assert result["requests_per_s"] == pytest.approx(result["completed"] / result["window_s"])


def _report(raw, served, bare=()):
    return {"raw": raw, "served": served, "bare": list(bare), "settings": {"max_batch_size": 16}}


def test_targets_are_the_issue_ratios():
    raw = [{"batch_size": 1, "images_per_s": 40.0, "p50_ms": 25.0, "session_cores": 2.0},
           {"batch_size": 16, "images_per_s": 50.0, "p50_ms": 320.0, "session_cores": 2.0}]
    row = dict(input="png", errors={}, server_cores=1.5)
    served = [{**row, "batching": "on", "concurrency": 1, "requests_per_s": 30.0, "p50_ms": 31.0},
              {**row, "batching": "on", "concurrency": 32, "requests_per_s": 45.0, "p50_ms": 700.0},
              {**row, "batching": "off", "concurrency": 1, "requests_per_s": 38.0, "p50_ms": 26.5},
              {**row, "batching": "off", "concurrency": 32, "requests_per_s": 36.0, "p50_ms": 880.0},
              {**row, "input": "jpeg", "batching": "on", "concurrency": 32, "requests_per_s": 99.0, "p50_ms": 1.0}]
    bare = [{**row, "app": "bare", "concurrency": 1, "requests_per_s": 60.0}]
    t = bench.targets(_report(raw, served, bare))
    assert t["saturation_batching_on"]["ratio"] == pytest.approx(45 / 50)
    assert t["saturation_batching_on"]["cpu_ratio"] == pytest.approx((45 / 1.5) / (50 / 2))
    assert t["saturation_batching_on"]["at_concurrency"] == 32  # JPEG rows are not compared with the raw PNGs
    assert t["saturation_batching_off"]["ratio"] == pytest.approx(38 / 40)
    assert t["one_client_latency_batching_on"]["overhead_ms"] == pytest.approx(6.0)
    assert t["one_client_latency_batching_off"]["overhead_ms"] == pytest.approx(1.5)
    assert [(r["batching"], r["ratio"]) for r in t["served_vs_bare"]] == [("on", 0.5), ("off", pytest.approx(38 / 60))]
    assert t["one_client_latency_batching_on"]["method"] == "p50s of separate phases"


def test_one_client_target_prefers_the_paired_measurement():
    raw = [{"batch_size": 1, "images_per_s": 10.0, "p50_ms": 99.0, "session_cores": 2.0}]
    served = [{"input": "png", "errors": {}, "server_cores": 2.0, "batching": "on", "concurrency": 1,
               "requests_per_s": 12.0, "p50_ms": 80.0}]
    paired = [{"batching": "on", "pairs": 30, "raw_p50_ms": 31.0, "served_p50_ms": 33.5, "overhead_p50_ms": 2.25}]
    t = bench.targets({**_report(raw, served), "paired": paired})
    assert t["one_client_latency_batching_on"] == {
        "served_p50_ms": 33.5, "raw_batch1_p50_ms": 31.0, "overhead_ms": 2.25,
        "method": "median of 30 paired differences", "target": "<= +3 ms"}


def test_resolve_model_takes_a_file_or_a_cached_preset(tmp_path):
    artifact = tmp_path / "m.onnx"
    artifact.write_bytes(b"x")
    assert bench.resolve_model(str(artifact), tmp_path) == artifact
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "vit-s16.onnx").write_bytes(b"x")
    assert bench.resolve_model("vit-s16", tmp_path / "cache") == tmp_path / "cache" / "vit-s16.onnx"
    with pytest.raises(SystemExit, match="no model file"):
        bench.resolve_model(str(tmp_path / "absent.onnx"), tmp_path)


def test_bench_end_to_end_on_the_tiny_model(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "docs" / "bench.md"
    args = ["bench", "--model", str(tiny_onnx), "--quick", "--out", str(out), "--concurrency", "1,4",
            "--duration", "0.5", "--warmup", "0.2", "--inputs", "png,jpeg", "--max-batch-size", "4",
            "--bare", "on", "--pairs", "3", "--set", "intra_op_threads=1", "--set", "preprocess_threads=1",
            "--set", "providers=cpu", "--time-limit", "300", "--log-dir", str(tmp_path / "logs")]
    assert main(args) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.with_suffix(".json").read_text())

    assert [r["batch_size"] for r in report["raw"]] == [1, 4, 8]  # --quick's 1 and 8, plus the max batch size
    assert all(r["images_per_s"] > 0 and r["calls"] >= 3 for r in report["raw"])
    keys = [(r["batching"], r["input"], r["concurrency"]) for r in report["served"]]
    assert keys == [(b, i, c) for b in ("on", "off") for i in ("png", "jpeg") for c in (1, 4)]
    for r in report["served"] + report["bare"]:
        assert r["errors"] == {} and r["completed"] > 0
        assert r["p50_ms"] <= r["p90_ms"] <= r["p99_ms"]
        assert r["server_cores"] > 0 and r["client_cores"] > 0
    for r in report["served"]:
        assert 1.0 <= r["mean_batch_size"] <= (4 if r["batching"] == "on" else 1)  # the server's own histogram
        assert 0 < r["inference_busy"] <= 2  # up to max_batches_in_flight (2) batches are timed at once
    assert [(r["app"], r["input"], r["concurrency"]) for r in report["bare"]] == [("bare", "png", 1), ("bare", "png", 4)]
    assert [(r["batching"], r["pairs"]) for r in report["paired"]] == [("on", 3), ("off", 3)]
    for r in report["paired"]:
        assert 0 < r["raw_p50_ms"] and 0 < r["served_p50_ms"]
        assert r["overhead_p10_ms"] <= r["overhead_p50_ms"] <= r["overhead_p90_ms"]
        assert report["targets"][f"one_client_latency_batching_{r['batching']}"]["overhead_ms"] == r["overhead_p50_ms"]
    assert set(report["targets"]) == {"saturation_batching_on", "saturation_batching_off",
                                      "one_client_latency_batching_on", "one_client_latency_batching_off",
                                      "served_vs_bare"}
    assert report["model"]["name"] == "tiny-vit" and report["settings"]["server_settings"]["providers"] == "cpu"

    markdown = out.read_text()
    for heading in ("## Targets (this run)", "## Raw ONNX Runtime session (no HTTP)", "## Served",
                    "## One client, paired with the raw session",
                    "## Bare FastAPI endpoint returning a constant (same uvicorn options)"):
        assert heading in markdown
    assert markdown.count("\n| png | on | ") == 2 and markdown.count("\n| jpeg | off | ") == 2
    assert "![latency vs throughput](bench.png)" in markdown
    with Image.open(out.with_suffix(".png")) as plot:
        assert plot.format == "PNG" and plot.size[0] > 400
    assert f"wrote {out}" in printed and "saturation batching on" in printed
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == [
        "bench-server-bare.log", "bench-server-batching-off.log", "bench-server-batching-on.log"]


def test_bench_without_matplotlib_still_writes_the_table(tmp_path, monkeypatch, capsys):
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    report = {"model": {"name": "m", "version": "1", "path": "m.onnx", "height": 8, "width": 8, "channels": 1,
                        "patch_size": 4, "precision": "fp32", "provider": "CPUExecutionProvider", "size_mb": 0.1},
              "environment": {"date": "today", "onnxruntime": "1", "python": "3", "cpu": "cpu", "cpus": 2,
                              "loadavg_start": "0", "loadavg_end": "0", "other_cores_mean": 0.0, "contended": False},
              "settings": {"max_batch_size": 4, "max_queue_delay_ms": 5.0, "server_settings": {}, "warmup_s": 1,
                           "duration_s": 1, "max_duration_factor": 3, "min_completed_per_client": 3,
                           "load_generator": "x"},
              "command": "vitserve bench", "raw": [], "served": [], "bare": [], "targets": {}}
    paths = bench.write_report(report, tmp_path / "bench.md")
    assert [p.name for p in paths] == ["bench.md", "bench.json"]
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert "![latency" not in (tmp_path / "bench.md").read_text()
