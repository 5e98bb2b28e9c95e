"""The int8 file's verification: an accuracy gate against the float32 graph, not an elementwise tolerance (int8
weights move every logit a little; what must not move is the decision).

- top-1 agreement with float32 on a labelled set (`--eval DIR`) and on real photos at every verification size
  (clear calls only: a photo whose float32 top-2 margin is within INT8_TIE_RTOL of its largest |logit| is a tie
  that int8 may flip);
- accuracy on the labelled set within `max_accuracy_drop` of float32's;
- the maps: the rank correlation (Spearman) of each image's rollout, and of its relevance map when the file has
  the relevance path, with float32's: reported, since a map that ranks the same patches first says the same.

The labelled set: the Fashion-MNIST test split when DIR holds its idx files (Debian's dataset-fashion-mnist), or
DIR/<label>/<image> with folder names among the model's labels.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, RELEVANCE_NAME, TARGET_NAME, TOP1_TARGET, normalize_pixels
from vitserve.export.verify import ExportVerificationError, cpu_session, photo_batch, verification_sizes

INT8_TIE_RTOL = 0.05
DEFAULT_MIN_AGREEMENT = 0.99
DEFAULT_MAX_ACCURACY_DROP = 0.003  # 0.3 point
# The photos check that every resolution works in int8 (a graph broken at another size agrees on few of them). They
# lie outside a model's training distribution, where static scales calibrated on its data clip more: the default
# model's static file agreed on 62-63 of 64 clear photos (0.969-0.984) while agreeing on 99.7% of Fashion-MNIST's
# test images. The labelled set is the accuracy criterion; the photos a sanity floor.
MIN_PHOTO_AGREEMENT = 0.95
MAX_EVAL_IMAGES = 50_000
EVAL_SUFFIXES = {".png", ".jpg", ".jpeg", ".webp", ".bmp"}
MAP_SAMPLE = 256  # images whose maps are compared (every image's logits are)
BATCH = 250


@dataclass
class LabelledSet:
    source: str
    images: np.ndarray  # uint8 (N, C, H, W) at the model's trained size
    labels: np.ndarray  # int64 (N,), indices into the model's labels


@dataclass
class Int8Report:
    source: str  # what the agreement and accuracy were measured on
    images: int
    top1_agreement: float
    fp32_accuracy: float | None
    int8_accuracy: float | None
    photo_agreement: float
    photos: int
    photo_ties: int
    rollout_spearman_mean: float
    rollout_spearman_min: float
    relevance_spearman_mean: float | None = None
    relevance_spearman_min: float | None = None
    gate: dict = field(default_factory=dict)


class EvalSetError(ValueError):
    """`--eval` names no labelled set this model can be measured on: the caller's mistake, found before the export
    starts (a usage error, not a failed verification)."""


def load_labelled_set(directory: str | Path, labels: list[str], channels: int, size: tuple[int, int],
                      limit: int | None = None) -> LabelledSet:
    """The Fashion-MNIST test split (DIR with its idx files) or DIR/<label>/<image>, at the trained size;
    EvalSetError naming what is wrong with DIR."""
    from vitserve.model.data import load_fashion_mnist, load_image, resize_batch

    root = Path(directory)
    if not root.is_dir():
        raise EvalSetError(f"--eval {directory}: not a directory")
    if limit is not None and limit < 1:
        raise EvalSetError(f"--eval-limit {limit}: give a positive count")
    limit = min(limit or MAX_EVAL_IMAGES, MAX_EVAL_IMAGES)
    if any(root.glob("t10k-images-idx3-ubyte*")):
        test = load_fashion_mnist(root).test
        if [label.lower() for label in test.classes] != [label.lower() for label in labels]:
            raise EvalSetError(f"--eval {directory} is Fashion-MNIST, but the model's labels are {labels}")
        resized = resize_batch(test.images[:limit], size).numpy()
        resized = np.repeat(resized, channels, axis=1) if channels != resized.shape[1] else resized
        return LabelledSet(f"Fashion-MNIST test split ({root})", resized, test.labels[:limit].numpy())
    index = {label.lower(): i for i, label in enumerate(labels)}
    folders = sorted(p for p in root.iterdir() if p.is_dir())
    unknown = [p.name for p in folders if p.name.lower() not in index]
    if unknown or not folders:
        raise EvalSetError(f"--eval {directory}: folders must be named after the model's labels "
                           f"({labels}); {'unknown: ' + str(unknown) if unknown else 'none found'}")
    images: list[np.ndarray] = []
    targets: list[int] = []
    for folder in folders:
        for path in sorted(folder.iterdir()):
            if path.suffix.lower() in EVAL_SUFFIXES and path.is_file() and len(images) < limit:
                images.append(load_image(path, size, channels))
                targets.append(index[folder.name.lower()])
    if not images:
        raise EvalSetError(f"--eval {directory}: no images ({', '.join(sorted(EVAL_SUFFIXES))})")
    return LabelledSet(f"{root} ({len(folders)} classes)", np.stack(images), np.asarray(targets, np.int64))


def spearman(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Spearman's rank correlation of each pair of maps (N, h, w) -> (N,); 1.0 where a map is constant."""
    from scipy.stats import spearmanr

    def constant(m: np.ndarray) -> bool:  # no ranks to correlate: scipy warns and gives nan
        return bool(np.all(m == m.flat[0]))

    rho = [1.0 if constant(x) or constant(y) else spearmanr(x.ravel(), y.ravel()).statistic for x, y in zip(a, b)]
    return np.nan_to_num(np.asarray(rho, np.float64), nan=1.0)


