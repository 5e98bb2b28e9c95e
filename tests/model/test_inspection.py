"""`vitserve inspect` (model/inspection.py): Figure 7's numbers from a checkpoint, checked against what they must
be on inputs whose answer is known, and the command end to end on the tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from model.inspection import filter_components, mean_distance, patch_distances, position_similarity


def test_filter_components_are_orthonormal_and_ordered_by_variance():
    weight = torch.randn(64, 3, 4, 4) * torch.linspace(0.1, 3, 48).reshape(1, 3, 4, 4)
    components, explained = filter_components(weight, count=28)
    flat = components.reshape(28, -1)
    np.testing.assert_allclose(flat @ flat.T, np.eye(28), atol=1e-9)
    assert components.shape == (28, 3, 4, 4) and np.all(np.diff(explained) <= 1e-12) and explained.sum() <= 1
    _, every = filter_components(weight, count=48)  # 64 filters of 48 values: all components
    assert every.sum() == pytest.approx(1.0)


def test_position_similarity_is_a_cosine_grid():
    similarity = position_similarity(torch.randn(1, 1 + 3 * 4, 16), (3, 4))
    flat = similarity.reshape(12, 12)
    assert similarity.shape == (3, 4, 3, 4)
    np.testing.assert_allclose(np.diag(flat), 1.0)
    np.testing.assert_allclose(flat, flat.T)
    assert np.all(np.abs(flat) <= 1 + 1e-12)


def test_mean_attention_distance_of_known_attention():
    grid, patch = (3, 4), 8
    distances = patch_distances(grid, patch)
    assert distances[0, 1] == 8 and distances[0, 4] == 8 and distances[0, 5] == pytest.approx(8 * 2 ** 0.5)
    n = 12
    to_itself = np.zeros((2, 1, 1 + n, 1 + n))
    to_itself[:, :, np.arange(1 + n), np.arange(1 + n)] = 1
    assert mean_distance(to_itself, distances) == pytest.approx([0.0])
    uniform = np.full((2, 1, 1 + n, 1 + n), 1 / (1 + n))  # the class token's share is left out and renormalised
    assert mean_distance(uniform, distances) == pytest.approx([distances.mean()])


def test_the_command_writes_the_panels_the_numbers_and_a_report(tiny_checkpoint, tmp_path, capsys):
    from vitserve.cli import main
    images = tmp_path / "images"
    images.mkdir()
    rng = np.random.default_rng(0)
    for i in range(3):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(images / f"{i}.png")
    out = tmp_path / "inspected"
    assert main(["inspect", str(tiny_checkpoint), "--out", str(out), "--images-dir", str(images)]) == 0
    assert {p.name for p in out.iterdir()} == {"filters.png", "position_similarity.png", "attention_distance.png",
                                               "inspection.json", "REPORT.md"}
    data = json.loads((out / "inspection.json").read_text())
    assert data["images"] == 3 and data["grid"] == [4, 4] and data["patch_size"] == 8
    distances = np.array(data["mean_attention_distance_px"])
    assert distances.shape == (2, 2) and np.all((0 < distances) & (distances <= data["max_distance_px"]))
    assert np.array(data["components"]).shape[1:] == (3, 8, 8)
    assert "Figure 7" in (out / "REPORT.md").read_text()
    assert main(["inspect", str(tiny_checkpoint), "--out", str(out)]) == 2  # 3-channel 32x32: no default images
    assert "--images-dir" in capsys.readouterr().err
