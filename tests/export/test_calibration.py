"""Temperature scaling at export (export/calibration.py) and the calibrated scores the server gives for it: the fit
finds a known temperature, the error is measured on the half it was not fitted on, and the file carries both
(tests/service/test_calibrated_scores.py: what the server answers with it)."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import onnx
import pytest

from vitserve.artifact import ArtifactError, EntropyTemperature, ModelInfo, softmax
from vitserve.export.calibration import (MIN_CURVE_IMAGES, MIN_IMAGES, CalibrationError, calibrate,
                                         fit_entropy_temperature, fit_temperature, halves, negative_log_likelihood,
                                         reliability)


def entropy(probabilities: np.ndarray) -> np.ndarray:
    """The textbook -sum p log p, per row: the reference the served form (log-sum-exp) is checked against."""
    p = np.asarray(probabilities, np.float64)
    return -np.sum(p * np.log(np.where(p > 0, p, 1.0)), axis=-1)


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
    assert result.ece_before > 0.10 and result.ece_after < 0.04 and result.nll_after < result.nll_before
    assert sum(b.count for b in result.bins_after) == sum(b.count for b in result.bins_before) == 2_000
    _, report = halves(4_000)
    assert np.array_equal(softmax(logits[report]).argmax(1), softmax(logits[report], result.temperature).argmax(1))
    assert result.summary().keys() == {"source", "temperature", "fit_images", "report_images", "accuracy",
                                       "ece_before", "ece_after", "ece_single_temperature", "nll_before", "nll_after"}
    served = result.curve.temperatures(logits[report])
    assert np.array_equal(softmax(logits[report]).argmax(1), softmax(logits[report], served).argmax(1))
    # one temperature made these logits: the curve finds about that one, flat
    assert np.exp(result.curve.coefficients[0]) == pytest.approx(3.0, rel=0.1)
    assert np.median(served) == pytest.approx(3.0, rel=0.1)


def unsure_where_overconfident(count: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Labels drawn from softmax(true logits); the served logits are the true ones where the answer is clear and
    3x them where it is not: one temperature cannot undo both, a temperature by entropy can."""
    rng = np.random.default_rng(seed)
    true = rng.normal(0.0, 1.0, (count, 10)) * rng.choice([1.0, 6.0], (count, 1))
    labels = np.array([rng.choice(10, p=p) for p in softmax(true)])
    clear = softmax(true).max(1) > 0.6
    return np.where(clear[:, None], true, true * 3.0), labels


def test_a_temperature_per_answer_fixes_what_one_temperature_cannot():
    logits, labels = unsure_where_overconfident(8_000)
    result = calibrate(logits, labels, "synthetic")
    _, report = halves(8_000)
    assert result.temperature_by_entropy is not None
    one = negative_log_likelihood(logits[report], labels[report], result.temperature)
    assert result.nll_after < one - 0.005 and result.ece_after < 0.8 * result.ece_single_temperature
    served = result.curve.temperatures(logits[report])
    assert served.max() / served.min() > 1.5  # unsure answers are cooled down more than sure ones
    assert np.array_equal(softmax(logits[report]).argmax(1), softmax(logits[report], served).argmax(1))


def test_the_curve_starts_from_one_temperature_and_never_fits_worse_than_it():
    logits, labels = overconfident(3_000, 2.0, seed=3)
    start = fit_temperature(logits, labels)
    curve = fit_entropy_temperature(logits, labels, start)
    assert negative_log_likelihood(logits, labels, curve.temperatures(logits)) <= \
        negative_log_likelihood(logits, labels, start) + 1e-12


def test_an_answer_unlike_the_fitted_ones_gets_the_edge_temperature_not_an_extrapolated_one():
    curve = EntropyTemperature(mean=0.6, std=0.25, low=-1.0, high=2.0, coefficients=(0.0, 0.3, -0.2))
    very_sure, uniform = np.array([[40.0, 0, 0, 0]]), np.zeros((1, 4))  # entropies ~0 and log 4, far outside
    edge_low, edge_high = np.exp(0.3 * -1.0 - 0.2), np.exp(0.3 * 2.0 - 0.2 * 4)
    assert curve.temperatures(very_sure)[0] == pytest.approx(edge_low)
    assert curve.temperatures(uniform)[0] == pytest.approx(edge_high)
    inside = np.array([[3.0, 0.2, 0.1, 0.0]])
    u = (entropy(softmax(inside))[0] - 0.6) / 0.25
    assert -1.0 < u < 2.0 and curve.temperatures(inside)[0] == pytest.approx(np.exp(0.3 * u - 0.2 * u * u))


def test_one_answer_gets_the_temperature_it_gets_in_a_batch_and_the_formula_s():
    curve = EntropyTemperature(mean=0.6, std=0.25, low=-1.5, high=4.0, coefficients=(-0.35, 0.16, -0.033))
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(500, 10)) * rng.uniform(0.05, 40, (500, 1))).astype(np.float32)
    u = np.clip((entropy(softmax(logits)) - 0.6) / 0.25, -1.5, 4.0)
    formula = np.exp(-0.35 + 0.16 * u - 0.033 * u * u)
    batch = curve.temperatures(logits)
    alone = [curve.temperatures(row) for row in logits]
    assert all(isinstance(t, float) for t in alone)
    assert np.allclose(batch, formula, rtol=1e-12) and np.allclose(alone, formula, rtol=1e-12)
    assert curve.temperatures(logits[:0]).shape == (0,)


