"""The out-of-distribution (OOD) score the artifact computes: the squared Mahalanobis distance of the image's
embedding (the class token after the final LayerNorm) to the nearest class mean, under one covariance shared by
the classes (Lee et al. 2018). evaluation/ood.py chose it by measurement (docs/ood.md) with the fit below.

At export (`vitserve export --eval DIR`) the labelled set is cut into the temperature's seeded halves
(export/calibration.py `halves`): the class means and the within-class covariance are fitted on the fit half, and
the threshold (the 99th percentile of the scores: 1% false alarms on images like the labelled ones) and the
quantiles are taken on the other half, which the fit never saw. The graph then computes the score from two stored
arrays (export/ood_graph.py): P, the covariance's pseudo-inverse square root, and M, the class means times P, so that
score(z) = min_c ||z P - M_c||^2.

numpy only: evaluation/ood.py fits its variants with the same function, and the fit must not need the exporter.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from vitserve.export.calibration import MIN_IMAGES, SEED, halves

# Eigenvalues of the covariance below this fraction of the largest are dropped (the pseudo-inverse): a LayerNorm
# output obeys one exact linear constraint (its entries sum to a constant before the affine part), so its covariance
# has rank D - 1 and the smallest eigenvalue is rounding noise.
RCOND = 1e-6
FALSE_ALARM_RATE = 0.01
QUANTILES = (0.5, 0.9, 0.99, 0.999)


class OodFitError(ValueError):
    """The labelled set cannot fit the OOD statistics (too few images, or too few of a class)."""


@dataclass
class Gaussians:
    """Gaussians with one shared covariance, stored as what scoring needs: a whitening projection P (D, k) with
    P P^T = the (pseudo-)inverse of the covariance, and each mean projected, M = means @ P (C, k). The squared
    Mahalanobis distance of z to mean c is then ||z P - M_c||^2."""

    means: np.ndarray  # (C, D), in the embedding space
    projection: np.ndarray  # (D, k)
    projected_means: np.ndarray  # (C, k)
    eigenvalues: np.ndarray  # (D,) of the shared covariance, descending (all of them, kept or not)
    rank: int  # k

    def squared_distances(self, embeddings: np.ndarray) -> np.ndarray:
        """(N, C) squared Mahalanobis distances."""
        projected = np.asarray(embeddings, np.float64) @ self.projection  # (N, k)
        return (np.square(projected).sum(1)[:, None] - 2 * projected @ self.projected_means.T
                + np.square(self.projected_means).sum(1)[None, :])


def fit_gaussians(embeddings: np.ndarray, labels: np.ndarray | None, *, top_k: int | None = None,
                  skip_top: int = 0, shrinkage: float | None = None, rcond: float = RCOND) -> Gaussians:
    """Class means and their shared (within-class) covariance, fitted in float64.

    The export uses the defaults: the pseudo-inverse, dropping eigenvalues below rcond * the largest. The other
    arguments are the variants evaluation/ood.py measured it against: labels=None fits one Gaussian of all
    embeddings (relative Mahalanobis's background); top_k keeps the k largest eigenvalues and skip_top=k drops the k
    largest; shrinkage=a inverts (1 - a) S + a * trace(S) / D * I on all D directions.
    """
    x = np.asarray(embeddings, np.float64)
    y = np.zeros(len(x), np.int64) if labels is None else np.asarray(labels, np.int64)
    classes = np.unique(y)
    means = np.stack([x[y == c].mean(0) for c in classes])
    centred = x - means[np.searchsorted(classes, y)]
    covariance = centred.T @ centred / len(x)
    eigenvalues, vectors = np.linalg.eigh(covariance)
    eigenvalues, vectors = eigenvalues[::-1], vectors[:, ::-1]  # descending
    if shrinkage is not None:
        kept = (1 - shrinkage) * eigenvalues + shrinkage * eigenvalues.sum() / len(eigenvalues)
        keep = np.ones(len(eigenvalues), bool)
    else:
        keep = eigenvalues > rcond * eigenvalues[0]
        if top_k is not None:
            keep &= np.arange(len(eigenvalues)) < top_k
        keep &= np.arange(len(eigenvalues)) >= skip_top
        kept = eigenvalues
    projection = vectors[:, keep] / np.sqrt(kept[keep])
    return Gaussians(means, projection, means @ projection, eigenvalues, int(keep.sum()))


def nearest_class_distance(embeddings: np.ndarray, projection: np.ndarray, projected_means: np.ndarray) -> np.ndarray:
    """(N,) min_c ||z P - M_c||^2 in float64, as the graph computes it (the difference, then its square: no
    cancellation between ||z P||^2 and ||M_c||^2 near a class mean)."""
    projected = np.asarray(embeddings, np.float64) @ np.asarray(projection, np.float64)  # (N, k)
    difference = projected[:, None, :] - np.asarray(projected_means, np.float64)[None]  # (N, C, k)
    return np.square(difference).sum(-1).min(1)


@dataclass(frozen=True)
class OodScore:
    """What the artifact stores: the graph's two arrays (float32) and its metadata (`ModelInfo.ood`)."""

    projection: np.ndarray  # P (D, r)
    projected_means: np.ndarray  # M (K, r), row k for class k
    summary: dict  # score, threshold, quantiles, fit_images, heldout_images, source, rank


def threshold_split(heldout: np.ndarray, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """The held-out images cut in two by a seeded shuffle: (those that set the threshold, those that check it). The
    check images took part in neither the fit nor the threshold, so their false-alarm rate is an honest one."""
    setting, checking = halves(len(heldout), seed + 1)
    return heldout[setting], heldout[checking]


def fit_ood_score(embeddings: np.ndarray, labels: np.ndarray, class_names: list[str], source: str,
                  seed: int = SEED) -> OodScore:
    """Fit the statistics on the fit half of (embeddings (N, D), labels (N,)); of the other half, take the
    threshold (its 99th percentile) on one part and measure its false alarms on the rest (`threshold_split`), and
    the quantiles on all of it. Raises OodFitError when the set is too small for that."""
    labels = np.asarray(labels, np.int64)
    if len(labels) < MIN_IMAGES:
        raise OodFitError(f"no OOD score: {len(labels)} labelled images, fitting one needs at least {MIN_IMAGES}")
    fit, heldout = halves(len(labels), seed)
    counts = np.bincount(labels[fit], minlength=len(class_names))
    if counts.min() < 2:  # a class without a mean would make its own images look foreign
        scarce = int(counts.argmin())
        raise OodFitError(f"no OOD score: class {class_names[scarce]!r} has {counts[scarce]} of the {len(fit)} images "
                          f"the statistics are fitted on, a class mean and its spread need at least 2")
    gaussians = fit_gaussians(embeddings[fit], labels[fit])
    projection = gaussians.projection.astype(np.float32)
    projected_means = gaussians.projected_means.astype(np.float32)
    setting, checking = threshold_split(heldout, seed)
    scores = nearest_class_distance(embeddings[heldout], projection, projected_means)
    threshold = float(np.quantile(nearest_class_distance(embeddings[setting], projection, projected_means),
                                  1.0 - FALSE_ALARM_RATE))
    checked = nearest_class_distance(embeddings[checking], projection, projected_means)
    quantiles = {str(q): float(np.quantile(scores, q)) for q in QUANTILES}
    summary = {"score": "mahalanobis", "threshold": threshold, "quantiles": quantiles, "fit_images": len(fit),
               "heldout_images": len(heldout), "threshold_images": len(setting), "check_images": len(checking),
               "false_alarm_rate": float(np.mean(checked > threshold)), "source": source, "rank": gaussians.rank}
    return OodScore(projection, projected_means, summary)
