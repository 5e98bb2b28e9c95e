"""bench.grpc_peers: its report from measured rows (the run itself needs Triton and perf_analyzer: by hand)."""
from __future__ import annotations

from vitserve.bench.grpc_peers import summary


def test_summary_reports_per_round_ratios_and_their_medians():
    rows = []
    for round_index, (ours, http, theirs) in enumerate([(900, 800, 1000), (1100, 1000, 1000), (1000, 900, 800)]):
        for path, rps, p99 in (("vitserve grpc", ours, 10.0), ("vitserve http-binary", http, 12.0),
                               ("triton grpc", theirs, 20.0)):
            rows.append({"round": round_index, "path": path, "concurrency": 32, "rps": rps, "p50_ms": 1.0,
                         "p99_ms": p99})
    text = summary({"rows": rows, "machine": {"cpu": "cpu", "cores": 2}, "model": "m.onnx", "rounds": 3,
                    "window_ms": 5000, "when": "now"})
    assert "| 32 | vitserve grpc | 900, 1100, 1000 | 1000 |" in text
    assert "0.90, 1.10, 1.25 (median 1.10)" in text  # ours / Triton's, per round
    assert "1.12, 1.10, 1.11 (median 1.11)" in text  # ours / HTTP binary
    assert "0.50, 0.50, 0.50 (median 0.50)" in text  # p99 ratio
