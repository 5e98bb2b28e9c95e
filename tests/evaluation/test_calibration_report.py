"""evaluation/calibration.py's reference figures: the bootstrap interval of an ECE and the best temperature the
scored images themselves would pick."""
from __future__ import annotations

import numpy as np

from vitserve.evaluation.calibration import best_temperature, ece_interval
from vitserve.export.calibration import reliability, softmax


def synthetic(count: int = 4000, sharpness: float = 2.0, seed: int = 0):
    """Logits whose softmax is calibrated at temperature 1/sharpness: labels drawn from softmax(logits*sharpness)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(count, 5)) * 2
    probabilities = softmax(logits * sharpness)
    labels = np.array([rng.choice(5, p=p) for p in probabilities])
    return logits, labels


def test_the_best_temperature_is_found_and_is_no_worse_than_any_other():
    logits, labels = synthetic()
    oracle = best_temperature(logits, labels)
    assert abs(oracle["temperature"] - 0.5) < 0.1  # the labels were drawn at T = 1/2
    for temperature in (0.3, 0.5, 1.0, 2.0):
        assert oracle["ece"] <= reliability(softmax(logits, temperature), labels)[0] + 1e-12


def test_the_interval_holds_a_miscalibrated_sample_s_ece_and_narrows_with_more_images():
    logits, labels = synthetic()
    ece = reliability(softmax(logits, 1.0), labels)[0]  # too flat: a real error, well above the sampling noise
    low, high = ece_interval(logits, labels, 1.0, draws=200)
    assert low <= ece <= high and low > 0.05
    small_low, small_high = ece_interval(logits[:500], labels[:500], 1.0, draws=200)
    assert small_high - small_low > high - low