def _run(session, pixels: np.ndarray, outputs=OUTPUT_NAMES, targets: np.ndarray | None = None) -> list[np.ndarray]:
    feeds = {INPUT_NAME: pixels} if targets is None else {INPUT_NAME: pixels, TARGET_NAME: targets}
    return session.run(list(outputs), feeds)


def verify_int8(int8_model: str | onnx.ModelProto, fp32_model: str | onnx.ModelProto, *, mean: list[float],
                std: list[float], channels: int, image_size: tuple[int, int], patch: int,
                labelled: LabelledSet | None, min_agreement: float = DEFAULT_MIN_AGREEMENT,
                max_accuracy_drop: float = DEFAULT_MAX_ACCURACY_DROP) -> Int8Report:
    """The gate (module doc); raises ExportVerificationError with the numbers when the int8 file misses it.
    `fp32_model` is the float32 artifact with the same outputs (the relevance path too, if the int8 file has it)."""
    int8, fp32 = cpu_session(int8_model), cpu_session(fp32_model)
    explains = RELEVANCE_NAME in [o.name for o in int8.get_outputs()]

    # photos at every verification size: the dynamic shapes hold in int8 too
    photo_logits = []
    for size in verification_sizes(image_size, patch):
        x = photo_batch(channels, size, mean, std)
        (q, _), (f, _) = _run(int8, x), _run(fp32, x)
        photo_logits.append((q, f))
    q, f = (np.concatenate([p[k] for p in photo_logits]) for k in (0, 1))
    top2 = np.sort(f, axis=1)[:, -2:]
    clear = (top2[:, 1] - top2[:, 0]) > INT8_TIE_RTOL * np.abs(f).max(axis=1).clip(min=1.0)
    photo_agreement = float((q.argmax(1) == f.argmax(1))[clear].mean()) if clear.any() else 1.0

    batches: Iterable[np.ndarray]
    if labelled is not None:
        source = labelled.source
        batches = (normalize_pixels(labelled.images[start:start + BATCH], mean, std, channel_axis=1)
                   for start in range(0, len(labelled.images), BATCH))
    else:  # no labelled set: the photos at the trained size are all there is
        source, batches = "scikit-image photos (no --eval set)", [photo_batch(channels, image_size, mean, std)]
    q_logits: list[np.ndarray] = []
    f_logits: list[np.ndarray] = []
    q_maps: list[np.ndarray] = []
    f_maps: list[np.ndarray] = []
    map_batches: list[np.ndarray] = []
    for x in batches:
        (ql, qr), (fl, fr) = _run(int8, x), _run(fp32, x)
        q_logits.append(ql)
        f_logits.append(fl)
        if sum(len(m) for m in q_maps) < MAP_SAMPLE:  # the maps of the first images are compared
            q_maps.append(qr)
            f_maps.append(fr)
            map_batches.append(x)
    map_pixels = np.concatenate(map_batches)[:MAP_SAMPLE]
    ql, fl = np.concatenate(q_logits), np.concatenate(f_logits)
    rollout_rho = spearman(np.concatenate(q_maps)[:MAP_SAMPLE], np.concatenate(f_maps)[:MAP_SAMPLE])
    report = Int8Report(source, len(ql), float((ql.argmax(1) == fl.argmax(1)).mean()), None, None,
                        photo_agreement, len(q), int((~clear).sum()), float(rollout_rho.mean()),
                        float(rollout_rho.min()),
                        gate={"min_top1_agreement": min_agreement, "max_accuracy_drop": max_accuracy_drop})
    if labelled is not None:
        report.fp32_accuracy = float((fl.argmax(1) == labelled.labels).mean())
        report.int8_accuracy = float((ql.argmax(1) == labelled.labels).mean())
    if explains:
        targets = np.full(min(len(map_pixels), 64), TOP1_TARGET, np.int64)
        x = map_pixels[:len(targets)]
        q_rel = _run(int8, x, (*OUTPUT_NAMES, RELEVANCE_NAME), targets)[2]
        f_rel = _run(fp32, x, (*OUTPUT_NAMES, RELEVANCE_NAME), targets)[2]
        relevance_rho = spearman(q_rel, f_rel)
        report.relevance_spearman_mean, report.relevance_spearman_min = (float(relevance_rho.mean()),
                                                                         float(relevance_rho.min()))
    misses = []
    if report.top1_agreement < min_agreement:
        misses.append(f"top-1 agreement with fp32 {report.top1_agreement:.4f} < {min_agreement} on {source}")
    if report.photo_agreement < min(min_agreement, MIN_PHOTO_AGREEMENT):
        misses.append(f"top-1 agreement on clear photos {report.photo_agreement:.4f} < "
                      f"{min(min_agreement, MIN_PHOTO_AGREEMENT)}")
    if report.fp32_accuracy is not None and report.int8_accuracy is not None \
            and report.fp32_accuracy - report.int8_accuracy > max_accuracy_drop:
        misses.append(f"accuracy {report.int8_accuracy:.4f} against fp32's {report.fp32_accuracy:.4f} (more than "
                      f"{max_accuracy_drop:.4f} lower)")
    if misses:
        raise ExportVerificationError("the int8 file misses the accuracy gate: " + "; ".join(misses))
    return report
