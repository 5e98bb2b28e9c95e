"""One tiny `vitserve bench` run end to end: real servers, every phase, the report (structure and sanity, no
timings)."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from vitserve.cli import main

pytestmark = pytest.mark.slow  # the whole benchmark, end to end


def test_bench_end_to_end_on_the_tiny_model(tiny_onnx, tmp_path, capsys):
    out = tmp_path / "docs" / "bench.md"
    args = ["bench", "--model", str(tiny_onnx), "--quick", "--out", str(out), "--concurrency", "1,4",
            "--duration", "0.5", "--warmup", "0.2", "--inputs", "png,jpeg", "--max-batch-size", "4",
            "--bare", "on", "--pairs", "3", "--set", "intra_op_threads=1", "--set", "preprocess_threads=1",
            "--set", "providers=cpu", "--set", "max_loop_lag_ms=60000", "--time-limit", "300",
            "--log-dir", str(tmp_path / "logs")]
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
        # the server's own histogram, exact to one batch of up to `largest` images at each of the window's edges
        largest = 4 if r["batching"] == "on" else 1
        torn = 2 * largest / r["batches"]
        assert r["batches"] > 0 and 1.0 - torn <= r["mean_batch_size"] <= largest + torn
        assert 0 < r["inference_busy"] <= 2  # up to max_batches_in_flight (2) batches are timed at once
    assert [(r["app"], r["input"], r["concurrency"]) for r in report["bare"]] == [("bare", "png", c) for c in (1, 4)]
    assert [(r["batching"], r["pairs"]) for r in report["paired"]] == [("on", 3), ("off", 3)]
    for r in report["paired"]:
        assert 0 < r["raw_p50_ms"] and 0 < r["served_p50_ms"]
        assert r["overhead_p10_ms"] <= r["overhead_p50_ms"] <= r["overhead_p90_ms"]
        assert report["targets"][f"one_client_latency_batching_{r['batching']}"]["overhead_ms"] == r["overhead_p50_ms"]
    assert set(report["targets"]) == {"saturation_batching_on", "saturation_batching_off",
                                      "one_client_latency_batching_on", "one_client_latency_batching_off",
                                      "served_vs_bare"}
    assert report["model"]["name"] == "tiny-vit" and report["settings"]["server_settings"]["providers"] == "cpu"
    assert report["settings"]["max_batch_size"] == 4 and report["settings"]["out"] == str(out)

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
