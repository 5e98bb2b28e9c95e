"""Temperature scaling at export (Guo et al. 2017, "On Calibration of Modern Neural Networks"): a temperature T,
fitted on held-out labelled images, that turns the logits' softmax into probabilities that mean what they say (of
the answers given with 80% confidence, about 80% right). Dividing an answer's logits by a T > 0 changes none of
its ranking: top-1, top-k and accuracy stay exactly as they were; only the scores move.

Two fits, both by minimising the negative log-likelihood: one number T for every answer (`fit_temperature`), and
a temperature per answer set by the entropy of its raw softmax (`fit_entropy_temperature`; the form is
vitserve.artifact.EntropyTemperature), in the spirit of the sample-dependent temperatures of Balanya et al. 2022
(arXiv 2208.00461) and Joy et al. 2023 (arXiv 2207.06211). One T moves every confidence the same way; a model
trained with label smoothing, like the default one, is under-confident where it is sure and over-confident in the
middle at once, which the curve fixes and one T cannot (docs/calibration.md: 1.55% against 1.37% on the same
held-out images). The curve has the single T as its special case (c1 = c2 = 0) and is fitted from it; the file
stores both, the server uses the curve. It needs `MIN_CURVE_IMAGES` to fit three numbers, fewer gets one T.

The labelled set (`vitserve export --eval DIR`) is split in two by a seeded shuffle: both are fitted on one half
(`fit`), and the expected calibration error before and after is measured on the other half (`report`), so the
figures in the file and in the report come from images the fit never saw. The logits are the float32 graph's (the
one every precision is verified against), through ONNX Runtime, as the server computes them.

numpy and scipy only (the export install has both); the server reads the stored T through vitserve/artifact.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from vitserve.artifact import TEMPERATURE_BOUNDS, EntropyTemperature, curve_log_temperatures, softmax, softmax_entropy

BINS = 15  # equal-width confidence bins, as Guo et al. report ECE
SEED = 0
MIN_IMAGES = 100  # fewer and the halves' estimates are noise (the export then leaves the file uncalibrated)
MIN_CURVE_IMAGES = 1000  # fit-half images the entropy curve's three numbers need; fewer: one temperature
# log T is searched within the temperatures a file may use; a fit at a bound says the labelled set does not fit the
# model (its labels, or its images)
LOG_T_BOUNDS = tuple(float(np.log(t)) for t in TEMPERATURE_BOUNDS)


class CalibrationError(ValueError):
    """The labelled set cannot calibrate this model (too few images)."""


@dataclass(frozen=True)
class ReliabilityBin:
    """One confidence bin: its range, how many answers fell in it, their mean confidence and their accuracy."""

    low: float
    high: float
    count: int
    confidence: float | None
    accuracy: float | None


@dataclass(frozen=True)
class Calibration:
    """The fitted temperature and what it did, measured on the half it was not fitted on."""

    source: str
    temperature: float  # the single T (kept in the file for readers that know no curve)
    temperature_by_entropy: dict | None  # EntropyTemperature.to_json(), the served calibration; None: one T
    fit_images: int
    report_images: int
    accuracy: float  # top-1 on the report half: the same before and after, by construction
    ece_before: float
    ece_after: float  # with the served calibration (the curve where there is one)
    ece_single_temperature: float  # with the single T, for comparison
    nll_before: float
    nll_after: float
    bins_before: tuple[ReliabilityBin, ...]
    bins_after: tuple[ReliabilityBin, ...]

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """What the file's metadata keeps (vitserve.calibration): the figures, without the bins (and without the
        curve, which has its own key)."""
        return {key: value for key, value in self.to_json().items()
                if not key.startswith("bins_") and key != "temperature_by_entropy"}

    @property
    def curve(self) -> EntropyTemperature | None:
        curve = self.temperature_by_entropy
        return None if curve is None else EntropyTemperature.from_json(curve)


def negative_log_likelihood(logits: np.ndarray, labels: np.ndarray, temperature: float | np.ndarray) -> float:
    """Mean -log p(label) under softmax(logits / temperature); one temperature, or one per row."""
    scaled = np.asarray(logits, np.float64) / np.expand_dims(np.asarray(temperature, np.float64), -1)
    shifted = scaled - scaled.max(axis=1, keepdims=True)
    log_norm = np.log(np.exp(shifted).sum(axis=1))
    return float(np.mean(log_norm - shifted[np.arange(len(labels)), labels]))


def reliability(probabilities: np.ndarray, labels: np.ndarray, bins: int = BINS) -> tuple[float, list[ReliabilityBin]]:
    """Expected calibration error (the count-weighted mean |accuracy - confidence| over the bins of top-1
    confidence) and the bins themselves, the reliability diagram's data."""
    confidence = probabilities.max(axis=1)
    correct = probabilities.argmax(axis=1) == labels
    edges = np.linspace(0.0, 1.0, bins + 1)
    # bin i holds (edges[i], edges[i+1]]; a confidence of exactly 0 cannot happen with K >= 1 classes
    which = np.clip(np.searchsorted(edges, confidence, side="left") - 1, 0, bins - 1)
    table, ece = [], 0.0
    for i in range(bins):
        inside = which == i
        count = int(inside.sum())
        if count:
            conf, acc = float(confidence[inside].mean()), float(correct[inside].mean())
            ece += count / len(labels) * abs(acc - conf)
            table.append(ReliabilityBin(float(edges[i]), float(edges[i + 1]), count, conf, acc))
        else:
            table.append(ReliabilityBin(float(edges[i]), float(edges[i + 1]), 0, None, None))
    return float(ece), table


