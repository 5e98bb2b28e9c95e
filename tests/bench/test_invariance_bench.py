"""`python -m vitserve.bench.invariance`: the same images alone and in concurrent bursts through a real server, with the
server's own statistics proving that the bursts were batched."""
from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
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


def write_idx_labels(path, labels: np.ndarray) -> None:
    header = np.array([2049, len(labels)], ">i4").tobytes()
    path.write_bytes(gzip.compress(header + labels.astype(np.uint8).tobytes()))


@pytest.mark.slow
def test_images_alone_and_in_batched_bursts_answer_the_same_at_each_budget(tiny_onnx, tmp_path):
    from vitserve.bench import invariance

    rng = np.random.default_rng(1)
    write_idx(tmp_path / "images.gz", rng.integers(0, 256, (24, 28, 28)))
    write_idx_labels(tmp_path / "labels.gz", rng.integers(0, 3, 30))  # more labels than images: the first 24 count
    out = tmp_path / "invariance.md"
    # the tiny model (32x32, patch 8) has budgets of 16, 9 and 4 tokens, none with a measured accuracy
    status = invariance.main(["--model", str(tiny_onnx), "--images", "24", "--max-burst", "12",
                              "--queue-delay-ms", "100", "--max-tokens", "16,10", "--test-images",
                              str(tmp_path / "images.gz"), "--test-labels", str(tmp_path / "labels.gz"),
                              "--set", "budget_unmeasured_rungs=true", "--out", str(out)])
    full, nine = json.loads(out.with_suffix(".json").read_text())
    assert status == 0
    assert (full["max_tokens"], full["budget_tokens"]) == (16, [16])
    assert (nine["max_tokens"], nine["budget_tokens"]) == (10, [9])  # the most accurate served budget within 10
    for row in (full, nine):
        assert row["images"] == row["compared"] == 24 and row["refused"] == row["off_budget"] == 0
        assert row["top1_changes"] == 0 and row["max_logit_diff"] <= 1e-5
        assert row["mean_batch_alone"] == 1.0
        assert row["mean_batch_mixed"] > 1.5  # the bursts did share batches: otherwise the run proves nothing
        assert 0 <= row["accuracy"] <= 1 and row["file_accuracy"] is None and row["accuracy_diff_points"] is None
    text = out.read_text()
    assert "| 16 | 16 | 24 | 0 | 0 | 0 |" in text and "| 10 | 9 | 24 | 0 | 0 | 0 |" in text


def test_served_accuracy_is_the_alone_answers_top1_and_other_budgets_are_counted_not_compared():
    from vitserve.bench.invariance import REFUSED, Answer, compare

    def answer(top: int, tokens: int) -> Answer:
        return Answer(np.eye(3, dtype=np.float32)[top], tokens)

    alone = [answer(0, 9), answer(1, 9), answer(2, 9), answer(0, 9)]
    mixed = [answer(0, 9), answer(2, 9), answer(2, 16), REFUSED]
    row = compare(alone, mixed, np.array([0, 1, 1, 0]), expected=9)
    assert row == {"images": 4, "refused": 1, "off_budget": 1, "compared": 2, "budget_tokens": [9, 16],
                   "top1_changes": 1, "max_logit_diff": 1.0, "accuracy": 1.0}


def test_a_budget_asks_for_the_most_accurate_served_one_within_it():
    from vitserve.bench.invariance import expected_rung

    assert [expected_rung([16, 9, 4], n) for n in (100, 16, 15, 9, 5, 4)] == [16, 16, 9, 9, 4, 4]
    with pytest.raises(SystemExit, match="budget_unmeasured_rungs"):
        expected_rung([16], 9)


def test_the_served_accuracy_stands_beside_the_files_own_at_the_budget_served(monkeypatch):
    from types import SimpleNamespace

    from vitserve.bench import invariance
    from vitserve.budgets import Rung

    ladder = (Rung((32, 32), 16, 1.0, 0.9), Rung((24, 24), 9, 0.55, 0.885), Rung((16, 16), 4, 0.27, None))
    monkeypatch.setattr(invariance, "read_model_info", lambda path: SimpleNamespace(ladder=ladder))
    measured, unmeasured = (invariance.with_file_accuracy({"expected_tokens": tokens, "accuracy": 0.8865}, "m.onnx")
                            for tokens in (9, 4))
    assert (measured["file_accuracy"], measured["accuracy_diff_points"]) == (0.885, 0.15)
    assert (unmeasured["file_accuracy"], unmeasured["accuracy_diff_points"]) == (None, None)
