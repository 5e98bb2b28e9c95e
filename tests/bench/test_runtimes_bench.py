"""`python -m vitserve.bench.runtimes`: each runtime this CPU can run, timed on the same file, with its answers' distance from
ONNX Runtime float32 and what `--runtime auto` picks."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime")


def test_the_table_times_every_candidate_and_says_what_auto_picks(tiny_onnx, tmp_path):
    from vitserve.bench.runtimes import main
    from vitserve.service.engine import openvino_runtime

    out = tmp_path / "runtimes.md"
    assert main([str(tiny_onnx), "--batches", "1,4", "--rounds", "1", "--seconds", "0.05", "--threads", "1",
                 "--out", str(out)]) == 0
    [report] = json.loads(out.with_suffix(".json").read_text())
    names = {r["candidate"] for r in report["rows"]}
    assert "onnxruntime" in names and {r["batch"] for r in report["rows"]} == {1, 4}
    if openvino_runtime.available():
        assert "openvino fp32" in names
    assert report["max_logit_diff_vs_onnxruntime"]["onnxruntime"] == 0.0
    for candidate, diff in report["max_logit_diff_vs_onnxruntime"].items():
        # float32 agrees to rounding; bfloat16 keeps 8 bits of mantissa: within auto's gate (5% of the largest logit)
        assert diff < (0.05 * max(1.0, report["largest_logit"]) if candidate.endswith("bf16") else 1e-3), candidate
    assert report["auto_picks"] in ("CPUExecutionProvider", "OpenVINO/CPU/fp32", "OpenVINO/CPU/bf16")
    assert "`--runtime auto` picks" in out.read_text()