def fit_temperature(logits: np.ndarray, labels: np.ndarray) -> float:
    """The T > 0 that minimises the negative log-likelihood of `labels` under softmax(logits / T): a convex
    problem in 1/T, solved over log T by bounded scalar minimisation."""
    from scipy.optimize import minimize_scalar

    found = minimize_scalar(lambda log_t: negative_log_likelihood(logits, labels, float(np.exp(log_t))),
                            bounds=LOG_T_BOUNDS, method="bounded", options={"xatol": 1e-6})
    return float(np.exp(found.x))


def fit_entropy_temperature(logits: np.ndarray, labels: np.ndarray, start: float) -> EntropyTemperature:
    """The curve (vitserve.artifact.EntropyTemperature) that minimises the negative log-likelihood of `labels`,
    searched from the single temperature `start` (c0 = log start, c1 = c2 = 0), so it is never worse on these
    images than that T."""
    from scipy.optimize import minimize

    raw = softmax_entropy(logits)
    mean, std = float(raw.mean()), float(raw.std()) or 1.0
    standard = (raw - mean) / std  # within [low, high] by construction: the served curve's clip changes nothing here
    low, high = float(standard.min()), float(standard.max())

    def loss(c: np.ndarray) -> float:
        return negative_log_likelihood(logits, labels, np.exp(curve_log_temperatures(c, standard)))

    found = minimize(loss, np.array([np.log(start), 0.0, 0.0]), method="Nelder-Mead",
                     options={"xatol": 1e-7, "fatol": 1e-10, "maxiter": 4000})
    best = found.x if found.fun <= loss(np.array([np.log(start), 0.0, 0.0])) else [np.log(start), 0.0, 0.0]
    c0, c1, c2 = (round(float(c), 8) for c in best)
    return EntropyTemperature(mean=round(mean, 8), std=round(std, 8), low=round(low, 6), high=round(high, 6),
                              coefficients=(c0, c1, c2))


def halves(count: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(fit indices, report indices): a seeded shuffle cut in two, each sorted."""
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[: count // 2]), np.sort(order[count // 2:])


def calibrate(logits: np.ndarray, labels: np.ndarray, source: str, seed: int = SEED) -> Calibration:
    """Fit T on one half of (logits, labels) and measure it on the other."""
    logits, labels = np.asarray(logits), np.asarray(labels, np.int64)
    if len(labels) < MIN_IMAGES:
        raise CalibrationError(f"{source}: {len(labels)} labelled images; calibrating needs at least {MIN_IMAGES}")
    fit, report = halves(len(labels), seed)
    temperature = round(fit_temperature(logits[fit], labels[fit]), 6)
    curve = fit_entropy_temperature(logits[fit], labels[fit], temperature) if len(fit) >= MIN_CURVE_IMAGES else None
    served = temperature if curve is None else curve.temperatures(logits[report])
    before, after = softmax(logits[report]), softmax(logits[report], served)
    ece_before, bins_before = reliability(before, labels[report])
    ece_after, bins_after = reliability(after, labels[report])
    return Calibration(
        source=source, temperature=temperature, temperature_by_entropy=None if curve is None else curve.to_json(),
        fit_images=len(fit), report_images=len(report),
        accuracy=float((before.argmax(axis=1) == labels[report]).mean()),
        ece_before=ece_before, ece_after=ece_after,
        ece_single_temperature=reliability(softmax(logits[report], temperature), labels[report])[0],
        nll_before=negative_log_likelihood(logits[report], labels[report], 1.0),
        nll_after=negative_log_likelihood(logits[report], labels[report], served),
        bins_before=tuple(bins_before), bins_after=tuple(bins_after))


def graph_logits(session, images: np.ndarray, mean: list[float], std: list[float], batch: int = 250) -> np.ndarray:
    """The float32 graph's logits for uint8 (N, C, H, W) images, through an ONNX Runtime session of its fast
    path (inputs: the pixels only)."""
    from vitserve.artifact import OUTPUT_NAMES

    return graph_outputs(session, images, mean, std, [OUTPUT_NAMES[0]], batch)[0]


def graph_outputs(session, images: np.ndarray, mean: list[float], std: list[float], names: list[str],
                  batch: int = 250) -> list[np.ndarray]:
    """The named outputs of the graph's fast path for uint8 (N, C, H, W) images, each over all N images."""
    from vitserve.artifact import INPUT_NAME, normalize_pixels

    runs = [session.run(names, {INPUT_NAME: normalize_pixels(images[i:i + batch], mean, std)})
            for i in range(0, len(images), batch)]
    return [np.concatenate([run[k] for run in runs]) for k in range(len(names))]