def test_a_curve_that_would_divide_by_zero_or_infinity_is_held_within_the_bounds():
    from vitserve.artifact import TEMPERATURE_BOUNDS

    logits = np.array([[3.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    for c0, bound in ((-900.0, TEMPERATURE_BOUNDS[0]), (900.0, TEMPERATURE_BOUNDS[1])):
        curve = EntropyTemperature(mean=0.5, std=0.2, low=-3.0, high=3.0, coefficients=(c0, 0.0, 0.0))
        assert curve.temperatures(logits) == pytest.approx([bound, bound], rel=1e-12)
        assert curve.temperatures(logits[0]) == pytest.approx(bound, rel=1e-12)
        assert np.isfinite(softmax(logits, curve.temperatures(logits))).all()


def test_a_small_labelled_set_gets_one_temperature_only():
    logits, labels = overconfident(2 * MIN_CURVE_IMAGES - 2, 2.0)
    result = calibrate(logits, labels, "small")
    assert result.temperature_by_entropy is None and result.curve is None
    assert result.ece_after == result.ece_single_temperature


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
    assert info.temperature_by_entropy is None and "vitserve.temperature_by_entropy" not in info.to_metadata()
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


def test_the_curve_survives_the_file_and_a_malformed_one_is_refused(calibrated_export):
    props = dict(calibrated_export.metadata)
    curve = EntropyTemperature(mean=0.6, std=0.2, low=-1.0, high=5.0, coefficients=(-0.35, 0.16, -0.03))
    info = ModelInfo.from_metadata(props)
    again = ModelInfo.from_metadata({**props, **replace(info, temperature_by_entropy=curve).to_metadata()})
    assert again.temperature_by_entropy == curve
    logits = np.array([[2.0, 1.0, 0.5], [9.0, 0.0, 0.0]])
    assert np.allclose(again.probabilities(logits), softmax(logits, curve.temperatures(logits)))
    for bad in ("[]", "{}", '{"mean": 0, "std": 0, "low": 0, "high": 1, "coefficients": [0, 0, 0]}',
                '{"mean": 0, "std": 1, "low": 2, "high": 1, "coefficients": [0, 0, 0]}',
                '{"mean": 0, "std": 1, "low": 0, "high": 1, "coefficients": [0, 0]}',
                '{"mean": 0, "std": 1, "low": 0, "high": 1, "coefficients": [0, "x", 0]}',
                '{"mean": NaN, "std": 1, "low": 0, "high": 1, "coefficients": [0, 0, 0]}', "not json"):
        with pytest.raises(ArtifactError, match="temperature_by_entropy"):
            ModelInfo.from_metadata({**props, "vitserve.temperature_by_entropy": bad})


def test_the_export_command_prints_the_reliability_diagram(tiny_checkpoint, calibration_folder, tmp_path, capsys):
    from vitserve.cli import main

    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "m.onnx"), "--no-verify",
                 "--no-relevance", "--inspection-images", "0", "--eval", str(calibration_folder), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "calibrated: temperature" in out and "fitted on 60 images" in out and "expected calibration error" in out
    assert out.count("|") == 16  # the diagram: a header and 15 bins


def test_an_export_without_a_labelled_set_says_in_one_line_what_its_file_will_serve(tiny_checkpoint,
                                                                                    calibration_folder, tmp_path,
                                                                                    capsys):
    """`vitserve export` without --eval makes a file of uncalibrated scores and no OOD score (unlike the bundled
    model.onnx): it says so on stderr after its summary, and how to get both; with --eval it says nothing of the
    kind."""
    from vitserve.cli import main

    quick = ["--no-verify", "--no-relevance", "--inspection-images", "0", "--quiet"]
    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "plain.onnx"), *quick]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0] == ("vitserve export: no --eval, so the file will serve uncalibrated softmax scores and no "
                      "out-of-distribution score (\"ood\": null); --eval DIR (a labelled set, e.g. "
                      "/usr/share/datasets/fashion-mnist) fits both, as `make export-default` does for the bundled "
                      "model")
    assert all(line.startswith("this CPU") for line in err[1:])  # at most the int8 hint, which says what the CPU does
    plain = onnx.load(str(tmp_path / "plain.onnx"))
    info = ModelInfo.from_metadata({p.key: p.value for p in plain.metadata_props})
    assert (info.temperature, info.calibration, info.ood) == (1.0, {}, {})  # what the line says, in the file

    assert main(["export", str(tiny_checkpoint), "--out", str(tmp_path / "fitted.onnx"), *quick,
                 "--eval", str(calibration_folder)]) == 0
    assert "no --eval" not in capsys.readouterr().err
