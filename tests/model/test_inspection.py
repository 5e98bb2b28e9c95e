"""`vitserve inspect` (model/inspection.py): Figure 7's numbers from a checkpoint, checked against what they must
be on inputs whose answer is known, and the command end to end on the tiny model."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from vitserve.model.inspection import filter_components, mean_distance, patch_distances, position_similarity


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_an_exported_file_gives_back_the_numbers_export_stored(tiny_onnx, tmp_path, capsys):
    from vitserve.artifact import INSPECTION_KEY
    from vitserve.cli import main
    from vitserve.onnx_header import read_header

    out = tmp_path / "from-onnx"
    assert main(["inspect", str(tiny_onnx), "--out", str(out)]) == 0
    stored = json.loads(read_header(tiny_onnx).metadata[INSPECTION_KEY])
    assert json.loads((out / "inspection.json").read_text()) == stored
    assert stored["images"] == 17 and stored["grid"] == [4, 4]  # the export's photos: a 3-channel 32x32 model
    assert {p.name for p in out.iterdir()} >= {"filters.png", "REPORT.md"}


def test_an_exported_file_is_inspected_without_torch_or_matplotlib(tiny_onnx, tmp_path):
    """The serving install (`make serve`'s) has neither: the numbers and the report come out, and one line says what
    the panels need."""
    import subprocess
    import sys

    out = tmp_path / "served-install"
    blocked = ("import sys; sys.modules.update(torch=None, matplotlib=None); from vitserve.cli import main; "
               f"code = main(['inspect', {str(tiny_onnx)!r}, '--out', {str(out)!r}]); "
               "assert 'torch' not in sys.modules or sys.modules['torch'] is None; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", blocked], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in out.iterdir()) == ["REPORT.md", "inspection.json"]
    assert done.stdout.splitlines()[-1] == ("vitserve inspect: the panels (PNG) need matplotlib, which this install "
                                            "lacks: pip install matplotlib")


def test_bad_inputs_are_one_line_errors(tiny_checkpoint, tmp_path, capsys):
    import shutil

    from vitserve.cli import main

    not_a_model = tmp_path / "notes.onnx"
    not_a_model.write_text("hello")
    empty = tmp_path / "empty"
    empty.mkdir()
    disagreeing = tmp_path / "disagreeing"
    shutil.copytree(tiny_checkpoint, disagreeing)
    config = json.loads((disagreeing / "config.json").read_text())
    config["architecture"]["depth"] = 3  # the weights hold 2 blocks
    (disagreeing / "config.json").write_text(json.dumps(config))
    cases = [([str(not_a_model)], "notes.onnx"), ([str(tiny_checkpoint), "--images-dir", str(empty)],
                                                 "holds no image files"),
             ([str(tiny_checkpoint), "--images-dir", str(tmp_path / "absent")], "is not a folder"),
             ([str(tiny_checkpoint)], "needs --images-dir"), ([str(disagreeing)], "blocks.2")]
    for args, expected in cases:
        assert main(["inspect", *args, "--out", str(tmp_path / "out")]) != 0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and expected in err, (args, err)


def test_export_stores_the_inspection_unless_told_not_to(tiny_checkpoint, tmp_path, capsys):
    from vitserve.artifact import INSPECTION_KEY
    from vitserve.cli import main
    from vitserve.onnx_header import read_header

    quick = ["--no-verify", "--no-relevance", "--quiet"]
    images = tmp_path / "images"
    images.mkdir()
    for i in range(5):
        Image.fromarray(np.full((20, 30, 3), 40 * i, np.uint8)).save(images / f"{i}.png")
    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "a.onnx"), *quick,
                 "--inspection-images", "3", "--inspection-dir", str(images)]) == 0
    assert json.loads(read_header(tmp_path / "a.onnx").metadata[INSPECTION_KEY])["images"] == 3
    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "b.onnx"), *quick,
                 "--inspection-images", "0"]) == 0
    assert INSPECTION_KEY not in read_header(tmp_path / "b.onnx").metadata
    capsys.readouterr()
    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "c.onnx"), *quick,
                 "--inspection-dir", str(tmp_path / "absent")]) == 2
    assert "--inspection-dir" in capsys.readouterr().err and not (tmp_path / "c.onnx").exists()
    with pytest.raises(SystemExit):
        main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "d.onnx"), "--inspection-images", "-1"])
    from vitserve.export.inspection import DEFAULT_IMAGES
    from vitserve.cli import build_parser

    assert build_parser().parse_args(["export", "c", "--out", "x"]).inspection_images == DEFAULT_IMAGES


def test_a_file_without_a_stored_inspection_says_how_to_get_one(tiny_checkpoint, tmp_path, capsys):
    from vitserve.cli import main

    bare = tmp_path / "bare.onnx"
    assert main(["export", str(tiny_checkpoint), "--out", str(bare), "--no-verify", "--no-relevance", "--quiet",
                 "--inspection-images", "0"]) == 0
    capsys.readouterr()
    assert main(["inspect", str(bare), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "carries no inspection" in err and "--inspection-images 0" in err
