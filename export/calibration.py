"""Temperature scaling at export (Guo et al. 2017, "On Calibration of Modern Neural Networks"): one number T,
fitted on held-out labelled images, that turns the logits' softmax into probabilities that mean what they say (of
the answers given with 80% confidence, about 80% right). Dividing every logit by the same T > 0 changes no
ranking: top-1, top-k and accuracy stay exactly as they were; only the scores move.

The labelled set (`vitserve export --eval DIR`) is split in two by a seeded shuffle: T is fitted on one half
(`fit`) by minimising the negative log-likelihood, and the expected calibration error before and after is
measured on the other half (`report`), so the figures in the file and in the report come from images T never saw.
The logits are the float32 graph's (the one every precision is verified against), through ONNX Runtime, as the
server computes them.

numpy and scipy only (the export install has both); the server reads the stored T through vitserve/artifact.py.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

BINS = 15  # equal-width confidence bins, as Guo et al. report ECE
SEED = 0
MIN_IMAGES = 100  # fewer and the halves' estimates are noise (the export then leaves the file uncalibrated)
# log T is searched within these bounds: T from 0.05 to 20 covers any network's over- or under-confidence; a fit
# at a bound says the labelled set does not fit the model (its labels, or its images)
LOG_T_BOUNDS = (float(np.log(0.05)), float(np.log(20.0)))


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
    temperature: float
    fit_images: int
    report_images: int
    accuracy: float  # top-1 on the report half: the same before and after, by construction
    ece_before: float
    ece_after: float
    nll_before: float
    nll_after: float
    bins_before: tuple[ReliabilityBin, ...]
    bins_after: tuple[ReliabilityBin, ...]

    def to_json(self) -> dict:
        return asdict(self)

    def summary(self) -> dict:
        """What the file's metadata keeps (vitserve.calibration): the figures, without the bins."""
        return {key: value for key, value in self.to_json().items() if not key.startswith("bins_")}


def softmax(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """(N, K) logits -> probabilities of softmax(logits / T), in float64."""
    scaled = np.asarray(logits, np.float64) / temperature
    scaled -= scaled.max(axis=1, keepdims=True)
    exp = np.exp(scaled)
    return exp / exp.sum(axis=1, keepdims=True)


def negative_log_likelihood(logits: np.ndarray, labels: np.ndarray, temperature: float) -> float:
    scaled = np.asarray(logits, np.float64) / temperature
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
    temperature = fit_temperature(logits[fit], labels[fit])
    before, after = softmax(logits[report]), softmax(logits[report], temperature)
    ece_before, bins_before = reliability(before, labels[report])
    ece_after, bins_after = reliability(after, labels[report])
    return Calibration(
        source=source, temperature=round(temperature, 6), fit_images=len(fit), report_images=len(report),
        accuracy=float((before.argmax(axis=1) == labels[report]).mean()),
        ece_before=ece_before, ece_after=ece_after,
        nll_before=negative_log_likelihood(logits[report], labels[report], 1.0),
        nll_after=negative_log_likelihood(logits[report], labels[report], temperature),
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
