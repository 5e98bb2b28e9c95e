"""The report: the issue's target ratios with exact values, and the Markdown without matplotlib."""
from __future__ import annotations

import pytest

from vitserve.bench.report import targets, write_report


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
    t = targets(_report(raw, served, bare))
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
    t = targets({**_report(raw, served), "paired": paired})
    assert t["one_client_latency_batching_on"] == {
        "served_p50_ms": 33.5, "raw_batch1_p50_ms": 31.0, "overhead_ms": 2.25,
        "method": "median of 30 paired differences", "target": "<= +3 ms"}


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
    paths = write_report(report, tmp_path / "bench.md")
    assert [p.name for p in paths] == ["bench.md", "bench.json"]
    assert "matplotlib is not installed" in capsys.readouterr().err
    assert "![latency" not in (tmp_path / "bench.md").read_text()


def test_a_table_bench_writes_its_report_into_a_folder_it_makes(tmp_path, capsys):
    # the invariance bench once measured for minutes, then failed on an --out whose folder did not exist yet
    import json

    from vitserve.bench.report import publish

    out = tmp_path / "not" / "yet" / "report.md"
    publish("| a |\n", [{"a": 1}], out)
    assert out.read_text() == "| a |\n" and json.loads(out.with_suffix(".json").read_text()) == [{"a": 1}]
    assert capsys.readouterr().out == "| a |\n\n"


def test_a_benchs_command_line_carries_the_server_settings_of_its_environment(monkeypatch):
    """The servers a bench starts inherit VITSERVE_ settings; a report's command without them would not rerun it."""
    import os

    from vitserve.bench.report import command_line

    for name in [n for n in os.environ if n.startswith("VITSERVE_")]:
        monkeypatch.delenv(name)
    assert command_line("python -m vitserve.bench.x", ["--serve-flags", "--runtime onnxruntime"]) == \
        "python -m vitserve.bench.x --serve-flags '--runtime onnxruntime'"
    monkeypatch.setenv("VITSERVE_RUNTIME", "onnxruntime")
    monkeypatch.setenv("VITSERVE_LOG_LEVEL", "a b")
    monkeypatch.setenv("NOT_VITSERVE_X", "1")
    assert command_line("python -m vitserve.bench.x", ["--rounds", "2"]) == \
        "VITSERVE_LOG_LEVEL='a b' VITSERVE_RUNTIME=onnxruntime python -m vitserve.bench.x --rounds 2"
