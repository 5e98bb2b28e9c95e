"""Token budgets at export: the ladder of input grids a file serves, each rung's accuracy measured with --eval through
the resampling the server uses, and the ladder's contract in the file's metadata (vitserve/budgets.py)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

from vitserve.artifact import ArtifactError, ModelInfo
from vitserve.budgets import derived_ladder, ladder_from_json, ladder_grids, relative_cost, resample


def test_the_ladder_runs_from_the_trained_grid_to_about_a_quarter_of_its_tokens():
    assert ladder_grids((28, 28), 4) == [(28, 28), (24, 24), (20, 20), (16, 16)]
    assert ladder_grids((224, 224), 16) == [(224, 224), (192, 192), (160, 160), (144, 144), (112, 112)]
    assert ladder_grids((32, 64), 8)[1] == (24, 48)  # a non-square grid shrinks in proportion
    assert ladder_grids((8, 8), 8) == [(8, 8)]  # one patch: nothing cheaper


def test_cost_counts_every_weight_per_token_and_attention_per_token_pair():
    vit_s = {"embed_dim": 384, "depth": 12, "mlp_dim": 1536}
    assert relative_cost(vit_s, 196, 196) == 1.0
    per_token = 4 * 384 ** 2 + 2 * 384 * 1536  # the projections and the MLP: each weight once per token
    expected = (65 * per_token + 2 * 65 ** 2 * 384) / (197 * per_token + 2 * 197 ** 2 * 384)  # the class token too
    assert relative_cost(vit_s, 64, 196) == pytest.approx(expected)
    assert relative_cost({}, 25, 49) == pytest.approx(25 / 49)  # no dimensions: the tokens' share


def test_a_stored_ladder_is_checked():
    good = derived_ladder((28, 28), 4, {})
    from vitserve.budgets import ladder_to_json

    assert ladder_from_json(ladder_to_json(good), (28, 28), 4) == good
    for broken in ('[{"grid": [24, 24], "tokens": 36, "cost": 1.0}]',  # not the trained grid first
                   '[{"grid": [28, 28], "tokens": 49, "cost": 1.0}, {"grid": [22, 22], "tokens": 25, "cost": 0.5}]',
                   '[{"grid": [28, 28], "tokens": 49, "cost": 1.0, "accuracy": 1.5}]', "{}", "not json"):
        with pytest.raises(ValueError):
            ladder_from_json(broken, (28, 28), 4)


def test_resample_matches_trainings_antialiased_bilinear():
    """Training resizes with torch (model/train.py's --grid-sizes), the server with Pillow: the same filter."""
    pixels = np.random.default_rng(0).normal(size=(2, 3, 28, 28)).astype(np.float32)
    ours = resample(pixels, (20, 20))
    torchs = torch.nn.functional.interpolate(torch.from_numpy(pixels), size=(20, 20), mode="bilinear",
                                             antialias=True, align_corners=False).numpy()
    np.testing.assert_allclose(ours, torchs, atol=1e-4)


def test_an_export_with_eval_stores_each_rungs_accuracy_as_its_graph_gives_it(calibrated_export, calibration_folder):
    import onnxruntime as ort

    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, normalize_pixels
    from vitserve.export.accuracy_gate import load_labelled_set

    info = ModelInfo.from_metadata(calibrated_export.metadata)
    assert [r.grid for r in info.budgets] == [(32, 32), (24, 24), (16, 16)]
    labelled = load_labelled_set(calibration_folder, info.labels, info.channels, info.image_size)
    session = ort.InferenceSession(str(calibrated_export.path), providers=["CPUExecutionProvider"])
    pixels = normalize_pixels(labelled.images, info.mean, info.std)
    for rung in info.budgets:
        logits = session.run([OUTPUT_NAMES[0]], {INPUT_NAME: resample(pixels, rung.grid)})[0]
        assert rung.accuracy == round(float((logits.argmax(1) == labelled.labels).mean()), 6)


def test_an_export_without_eval_stores_the_grids_without_accuracies(tiny_onnx):
    from vitserve.onnx_header import read_model_info

    info = read_model_info(str(tiny_onnx))
    assert [(r.tokens, r.accuracy) for r in info.budgets] == [(16, None), (9, None), (4, None)]


def test_a_file_with_a_broken_ladder_is_an_artifact_error(calibrated_export):
    props = {p.key: p.value for p in onnx.load(str(calibrated_export.path)).metadata_props}
    props["vitserve.budgets"] = '[{"grid": [9, 9], "tokens": 1, "cost": 1.0}]'
    with pytest.raises(ArtifactError, match="vitserve.budgets"):
        ModelInfo.from_metadata(props)
