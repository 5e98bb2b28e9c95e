"""`python -m vitserve.bench.runtimes`: each runtime this CPU can run, timed on the same file, with its answers' distance from
ONNX Runtime float32 and what `--runtime auto` picks."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("onnxruntime")


@pytest.mark.slow
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


def test_accuracy_scores_each_candidate_on_the_test_split_against_the_first(tmp_path):
    import gzip
    import struct
    from types import SimpleNamespace

    import numpy as np

    from vitserve.bench.runtimes import accuracy

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (40, 6, 6), dtype=np.uint8)
    labels = (images.reshape(40, -1).mean(1) > 127).astype(np.uint8)
    for name, array in (("t10k-images-idx3-ubyte.gz", images), ("t10k-labels-idx1-ubyte.gz", labels)):
        header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
        (tmp_path / name).write_bytes(gzip.compress(header + array.tobytes()))
    info = SimpleNamespace(name="toy", channels=1, image_size=(6, 6), mean=[0.5], std=[0.5])

    def model(flip_every: int):  # logits from the mean brightness; every `flip_every`-th answer swapped
        def run(pixels):
            mean = pixels.reshape(len(pixels), -1).mean(1)
            logits = np.stack([-mean, mean], 1)
            if flip_every:
                logits[::flip_every] = logits[::flip_every, ::-1]
            rollout = pixels[:, 0, ::2, ::2] * (-1 if flip_every else 1)  # reversed maps: rank correlation -1
            return logits, rollout
        return SimpleNamespace(info=info, run=run)

    result = accuracy({"reference": model(0), "worse": model(4)}, tmp_path, batch=8)
    assert result["reference"] == {"images": 40, "accuracy": 1.0, "top1_agreement": 1.0,
                                   "rollout_spearman_mean": 1.0, "rollout_spearman_min": 1.0}
    # every 4th of each batch of 8 flipped: 2 of 8
    assert result["worse"]["top1_agreement"] == 0.75 and result["worse"]["accuracy"] == 0.75
    assert result["worse"]["rollout_spearman_mean"] == pytest.approx(-1.0)


def test_graph_flops_count_the_vits_matrix_work(tiny_onnx):
    pytest.importorskip("openvino")
    from vitserve.bench.runtimes import graph_gflops

    # the tiny ViT: 16 patches of 3x8x8 into 32 dims, 17 tokens, 2 blocks of 2 heads, an MLP of 64
    patches = 16 * 32 * (3 * 8 * 8)
    block = 17 * 32 * 96 + 2 * (2 * 17 * 17 * 16) + 17 * 32 * 32 + 2 * 17 * 32 * 64
    transformer = 2 * (patches + 2 * block)
    # beyond it only the head, the rollout's 17x17 products and the OOD score's projection: a few per cent
    assert transformer <= graph_gflops(tiny_onnx) * 1e9 <= 1.1 * transformer


def test_the_matmul_peak_is_a_plausible_rate():
    pytest.importorskip("openvino")
    from vitserve.bench.runtimes import matmul_peak_gflops

    assert 1 < matmul_peak_gflops("fp32", threads=1, size=256, rounds=1) < 1e4
