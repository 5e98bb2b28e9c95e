"""Head-of-line and soak: their requests, the pure summaries, and one short run of each on the tiny model (report
structure, every request accounted for; no timing asserted)."""
from __future__ import annotations

import io
import json

import pytest
from PIL import Image

from vitserve.bench.overload import HUNG_UP, Answer
from vitserve.bench.reliability import ReliabilityConfig, TreeSample
from vitserve.bench.soak import (big_png, multipart, oip_body, phases, render_head_of_line, render_soak, run_head_of_line,
                        run_soak, slope_per_minute, soak_summary)


def test_the_heavy_png_is_small_to_send_and_full_size_to_decode():
    data = big_png(1000)
    with Image.open(io.BytesIO(data)) as img:
        assert (img.format, img.mode, img.size) == ("PNG", "L", (1000, 1000))
    assert len(data) < 100_000


def test_the_open_inference_body_is_the_protocol_json_of_the_shape():
    body = json.loads(oip_body((2, 1, 4, 4)))
    (tensor,) = body["inputs"]
    assert (tensor["name"], tensor["shape"], tensor["datatype"], len(tensor["data"])) == \
        ("pixel_values", [2, 1, 4, 4], "FP32", 32)
    assert all(round(v, 3) == v for v in tensor["data"])


def test_multipart_carries_each_file_as_a_file_field():
    body, content_type = multipart([b"AAA", b"BB"])
    boundary = content_type.split("boundary=")[1]
    parts = body.split(f"--{boundary}".encode())
    assert content_type.startswith("multipart/form-data; ") and parts[-1] == b"--\r\n"
    assert [p.rsplit(b"\r\n\r\n", 1)[1] for p in parts[1:-1]] == [b"AAA\r\n", b"BB\r\n"]
    assert all(b'name="file"' in p for p in parts[1:-1])


def test_small_requests_are_split_by_when_the_heavy_ones_ran():
    heavy = [Answer("png", "200", 10.0, 2.0), Answer("oip", "200", 10.0, 3.5)]  # 10.0 .. 13.5
    small = [Answer("s", "200", t, 0.01 * (i + 1)) for i, t in enumerate([9.0, 9.9, 10.0, 12.0, 13.5, 14.0])]
    small.append(Answer("s", "429", 11.0, 0.002))
    p = phases(small, heavy)
    assert (p["before"]["count"], p["during"]["count"], p["after"]["count"]) == (2, 4, 1)
    assert p["during"]["outcomes"] == {"200": 3, "429": 1} and p["during"]["ok"] == 3
    assert p["during"]["max_ms"] == pytest.approx(50.0)  # of those answered 200
    assert p["heavy_phase_s"] == pytest.approx(3.5)


def test_soak_summary_reports_levels_and_slopes_per_minute():
    samples = [TreeSample(t=100.0 + 30 * i, processes=1, rss_mb=200.0 + i, fds=20 + (i % 2), threads=10, cpu_s=i)
               for i in range(9)]  # +1 MB every 30 s
    s = soak_summary(samples, idle={"rss_mb": 190.0, "fds": 18, "threads": 9},
                     after={"rss_mb": 205.0, "fds": 19, "threads": 10})
    assert (s["rss_mb"]["idle"], s["rss_mb"]["start"], s["rss_mb"]["end"], s["rss_mb"]["peak"],
            s["rss_mb"]["after"]) == (190.0, 200.0, 208.0, 208.0, 205.0)
    assert s["rss_mb"]["slope_per_min"] == pytest.approx(2.0)
    assert s["rss_mb"]["second_half_slope_per_min"] == pytest.approx(2.0)
    assert s["threads"]["slope_per_min"] == pytest.approx(0.0)
    assert s["fds"]["peak"] == 21
    assert slope_per_minute(samples[:2], "rss_mb") != slope_per_minute(samples[:2], "rss_mb")  # NaN: too few


@pytest.mark.slow
def test_a_short_head_of_line_run_on_the_tiny_model(tiny_onnx, tmp_path):
    cfg = ReliabilityConfig(mode="hol", model=str(tiny_onnx), hol_rate=20.0, hol_repeats=1, hol_png_side=256,
                            hol_oip_shape=(2, 32, 32), hol_phase_s=0.3, settle_s=0.2, log_dir=tmp_path)
    report = run_head_of_line(cfg, {}, command="test")
    (run,) = report["runs"]
    assert [h["kind"] for h in report["heavy"]] == ["256x256 PNG, rollout=png", "Open Inference 2x3x32x32"]
    assert [h["count"] for h in run["heavy"]] == [1, 1] and run["small_rate"] == 20.0
    small = run["small"]
    assert all(sum(small[p]["outcomes"].values()) == small[p]["count"] for p in ("before", "during", "after"))
    assert small["before"]["count"] > 0 and small["after"]["count"] > 0
    memory = run["memory"]
    assert 0 < memory["idle"]["rss_mb"] <= memory["peak_rss_mb"] and memory["idle"]["fds"] > 0
    assert [t["target"] for t in run["targets"]][:2] == ["<= 250 ms", "< 1024 MB"]
    assert run["targets"][1]["value_mb"] == memory["peak_rss_mb"]
    assert "## Heavy requests and memory" in render_head_of_line(report)


@pytest.mark.slow
def test_a_short_soak_on_the_tiny_model_counts_every_kind(tiny_onnx, tmp_path):
    cfg = ReliabilityConfig(mode="soak", model=str(tiny_onnx), soak_minutes=0.05, soak_rate=40.0, sample_s=0.5,
                            settle_s=0.2, log_dir=tmp_path)
    report = run_soak(cfg, {"max_loop_lag_ms": "60000"}, command="test")  # never shed because the machine is busy
    (run,) = report["runs"]
    assert report["calibration"] == [] and report["rate"] == 40.0  # a rate given: no saturation measured
    kinds = {k["kind"]: k for k in run["kinds"]}
    assert set(kinds) == {m["kind"] for m in report["mix"]}
    assert run["offered"] == sum(k["count"] for k in kinds.values()) == 120
    assert all(sum(k["outcomes"].values()) == k["count"] for k in kinds.values())
    assert kinds["hang up mid-upload"]["outcomes"] == {HUNG_UP: kinds["hang up mid-upload"]["count"]}
    assert kinds["bad: unknown model"]["outcomes"] == {"404": kinds["bad: unknown model"]["count"]}
    assert len(run["samples"]) >= 3 and set(run["summary"]) == {"rss_mb", "fds", "threads"}
    assert "## Requests by kind" in render_soak(report)
