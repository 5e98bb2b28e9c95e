"""The model without a server: the raw session loop, and ONNX Runtime against PyTorch (`vitserve evaluate bench`)."""
from __future__ import annotations

import numpy as np
import pytest

from vitserve.bench.raw import bench_raw, benchmark, images_per_second


def test_bench_raw_cycles_samples_into_each_batch_and_counts_images():
    seen = []

    def run(batch):
        seen.append(batch[:, 0, 0, 0].tolist())

    samples = np.arange(3, dtype=np.float32).reshape(3, 1, 1, 1)
    rows = bench_raw(run, samples, [1, 5], duration_s=0.0, min_calls=4)
    assert [(r["batch_size"], r["calls"]) for r in rows] == [(1, 4), (5, 4)]
    assert seen[0] == [0.0] and seen[5] == [0.0, 1.0, 2.0, 0.0, 1.0]  # 1 warm-up + 4 timed calls per size
    assert len(seen) == 10 and all(r["images_per_s"] > 0 for r in rows)


def test_images_per_second_warms_up_then_makes_at_least_three_timed_calls():
    calls = []
    rate, timed = images_per_second(lambda: calls.append(1), batch=4, min_seconds=0.0)
    assert timed == 3 and len(calls) == 4  # the warm-up call is not timed
    assert rate > 0


@pytest.mark.slow
def test_benchmark_rows(tiny_vit):
    rows = benchmark(tiny_vit, [1, 2], threads=1, min_seconds=0.05)
    keys = {(r["runtime"], r["rollout"], r["batch"]) for r in rows}
    assert keys == {(rt, ro, b) for rt in ("torch", "onnxruntime") for ro in (False, True) for b in (1, 2)}
    assert all(r["images_per_s"] > 0 and r["size"] == [32, 32] and r["threads"] == 1 for r in rows)
    assert np.isfinite([r["images_per_s"] for r in rows]).all()
