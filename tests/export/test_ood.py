"""The embedding output and the in-graph out-of-distribution score (export/ood.py, export/ood_graph.py): the fit on
the labelled set's fit half, its threshold on the other, the score's nodes in every opset form, and the exported
file's two paths against PyTorch's class token and NumPy's formula, in float32, float16 and without the relevance
path."""
from __future__ import annotations

import copy
import json

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper

from vitserve.artifact import EMBEDDING_NAME, INPUT_NAME, OOD_SCORE_NAME, TARGET_NAME, ModelInfo
from vitserve.export.calibration import graph_outputs, halves
from vitserve.export.ood import OodFitError, fit_gaussians, fit_ood_score, nearest_class_distance, threshold_split
from vitserve.export.ood_graph import PROJECTED_MEANS, PROJECTION, stored_ood_arrays, with_ood_score
from vitserve.export.verify import ExportVerificationError, cpu_session, verify_embedding, verify_ood_score
from vitserve.onnx_header import read_model_info

TINY_LABELS = ["cat", "dog", "bird"]  # tests/conftest.py's tiny_checkpoint
DIM = 8


def layer_norm_like(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings (count, DIM), labels (count,)) of 3 classes, each row centred as a LayerNorm's output is (before
    its affine part): the within-class covariance has rank DIM - 1."""
    rng = np.random.default_rng(seed)
    labels = np.arange(count) % 3
    x = rng.normal(0, 3, (3, DIM))[labels] + rng.normal(0, 1, (count, DIM)) * np.linspace(0.2, 2, DIM)
    return x - x.mean(1, keepdims=True), labels


def test_the_fit_whitens_the_shared_covariance_on_its_range():
    x, y = layer_norm_like(300)
    fitted = fit_gaussians(x, y)
    assert fitted.rank == DIM - 1 and fitted.projection.shape == (DIM, DIM - 1)
    centred = x - fitted.means[y]
    covariance = centred.T @ centred / len(x)
    np.testing.assert_allclose(fitted.projection.T @ covariance @ fitted.projection, np.eye(DIM - 1), atol=1e-9)
    # the graph's formula (the difference, squared) is the expanded one the measurement used
    np.testing.assert_allclose(nearest_class_distance(x, fitted.projection, fitted.projected_means),
                               fitted.squared_distances(x).min(1), rtol=1e-9)


def test_the_threshold_is_set_and_checked_on_parts_of_the_half_the_fit_never_saw():
    x, y = layer_norm_like(200)
    ood = fit_ood_score(x, y, TINY_LABELS, "synthetic")
    fit, heldout = halves(200)
    setting, checking = threshold_split(heldout)
    assert len(setting) == len(checking) == 50 and not set(setting) & set(checking) and set(setting) < set(heldout)
    assert ood.projection.dtype == ood.projected_means.dtype == np.float32
    assert ood.projection.shape == (DIM, DIM - 1) and ood.projected_means.shape == (3, DIM - 1)
    scores = nearest_class_distance(x[heldout], ood.projection, ood.projected_means)
    summary = ood.summary
    assert summary["threshold"] == pytest.approx(np.quantile(nearest_class_distance(
        x[setting], ood.projection, ood.projected_means), 0.99), rel=1e-12)
    assert summary["quantiles"]["0.99"] == pytest.approx(np.quantile(scores, 0.99), rel=1e-12)
    checked = nearest_class_distance(x[checking], ood.projection, ood.projected_means)
    assert summary["false_alarm_rate"] == np.mean(checked > summary["threshold"])
    assert list(summary["quantiles"]) == ["0.5", "0.9", "0.99", "0.999"]
    assert {k: v for k, v in summary.items() if k not in ("threshold", "quantiles", "false_alarm_rate")} == {
        "score": "mahalanobis", "fit_images": 100, "heldout_images": 100, "threshold_images": 50,
        "check_images": 50, "source": "synthetic", "rank": DIM - 1}
    moved = x.copy()
    moved[heldout] += 5.0  # the held-out half moves the threshold, never the statistics
    again = fit_ood_score(moved, y, TINY_LABELS, "synthetic")
    assert np.array_equal(again.projection, ood.projection) and again.summary["threshold"] > summary["threshold"]


def test_too_few_images_or_too_few_of_a_class_give_no_score():
    x, y = layer_norm_like(200)
    with pytest.raises(OodFitError, match="99 labelled images, fitting one needs at least 100"):
        fit_ood_score(x[:99], y[:99], TINY_LABELS, "small")
    fit, _ = halves(200)
    scarce = y.copy()
    birds = fit[y[fit] == 2]
    scarce[birds[1:]] = 0  # one bird left where the statistics are fitted
    with pytest.raises(OodFitError, match="class 'bird' has 1 of the 100 images"):
        fit_ood_score(x, scarce, TINY_LABELS, "scarce")


def embedding_graph(opset: int) -> onnx.ModelProto:
    """A graph whose input is its embedding output (batch, DIM)."""
    value = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", DIM])
    graph = helper.make_graph([helper.make_node("Identity", ["x"], [EMBEDDING_NAME])], "embedding", [value],
                              [helper.make_tensor_value_info(EMBEDDING_NAME, TensorProto.FLOAT, ["batch", DIM])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


@pytest.mark.parametrize("opset,axes_inputs", [(11, set()), (13, {"Unsqueeze", "ReduceSum"}),
                                               (18, {"Unsqueeze", "ReduceSum", "ReduceMin"})])
def test_the_score_nodes_compute_the_formula_in_each_opset_form(opset, axes_inputs):
    x, y = layer_norm_like(200)
    ood = fit_ood_score(x, y, TINY_LABELS, "synthetic")
    scored = with_ood_score(embedding_graph(opset), ood)
    onnx.checker.check_model(scored, full_check=True)
    axes = {n.op_type for n in scored.graph.node if n.op_type in ("Unsqueeze", "ReduceSum", "ReduceMin")
            and len(n.input) == 2}
    assert axes == axes_inputs  # axes as an input from Unsqueeze/ReduceSum 13 and ReduceMin 18, else an attribute
    assert [o.name for o in scored.graph.output] == [EMBEDDING_NAME, OOD_SCORE_NAME]
    assert [d.dim_param for d in scored.graph.output[1].type.tensor_type.shape.dim] == ["batch"]
    z = layer_norm_like(7, seed=3)[0].astype(np.float32)
    (score,) = cpu_session(scored).run([OOD_SCORE_NAME], {"x": z})
    assert score.shape == (7,) and score.dtype == np.float32
    np.testing.assert_allclose(score, nearest_class_distance(z, ood.projection, ood.projected_means), rtol=1e-5)


def outputs_of(proto: onnx.ModelProto) -> list[tuple[str, list]]:
    return [(o.name, [d.dim_param or d.dim_value for d in o.type.tensor_type.shape.dim]) for o in proto.graph.output]


def class_token(vit, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return vit.forward_features(torch.from_numpy(x))[0][:, 0].numpy()


def test_both_paths_output_the_class_token_and_its_score(calibrated_export, tiny_model):
    proto = onnx.load(str(calibrated_export.path))
    assert outputs_of(proto) == [("logits", ["batch", 3]), ("rollout", ["batch", "height/8", "width/8"]),
                                 ("relevance", ["explained", "explained_height", "explained_width"]),
                                 ("embedding", ["batch", 32]), ("ood_score", ["batch"])]
    assert {o.type.tensor_type.elem_type for o in proto.graph.output} == {TensorProto.FLOAT}
    (choice,) = [n for n in proto.graph.node if n.op_type == "If"]
    assert list(choice.output) == ["logits", "rollout", "relevance", "embedding"]  # the score comes after it
    projection, projected_means = stored_ood_arrays(proto)
    assert projection.shape == (32, 31) and projected_means.shape == (3, 31)  # a LayerNorm output: rank D - 1
    session = cpu_session(str(calibrated_export.path))
    for size in ((32, 32), (64, 64)):
        x = np.random.default_rng(size[0]).standard_normal((3, 3, *size)).astype(np.float32)
        reference = class_token(tiny_model, x)
        for feeds in ({INPUT_NAME: x}, {INPUT_NAME: x, TARGET_NAME: np.array([-1, 0, 2], np.int64)}):
            embedding, score = session.run([EMBEDDING_NAME, OOD_SCORE_NAME], feeds)
            assert embedding.shape == (3, 32) and score.shape == (3,)
            np.testing.assert_allclose(embedding, reference, rtol=0, atol=1e-5 * np.abs(reference).max())
            np.testing.assert_allclose(score, nearest_class_distance(embedding, projection, projected_means),
                                       rtol=1e-5)


def test_the_file_says_how_its_score_was_fitted_and_the_labelled_set_agrees(calibrated_export, calibration_folder):
    from vitserve.export.accuracy_gate import load_labelled_set

    info = read_model_info(calibrated_export.path)
    assert info.embedding_size == 32 and info.extra_outputs == (EMBEDDING_NAME, OOD_SCORE_NAME)
    assert ModelInfo.from_metadata(info.to_metadata(), info.opset) == info
    ood = info.ood
    assert (ood["score"], ood["fit_images"], ood["heldout_images"], ood["rank"]) == ("mahalanobis", 60, 60, 31)
    assert str(calibration_folder) in ood["source"] and (ood["threshold_images"], ood["check_images"]) == (30, 30)
    assert ood == calibrated_export.ood.summary
    # The served scores of the threshold's part of the held-out half put it at their 99th percentile, and the fit
    # half's statistics, fitted again here, give the file's scores.
    labelled = load_labelled_set(calibration_folder, TINY_LABELS, 3, (32, 32))
    embeddings, scores = graph_outputs(cpu_session(str(calibrated_export.path)), labelled.images, info.mean,
                                       info.std, [EMBEDDING_NAME, OOD_SCORE_NAME])
    fit, heldout = halves(len(labelled.labels))
    assert np.quantile(scores[threshold_split(heldout)[0]], 0.99) == pytest.approx(ood["threshold"], rel=1e-5)
    refitted = fit_gaussians(embeddings[fit], labelled.labels[fit])
    np.testing.assert_allclose(scores, refitted.squared_distances(embeddings).min(1), rtol=1e-4)


def test_the_export_verifies_both_outputs_in_both_paths(calibrated_export):
    for report, tolerance in ((calibrated_export.embedding, 1e-5), (calibrated_export.ood_verification, 1e-4)):
        assert {(c.height, c.width) for c in report.cases} == {(32, 32), (64, 64)}  # trained, twice it
        assert {c.path for c in report.cases} == {"fast", "relevance"} and {c.batch for c in report.cases} == {1, 3}
        assert report.tolerance.rtol == tolerance and report.max_rel_diff <= tolerance


def test_a_wrong_score_node_or_embedding_fails_verification(calibrated_export, tiny_model, tmp_path):
    proto = onnx.load(str(calibrated_export.path))
    (nearest,) = [n for n in proto.graph.node if n.op_type == "ReduceMin"]
    nearest.op_type = "ReduceMax"  # the farthest class mean
    onnx.save(proto, str(tmp_path / "farthest.onnx"))
    with pytest.raises(ExportVerificationError, match="in-graph OOD score differs from NumPy"):
        verify_ood_score(str(tmp_path / "farthest.onnx"), tiny_model)
    moved = copy.deepcopy(tiny_model)
    with torch.no_grad():
        moved.norm.bias.add_(1e-3)  # PyTorch's class token moves by 1e-3; the file's does not
    with pytest.raises(ExportVerificationError, match="embedding output differs from PyTorch's class token"):
        verify_embedding(str(calibrated_export.path), moved)


def test_the_command_exports_and_reports_the_score_without_the_relevance_path(tiny_checkpoint, calibration_folder,
                                                                                tmp_path, capsys):
    from vitserve.cli import main
    from vitserve.export.cli import human_summary

    out = tmp_path / "fast.onnx"
    assert main(["export", str(tiny_checkpoint), "--out", str(out), "--no-relevance", "--inspection-images", "0",
                 "--eval", str(calibration_folder), "--quiet", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["ood"]["fit_images"] == 60 and summary["ood"]["rank"] == 31
    for check, tolerance in (("embedding_verified", 1e-5), ("ood_verified", 1e-4)):
        assert {tuple(c) for c in summary[check]["cases"]} == {(s, s, b, "fast") for s in (32, 64) for b in (1, 3)}
        assert summary[check]["max_rel_diff"] <= tolerance == summary[check]["tolerance"]["rtol"]
    text = human_summary(summary)
    assert "embedding verified against PyTorch's class token at 32x32, 64x64 (fast path)" in text
    assert "out-of-distribution score: squared Mahalanobis distance to the nearest class mean (rank 31)" in text
    proto = onnx.load(str(out))
    assert [name for name, _ in outputs_of(proto)] == ["logits", "rollout", "embedding", "ood_score"]
    assert not any(n.op_type == "If" for n in proto.graph.node)
    x = np.random.default_rng(5).standard_normal((2, 3, 40, 24)).astype(np.float32)
    embedding, score = cpu_session(str(out)).run([EMBEDDING_NAME, OOD_SCORE_NAME], {INPUT_NAME: x})
    np.testing.assert_allclose(score, nearest_class_distance(embedding, *stored_ood_arrays(proto)), rtol=1e-5)


@pytest.mark.slow
def test_a_float16_file_keeps_its_embedding_and_score_float32(tiny_checkpoint, calibration_folder, tmp_path):
    from vitserve.export.onnx_export import export_onnx

    report = export_onnx(tiny_checkpoint, tmp_path / "half.onnx", precision="fp16", relevance=False,
                         eval_dir=calibration_folder, inspection_images=0)
    proto = onnx.load(str(report.path))
    assert [name for name, _ in outputs_of(proto)] == ["logits", "rollout", "embedding", "ood_score"]
    assert {o.type.tensor_type.elem_type for o in proto.graph.output} == {TensorProto.FLOAT}
    stored = {t.name: t.data_type for t in proto.graph.initializer if t.name in (PROJECTION, PROJECTED_MEANS)}
    assert stored == {PROJECTION: TensorProto.FLOAT, PROJECTED_MEANS: TensorProto.FLOAT}
    assert 0 < report.fp16.embedding_max_abs_diff <= report.fp16.embedding_tolerance
    assert report.ood_verification.max_rel_diff <= 1e-4
    assert read_model_info(report.path).ood["fit_images"] == 60  # fitted on the float32 graph's embeddings
