"""`python -m vitserve.bench.invariance`: the same images alone and in concurrent bursts through a real server, with the
server's own statistics proving that the bursts were batched."""
from __future__ import annotations

import gzip
import json

import numpy as np
from PIL import Image


def write_idx(path, images: np.ndarray) -> None:
    header = np.array([2051, len(images), 28, 28], ">i4").tobytes()
    path.write_bytes(gzip.compress(header + images.astype(np.uint8).tobytes()))


def test_the_idx_images_come_back_as_pngs_of_the_same_pixels(tmp_path):
    from vitserve.bench.invariance import idx_pngs

    images = np.random.default_rng(0).integers(0, 256, (5, 28, 28))
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", images)
    pngs = idx_pngs(tmp_path / "t10k-images-idx3-ubyte.gz", 3)
    assert len(pngs) == 3
    assert np.array_equal(np.asarray(Image.open(__import__("io").BytesIO(pngs[2]))), images[2])


def test_images_alone_and_in_batched_bursts_answer_the_same(tiny_onnx, tmp_path):
    from vitserve.bench import invariance

    write_idx(tmp_path / "images.gz", np.random.default_rng(1).integers(0, 256, (24, 28, 28)))
    out = tmp_path / "invariance.md"
    invariance.main(["--model", str(tiny_onnx), "--images", "24", "--max-burst", "12", "--queue-delay-ms", "100",
                     "--test-images", str(tmp_path / "images.gz"), "--out", str(out)])
    (row,) = json.loads(out.with_suffix(".json").read_text())
    assert row["images"] == 24 and row["top1_changes"] == 0
    assert row["max_logit_diff"] <= 1e-5
    assert row["mean_batch_alone"] == 1.0
    assert row["mean_batch_mixed"] > 1.5  # the bursts did share batches: otherwise the run proves nothing
    assert "| 24 | 0 |" in out.read_text()
