"""Temperature scaling at export (export/calibration.py) and the calibrated scores the server gives for it: the fit
finds a known temperature, the error is measured on the half it was not fitted on, and the file carries both
(tests/service/test_calibrated_scores.py: what the server answers with it)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest

from vitserve.artifact import ModelInfo
from vitserve.export.calibration import (MIN_IMAGES, CalibrationError, calibrate, fit_temperature, halves,
                                         negative_log_likelihood, reliability, softmax)


def overconfident(count: int, temperature: float, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Logits whose labels are drawn from softmax(true logits), served as true logits x `temperature`: a model
    that many times too sure of itself."""
    rng = np.random.default_rng(seed)
    true = rng.normal(0.0, 2.0, (count, 10))
    labels = np.array([rng.choice(10, p=p) for p in softmax(true)])
    return true * temperature, labels


def test_the_fit_finds_the_temperature_that_made_the_logits_overconfident():
    logits, labels = overconfident(20_000, 2.5)
    assert fit_temperature(logits, labels) == pytest.approx(2.5, rel=0.05)
    # and the likelihood it minimises is lower there than at 1 or beyond
    assert negative_log_likelihood(logits, labels, 2.5) < min(negative_log_likelihood(logits, labels, t)
                                                             for t in (1.0, 5.0))


def test_calibrating_lowers_the_error_on_the_other_half_and_changes_no_answer():
    logits, labels = overconfident(4_000, 3.0)
    result = calibrate(logits, labels, "synthetic")
    assert result.fit_images == result.report_images == 2_000
    assert result.ece_before > 0.10 and result.ece_after < 0.03 and result.nll_after < result.nll_before
    assert sum(b.count for b in result.bins_after) == sum(b.count for b in result.bins_before) == 2_000
    _, report = halves(4_000)
    assert np.array_equal(softmax(logits[report]).argmax(1), softmax(logits[report], result.temperature).argmax(1))
    assert result.summary().keys() == {"source", "temperature", "fit_images", "report_images", "accuracy",
                                       "ece_before", "ece_after", "nll_before", "nll_after"}


def test_the_halves_are_disjoint_seeded_and_cover_every_image():
    fit, report = halves(101)
    assert len(fit) == 50 and len(report) == 51 and not set(fit) & set(report)
    assert sorted([*fit, *report]) == list(range(101))
    assert np.array_equal(halves(101)[0], fit) and not np.array_equal(halves(101, seed=1)[0], fit)


def test_the_calibration_error_is_the_weighted_gap_between_confidence_and_accuracy():
    # two bins used: 0.9 confidence right half the time (gap 0.4), 0.5-ish confidence always right (gap ~0.5)
    probabilities = np.array([[0.9, 0.1], [0.9, 0.1], [0.55, 0.45], [0.55, 0.45]])
    labels = np.array([0, 1, 0, 0])
    ece, bins = reliability(probabilities, labels, bins=10)
    assert ece == pytest.approx(0.5 * 0.4 + 0.5 * 0.45)
    assert [(b.count, b.accuracy) for b in bins if b.count] == [(2, 1.0), (2, 0.5)]


def test_too_few_images_cannot_calibrate():
    logits, labels = overconfident(MIN_IMAGES - 1, 2.0)
    with pytest.raises(CalibrationError, match=f"at least {MIN_IMAGES}"):
        calibrate(logits, labels, "small")


def test_the_export_stores_the_temperature_it_fitted(calibrated_export, calibration_folder):
    report = calibrated_export
    proto = onnx.load(str(report.path))
    info = ModelInfo.from_metadata({p.key: p.value for p in proto.metadata_props})
    assert info.temperature == report.calibration.temperature > 0
    assert info.calibration == report.calibration.summary()
    assert info.calibration["fit_images"] == info.calibration["report_images"] == 60
    assert str(calibration_folder) in info.calibration["source"]


def test_an_older_or_uncalibrated_file_serves_plain_softmax(tiny_onnx):
    proto = onnx.load(str(tiny_onnx))
    info = ModelInfo.from_metadata({p.key: p.value for p in proto.metadata_props})
    assert (info.temperature, info.calibration) == (1.0, {})
    assert "vitserve.temperature" not in info.to_metadata()


def test_a_temperature_that_is_not_positive_is_refused(calibrated_export):
    from vitserve.artifact import ArtifactError

    props = dict(calibrated_export.metadata)
    for bad in ("0", "-1.5", "nan", "inf"):
        with pytest.raises(ArtifactError, match="temperature"):
            ModelInfo.from_metadata({**props, "vitserve.temperature": bad})


def test_the_export_command_prints_the_reliability_diagram(tiny_checkpoint, calibration_folder, tmp_path, capsys):
    from vitserve.cli import main

    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "m.onnx"), "--no-verify",
                 "--no-relevance", "--inspection-images", "0", "--eval", str(calibration_folder), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "calibrated: temperature" in out and "fitted on 60 images" in out and "expected calibration error" in out
    assert out.count("|") == 16  # the diagram: a header and 15 bins
