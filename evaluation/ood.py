"""`python -m vitserve.evaluation.ood --out docs/ood.md`: which out-of-distribution (OOD) score should the service use?

A classifier answers every input with one of its classes, however foreign the input: the default model calls a
photo of a cat, a handwritten-looking "7" or a field of noise a garment, often with high confidence. Before the
service can say "this is not a Fashion-MNIST image" it needs a score that is higher for foreign inputs than for
garments, and a threshold on it that refuses few real garments (a false-alarm rate of 1%). The literature offers
several scores that cost almost nothing at serving time; which one works depends on the model, so this module
measures them on the default model rather than picking one by reputation:

- from the 10 logits the graph already outputs: (a) `msp`, 1 - the maximum softmax probability (Hendrycks &
  Gimpel 2017); (b) `energy`, -logsumexp(logits), the free energy (Liu et al. 2020);
- from the class token after the final LayerNorm (the 128-d embedding the head reads): (c) `maha`, the squared
  Mahalanobis distance to the nearest class mean under one shared (tied) covariance (Lee et al. 2018), with the
  covariance pseudo-inverted (a LayerNorm output obeys one exact linear constraint, so its covariance is
  singular), shrunk, or cut to its top-k principal components (`maha-top{k}`); (d) `rel-maha`, the relative
  Mahalanobis distance (Ren et al. 2021: minus the distance to one Gaussian of all training embeddings), and
  `maha-l2`, Mahalanobis on L2-normalised embeddings (Mueller & Hein 2025).

In-distribution (ID): the 10,000 Fashion-MNIST test images. Everything fitted (class means, covariances) is fitted
on the 60,000 training images only. OOD sets, built deterministically from seeds: crops of scikit-image's photos,
digits drawn with Pillow's font, uniform and Gaussian noise, and inverted test garments. Reported: each score's
AUROC per OOD set and pooled; for each score the threshold at the 99th percentile of ID scores on a seeded half of
the test set (the calibration half), the false-alarm rate on the other half and the detection rate of every OOD set.
The logits come from ONNX Runtime on the served file; the embeddings from PyTorch on its checkpoint (the file does
not output them), and the head applied to those embeddings is checked against the file's logits.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

if __name__ == "__main__":  # a one-core measurement: NumPy's BLAS must not start threads (read when NumPy loads)
    for _variable in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(_variable, "1")

import numpy as np  # noqa: E402

from vitserve.export.ood import Gaussians, fit_gaussians  # noqa: E402  (the fit the export ships)

SEED = 0
# The drift alert (docker/prometheus/rules/vitserve.rules.yml VitserveInputDrift) fires when more than this share of a
# model's images over 30 minutes score above the threshold: vitserve:ood_outside_ratio_objective in
# docker/prometheus/rules/objectives.rules.yml (tests/evaluation checks that the two agree).
DRIFT_ALERT_SHARE = 0.05
# ... and only over at least this many images (vitserve:ood_alert_min_images): fewer windows cannot raise it.
DRIFT_ALERT_MIN_IMAGES = 250
ALERT_WINDOWS = (50, 100, 250, 1000)  # images per 30-minute window: from a quiet model's traffic to a busy one's
DEFAULT_MODEL = Path("models/vit-fmnist/model.onnx")
DEFAULT_CHECKPOINT = Path("models/vit-fmnist/checkpoint")
DEFAULT_STATS_DIR = Path("build/ood")
FALSE_ALARM_RATE = 0.01
TARGET_AUROC = 0.95
# skimage.data images that ship with scikit-image (no download): export/verify.py's photos, and the horse silhouette.
PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry", "retina",
          "camera", "moon", "coins", "page", "text", "clock", "grass", "gravel", "brick", "cell", "horse")
TOP_K = (8, 16, 32, 64)  # maha-top{k}: only the k largest principal directions of the shared covariance
TAIL_SKIP = (16, 32, 64)  # maha-tail{k}: all but the k largest
SHRINKAGE = 0.1
# Scores with no parameter that would have to be chosen on OOD data: the recommendation is made among these.
# The others (a rank k, a shrinkage) are measured to show where the signal lies; adopting one would need its
# parameter chosen on OOD images other than those it is then judged on.
PARAMETER_FREE = ("msp", "energy", "maha", "rel-maha", "maha-l2")


# ---------------------------------------------------------------------------------------------------- OOD sets
def _grey_uint8(array: np.ndarray) -> np.ndarray:
    """Any skimage.data image (bool, float, grey, RGB, RGBA) as uint8 (H, W)."""
    from PIL import Image

    array = np.asarray(array)
    if array.dtype == bool:
        array = array.astype(np.uint8) * 255
    elif array.dtype != np.uint8:
        lo, hi = float(array.min()), float(array.max())
        array = np.round((array - lo) / max(hi - lo, 1e-12) * 255).astype(np.uint8)
    if array.ndim == 3:
        array = np.asarray(Image.fromarray(array[..., :3]).convert("L"))
    return array


def load_photos(names: tuple[str, ...] = PHOTOS) -> dict[str, np.ndarray]:
    """{name: uint8 (H, W)} for every named skimage.data photo that loads offline (the others are left out)."""
    import skimage.data

    photos = {}
    for name in names:
        try:
            photos[name] = _grey_uint8(getattr(skimage.data, name)())
        except Exception:  # noqa: BLE001 - a photo that needs a download (pooch) or is gone from this version
            continue
    if not photos:
        raise RuntimeError("no scikit-image photo loaded; install scikit-image")
    return photos


def photo_crops(count: int, seed: int, size: tuple[int, int] = (28, 28),
                photos: dict[str, np.ndarray] | None = None, min_side: int = 16) -> np.ndarray:
    """Square crops of random side (min_side to the photo's short side) at random places in random photos,
    resized (bicubic, antialiased by Pillow when shrinking) to `size`: uint8 (count, 1, H, W)."""
    from PIL import Image

    photos = load_photos() if photos is None else photos
    names = sorted(photos)
    rng = np.random.default_rng(seed)
    out = np.empty((count, 1, *size), np.uint8)
    for i in range(count):
        photo = photos[names[rng.integers(len(names))]]
        h, w = photo.shape
        side = int(rng.integers(min(min_side, min(h, w)), min(h, w) + 1))
        top, left = int(rng.integers(h - side + 1)), int(rng.integers(w - side + 1))
        crop = Image.fromarray(photo[top:top + side, left:left + side])
        out[i, 0] = np.asarray(crop.resize((size[1], size[0]), Image.Resampling.BICUBIC))
    return out


def font_digits(count: int, seed: int, size: tuple[int, int] = (28, 28)) -> np.ndarray:
    """Digits 0-9 drawn with Pillow's own font (ImageFont.load_default(size=...), FreeType), white on black as
    Fashion-MNIST is: random font size and stroke width (0-2), rotation within +-25 degrees, glyph height 12 to 24
    pixels, random position: uint8 (count, 1, H, W)."""
    from PIL import Image, ImageDraw, ImageFont

    rng = np.random.default_rng(seed)
    fonts: dict[int, ImageFont.FreeTypeFont | ImageFont.ImageFont] = {}
    out = np.zeros((count, 1, *size), np.uint8)
    for i in range(count):
        font_size = int(rng.integers(24, 49))
        font = fonts.setdefault(font_size, ImageFont.load_default(size=font_size))
        canvas = Image.new("L", (96, 96), 0)
        ImageDraw.Draw(canvas).text((48, 48), str(int(rng.integers(10))), fill=255, font=font, anchor="mm",
                                    stroke_width=int(rng.integers(0, 3)), stroke_fill=255)
        canvas = canvas.rotate(float(rng.uniform(-25, 25)), resample=Image.Resampling.BILINEAR)
        glyph = canvas.crop(canvas.getbbox())
        height = int(rng.integers(12, min(24, size[0] - 2) + 1))
        width = max(1, min(size[1] - 2, round(glyph.width * height / glyph.height)))
        glyph = glyph.resize((width, height), Image.Resampling.LANCZOS)
        top, left = int(rng.integers(size[0] - height + 1)), int(rng.integers(size[1] - width + 1))
        image = Image.new("L", (size[1], size[0]), 0)
        image.paste(glyph, (left, top))
        out[i, 0] = np.asarray(image)
    return out


def uniform_noise(count: int, seed: int, size: tuple[int, int] = (28, 28)) -> np.ndarray:
    """Every pixel uniform on 0..255: uint8 (count, 1, H, W)."""
    return np.random.default_rng(seed).integers(0, 256, (count, 1, *size), dtype=np.uint8)


def gaussian_noise(count: int, seed: int, size: tuple[int, int] = (28, 28)) -> np.ndarray:
    """Per image a mean in [32, 224] and a standard deviation in [16, 96]; pixels i.i.d. normal around them,
    rounded and clipped to 0..255: uint8 (count, 1, H, W)."""
    rng = np.random.default_rng(seed)
    mean = rng.uniform(32, 224, (count, 1, 1, 1))
    std = rng.uniform(16, 96, (count, 1, 1, 1))
    return np.clip(np.round(rng.normal(mean, std, (count, 1, *size))), 0, 255).astype(np.uint8)


def inverted_garments(images: np.ndarray, count: int, seed: int) -> np.ndarray:
    """255 - a seeded sample of `count` of `images` (uint8 (N, 1, H, W)): garments, black on white."""
    index = np.sort(np.random.default_rng(seed).choice(len(images), size=min(count, len(images)), replace=False))
    return 255 - images[index]


def build_ood_sets(test_images: np.ndarray, count: int = 2000, noise_count: int = 1000, seed: int = SEED,
                   size: tuple[int, int] = (28, 28)) -> dict[str, np.ndarray]:
    """{set name: uint8 (N, 1, H, W)}; each set has its own seed (seed + its position) so sets are independent."""
    return {"photos": photo_crops(count, seed + 1, size),
            "digits": font_digits(count, seed + 2, size),
            "uniform noise": uniform_noise(noise_count, seed + 3, size),
            "gaussian noise": gaussian_noise(noise_count, seed + 4, size),
            "inverted": inverted_garments(test_images, count, seed + 5)}


# ---------------------------------------------------------------------------------------------------- features
def onnx_logits(session, images: np.ndarray, mean: list[float], std: list[float], batch: int = 250) -> np.ndarray:
    """The served graph's logits (N, K) for uint8 (N, C, H, W) images, through its fast path (pixels only)."""
    from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, normalize_pixels

    return np.concatenate([session.run([OUTPUT_NAMES[0]], {INPUT_NAME: normalize_pixels(images[i:i + batch], mean,
                                                                                         std)})[0]
                           for i in range(0, len(images), batch)])


def class_token_embeddings(vit, images: np.ndarray, mean: list[float], std: list[float],
                           batch: int = 250) -> tuple[np.ndarray, np.ndarray]:
    """(embeddings (N, D), PyTorch logits (N, K)): the class token after the final LayerNorm, before the head (and
    pre_logits), and the head applied to it."""
    import torch

    from vitserve.artifact import normalize_pixels

    embeddings, logits = [], []
    with torch.inference_mode():
        for i in range(0, len(images), batch):
            tokens, _ = vit.forward_features(torch.from_numpy(normalize_pixels(images[i:i + batch], mean, std)))
            embeddings.append(tokens[:, 0].numpy().copy())
            logits.append(vit.forward_head(tokens).numpy())
    return np.concatenate(embeddings), np.concatenate(logits)


# ---------------------------------------------------------------------------------------------------- scores
def msp_score(logits: np.ndarray) -> np.ndarray:
    """1 - max softmax probability (float64); higher = more OOD."""
    z = np.asarray(logits, np.float64)
    z = z - z.max(axis=1, keepdims=True)
    return 1.0 - 1.0 / np.exp(z).sum(axis=1)  # the top class's probability is exp(0) / sum


def energy_score(logits: np.ndarray, temperature: float = 1.0) -> np.ndarray:
    """The free energy -T * logsumexp(logits / T) (float64); higher = more OOD."""
    z = np.asarray(logits, np.float64) / temperature
    top = z.max(axis=1)
    return -temperature * (top + np.log(np.exp(z - top[:, None]).sum(axis=1)))


def serving_score(embeddings: np.ndarray, projection: np.ndarray, projected_means: np.ndarray) -> np.ndarray:
    """The shipped Mahalanobis score in float32 from the shipped arrays: min_c ||z P - M_c||^2, expanded as
    ||z P||^2 - 2 (z P) . M_c + ||M_c||^2 (one (D, k) and one (k, C) product per batch)."""
    d = np.asarray(embeddings, np.float32) @ projection
    m = np.asarray(projected_means, np.float32)
    return (np.square(d).sum(1)[:, None] - 2 * d @ m.T + np.square(m).sum(1)[None, :]).min(1)


def mahalanobis_score(gaussians: Gaussians, embeddings: np.ndarray) -> np.ndarray:
    """Squared Mahalanobis distance to the nearest class mean; higher = more OOD."""
    return gaussians.squared_distances(embeddings).min(axis=1)


def relative_mahalanobis_score(classes: Gaussians, background: Gaussians, embeddings: np.ndarray) -> np.ndarray:
    """min_c MD_c(z) - MD_0(z), MD_0 the squared distance under one Gaussian of all training embeddings."""
    return mahalanobis_score(classes, embeddings) - background.squared_distances(embeddings)[:, 0]


def l2_normalised(embeddings: np.ndarray) -> np.ndarray:
    x = np.asarray(embeddings, np.float64)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


# ---------------------------------------------------------------------------------------------------- metrics
def auroc(id_scores: np.ndarray, ood_scores: np.ndarray) -> float:
    """Area under the ROC curve of telling OOD (positive) from ID by score (higher = OOD): the probability that a
    random OOD image scores above a random ID one, ties counting half (Mann-Whitney U from average ranks)."""
    scores = np.concatenate([np.asarray(id_scores, np.float64), np.asarray(ood_scores, np.float64)])
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    first_rank = np.cumsum(counts) - counts + 1  # 1-based rank of each distinct value's first occurrence
    ranks = (first_rank + (counts - 1) / 2.0)[inverse]
    n_id, n_ood = len(id_scores), len(ood_scores)
    return float((ranks[n_id:].sum() - n_ood * (n_ood + 1) / 2.0) / (n_id * n_ood))


def threshold_at(id_scores: np.ndarray, false_alarm_rate: float = FALSE_ALARM_RATE) -> float:
    """The (1 - false_alarm_rate) quantile of ID scores: inputs scoring above it are called OOD."""
    return float(np.quantile(np.asarray(id_scores, np.float64), 1.0 - false_alarm_rate))


def calibration_halves(count: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """(calibration indices, report indices) of the ID test set: a seeded shuffle cut in two, each sorted."""
    order = np.random.default_rng(seed).permutation(count)
    return np.sort(order[: count // 2]), np.sort(order[count // 2:])


# ---------------------------------------------------------------------------------------------------- experiment
def score_functions(train_embeddings: np.ndarray, train_labels: np.ndarray, top_k: tuple[int, ...] = TOP_K,
                    tail_skip: tuple[int, ...] = TAIL_SKIP) -> dict:
    """{score name: (fitted statistics or None, function(logits, embeddings) -> scores)}, fitted on training data."""
    scores: dict = {"msp": (None, lambda lg, emb: msp_score(lg)),
                    "energy": (None, lambda lg, emb: energy_score(lg))}
    full = fit_gaussians(train_embeddings, train_labels)
    scores["maha"] = (full, lambda lg, emb: mahalanobis_score(full, emb))
    shrunk = fit_gaussians(train_embeddings, train_labels, shrinkage=SHRINKAGE)
    scores[f"maha-shrink{SHRINKAGE:g}"] = (shrunk, lambda lg, emb: mahalanobis_score(shrunk, emb))
    for k in top_k:
        low = fit_gaussians(train_embeddings, train_labels, top_k=k)
        scores[f"maha-top{k}"] = (low, lambda lg, emb, low=low: mahalanobis_score(low, emb))
    for k in tail_skip:
        tail = fit_gaussians(train_embeddings, train_labels, skip_top=k)
        scores[f"maha-tail{k}"] = (tail, lambda lg, emb, tail=tail: mahalanobis_score(tail, emb))
    background = fit_gaussians(train_embeddings, None)
    scores["rel-maha"] = ((full, background), lambda lg, emb: relative_mahalanobis_score(full, background, emb))
    normed = fit_gaussians(l2_normalised(train_embeddings), train_labels)
    scores["maha-l2"] = (normed, lambda lg, emb: mahalanobis_score(normed, l2_normalised(emb)))
    return scores


def serving_cost(gaussians: Gaussians, repeats: int = 2000) -> dict:
    """Wall time of the chosen score's NumPy arithmetic (float32, as shipped) on one 128-d embedding, and per
    image in a batch of 64, on one core; plus its multiply-adds."""
    rng = np.random.default_rng(SEED)
    p, m = gaussians.projection.astype(np.float32), gaussians.projected_means.astype(np.float32)
    dim, k = p.shape
    classes = len(m)
    one, batch = rng.standard_normal((1, dim)).astype(np.float32), rng.standard_normal((64, dim)).astype(np.float32)

    m_squared = np.square(m).sum(1)

    def score(z):  # serving_score, with ||M_c||^2 computed once at load time as serving would
        d = z @ p
        return (np.square(d).sum(1)[:, None] - 2 * d @ m.T + m_squared).min(1)

    timings = {}
    for name, z in (("single", one), ("batch64", batch)):
        score(z)
        started = time.perf_counter()
        for _ in range(repeats):
            score(z)
        timings[name] = (time.perf_counter() - started) / repeats / len(z)
    return {"dim": dim, "rank": k, "classes": classes, "multiply_adds": dim * k + classes * k,
            "seconds_single": timings["single"], "seconds_per_image_batch64": timings["batch64"]}


def choose(rows: list[dict], sets: list[str], candidates: tuple[str, ...] = PARAMETER_FREE) -> dict:
    """Among the parameter-free scores, the best pooled AUROC; among those within 0.002 of it, the best worst-set
    AUROC."""
    rows = [r for r in rows if r["score"] in candidates]
    best_pooled = max(r["auroc"]["pooled"] for r in rows)
    contenders = [r for r in rows if r["auroc"]["pooled"] >= best_pooled - 0.002]
    return max(contenders, key=lambda r: min(r["auroc"][s] for s in sets))


def leave_one_set_out(rows: list[dict], sets: list[str]) -> list[dict]:
    """For each OOD set: the score (any of them, parameters included) with the best mean AUROC over the other sets,
    and how it does on the held-out one beside the best there: does choosing on some kinds of OOD image carry over
    to a kind not seen?"""
    out = []
    for held in sets:
        others = [s for s in sets if s != held]
        picked = max(rows, key=lambda r: np.mean([r["auroc"][s] for s in others]))
        best = max(rows, key=lambda r: r["auroc"][held])
        out.append({"held_out": held, "picked": picked["score"], "picked_auroc": picked["auroc"][held],
                    "best": best["score"], "best_auroc": best["auroc"][held]})
    return out


def measure(args) -> dict:
    import torch

    from vitserve.artifact import ModelInfo
    from vitserve.export.verify import cpu_session
    from vitserve.machine import cpu_model_name, load_average
    from vitserve.model.checkpoint import load_checkpoint
    from vitserve.model.data import load_fashion_mnist

    torch.set_num_threads(args.threads)
    started, stages = time.perf_counter(), {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        stages[name] = now - since
        return now

    t = started
    data = load_fashion_mnist(args.data_dir)
    train_images, train_labels = data.train.images.numpy(), data.train.labels.numpy()
    test_images, test_labels = data.test.images.numpy(), data.test.labels.numpy()
    if args.fit_limit:
        keep = np.sort(np.random.default_rng(args.seed).permutation(len(train_labels))[: args.fit_limit])
        train_images, train_labels = train_images[keep], train_labels[keep]
    ood = build_ood_sets(test_images, args.count, args.noise_count, args.seed)
    t = lap("build OOD sets", t)

    session = cpu_session(str(args.model), threads=args.threads)
    info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
    vit, meta = load_checkpoint(args.checkpoint)
    vit.eval()
    if (meta.mean, meta.std) != (info.mean, info.std):
        raise RuntimeError(f"checkpoint normalisation {meta.mean}/{meta.std} != the file's {info.mean}/{info.std}")

    train_embeddings, _ = class_token_embeddings(vit, train_images, meta.mean, meta.std)
    t = lap("embeddings of the training images (PyTorch)", t)
    evaluated = {"in-distribution": test_images, **ood}
    logits, embeddings, head_gap = {}, {}, 0.0
    for name, images in evaluated.items():
        logits[name] = onnx_logits(session, images, info.mean, info.std)
        embeddings[name], torch_logits = class_token_embeddings(vit, images, meta.mean, meta.std)
        head_gap = max(head_gap, float(np.abs(torch_logits - logits[name]).max()))
    t = lap("logits (ONNX Runtime) and embeddings (PyTorch) of the test and OOD images", t)

    scores = score_functions(train_embeddings, train_labels)
    calibration, report = calibration_halves(len(test_labels), args.seed)
    rows = []
    for name, (_, function) in scores.items():
        values = {set_name: function(logits[set_name], embeddings[set_name]) for set_name in evaluated}
        id_scores = values["in-distribution"]
        pooled = np.concatenate([values[s] for s in ood])
        threshold = threshold_at(id_scores[calibration])
        rows.append({"score": name,
                     "auroc": {**{s: auroc(id_scores, values[s]) for s in ood}, "pooled": auroc(id_scores, pooled)},
                     "threshold": threshold,
                     "false_alarm_rate": float((id_scores[report] > threshold).mean()),
                     "false_alarm_rate_calibration": float((id_scores[calibration] > threshold).mean()),
                     "detection": {**{s: float((values[s] > threshold).mean()) for s in ood},
                                   "pooled": float((pooled > threshold).mean())}})
    t = lap("fit and evaluate the scores", t)

    chosen = choose(rows, list(ood))
    leave_one_out = leave_one_set_out(rows, list(ood))
    statistics, _ = scores[chosen["score"]]
    shipped = None
    if isinstance(statistics, Gaussians):
        shipped = ship_statistics(statistics, chosen, info, args, embeddings, ood, calibration, report)
    t = lap("ship and time the chosen score", t)

    accuracy = float((logits["in-distribution"].argmax(1) == test_labels).mean())
    return {"model": str(args.model), "checkpoint": str(args.checkpoint), "weights_sha256": info.weights_sha256,
            "test_accuracy": accuracy, "head_vs_onnx_max_abs": head_gap,
            "train_images": int(len(train_labels)), "id_images": int(len(test_labels)),
            "calibration_images": int(len(calibration)), "report_images": int(len(report)),
            "ood_sets": {s: int(len(v)) for s, v in ood.items()}, "photos": sorted(load_photos()),
            "seed": args.seed, "embedding_dim": int(train_embeddings.shape[1]),
            "eigenvalues": [float(v) for v in scores["maha"][0].eigenvalues],
            "maha_rank": scores["maha"][0].rank, "rows": rows, "chosen": chosen["score"], "shipped": shipped,
            "leave_one_set_out": leave_one_out,
            "stages_s": stages, "runtime_s": time.perf_counter() - started, "threads": args.threads,
            "cpu": cpu_model_name(), "cores": os.cpu_count(), "load_average": load_average(),
            "date": time.strftime("%Y-%m-%d")}


def ship_statistics(gaussians: Gaussians, chosen: dict, info, args, embeddings: dict, ood: dict,
                    calibration: np.ndarray, report: np.ndarray) -> dict:
    """Saves what serving needs for a Mahalanobis score, in float32, and checks that float32 changes nothing."""
    path = args.stats_dir / f"{chosen['score']}.npz"
    path.parent.mkdir(parents=True, exist_ok=True)
    projection = gaussians.projection.astype(np.float32)
    projected_means = gaussians.projected_means.astype(np.float32)
    np.savez(path, projection=projection, projected_means=projected_means,
             threshold=np.float32(chosen["threshold"]), score=np.array(chosen["score"]),
             weights_sha256=np.array(info.weights_sha256))

    def score32(z: np.ndarray) -> np.ndarray:
        return serving_score(z, projection, projected_means)

    id32 = score32(embeddings["in-distribution"])
    id64 = mahalanobis_score(gaussians, embeddings["in-distribution"])
    return {"path": str(path), "bytes": path.stat().st_size,
            "arrays": {"projection": list(projection.shape), "projected_means": list(projected_means.shape),
                       "threshold": []},
            "float32_max_rel_diff": float(np.abs(id32 - id64).max() / np.abs(id64).max()),
            "float32_pooled_auroc": auroc(id32, np.concatenate([score32(embeddings[s]) for s in ood])),
            "float32_false_alarm_rate": float((id32[report] > np.float32(chosen["threshold"])).mean()),
            "cost": serving_cost(gaussians)}


# ---------------------------------------------------------------------------------------------------- report
# How the product ships the chosen score: no figures, so a rerun of this measurement cannot contradict it.
SERVED = ("`vitserve export --eval DIR` puts this score in the model file (export/ood.py fits it with the same "
          "`fit_gaussians` as above; export/ood_graph.py computes it in the graph). Every file outputs the "
          "`embedding`, the class token after the final LayerNorm (float32 `[batch, D]`); a file exported with a "
          "labelled set also outputs `ood_score`, float32 `[batch]`, min over classes c of ||z P - M_c||^2 with P and "
          "M stored in the graph, in the fast and the relevance path alike and in every precision. The statistics are "
          "fitted on the fit half of the `--eval` set (the temperature's seeded half; `make export-default`: 5,000 of "
          "the test images, not the 60,000 training images measured above), and the file's `vitserve.ood` metadata "
          "carries the threshold, the 99th percentile of a seeded half of the other half's scores, the false-alarm "
          "rate it gave on the rest (images neither the fit nor the threshold saw; about 1% on images like the "
          "labelled ones), with the 50th, 90th, 99th and 99.9th percentiles, the rank and the image counts. A set "
          "under 100 images, or with fewer than 2 of a class in the fit half, gives a file without the score.")


def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def weakest_sentence(weakest: dict[str, str]) -> str:
    """{score: its weakest set} as one sentence."""
    if len(set(weakest.values())) == 1:
        return f"Both are weakest on {next(iter(weakest.values()))}."
    return "Weakest sets: " + ", ".join(f"{score} on {name}" for score, name in weakest.items()) + "."


def findings(result: dict) -> list[str]:
    """Sentences that compare the rows of this run (each one computed, so a rerun cannot contradict them)."""
    rows = {r["score"]: r for r in result["rows"]}
    ood_sets = list(result["ood_sets"])
    chosen = rows[result["chosen"]]
    pooled = {name: r["auroc"]["pooled"] for name, r in rows.items()}
    hardest = min(ood_sets, key=lambda s: chosen["auroc"][s])
    out = [f"- Logits against embeddings: pooled AUROC msp {pooled['msp']:.4f}, energy {pooled['energy']:.4f}, "
           f"maha {pooled['maha']:.4f}. "
           + ("Energy does worse than the softmax here, not better. " if pooled["energy"] < pooled["msp"] else "")
           + weakest_sentence({name: min(ood_sets, key=lambda s: rows[name]["auroc"][s])
                               for name in ("msp", "energy")}),
           f"- Hardest set for {chosen['score']}: {hardest} (AUROC {chosen['auroc'][hardest]:.4f}, "
           f"{_pct(chosen['detection'][hardest])} detected at 1% false alarms).",
           "- Which directions of the embedding carry the signal: keeping only the top k principal directions gives "
           + ", ".join(f"{pooled[f'maha-top{k}']:.4f} (k={k})" for k in TOP_K)
           + "; dropping them gives " + ", ".join(f"{pooled[f'maha-tail{k}']:.4f} (k={k})" for k in TAIL_SKIP)
           + f"; all {result['maha_rank']}: {pooled['maha']:.4f}."]
    if pooled[f"maha-top{TOP_K[-1]}"] < pooled["maha"] < pooled[f"maha-tail{TAIL_SKIP[-1]}"]:
        out.append("  The low-variance directions separate OOD images best: a low-rank Mahalanobis is the wrong "
                   "economy here, and dropping the largest directions helps (a choice of k that would need held-out "
                   "OOD images to make).")
    out.append(f"- rel-maha {pooled['rel-maha']:.4f} and maha-l2 {pooled['maha-l2']:.4f} against maha "
               f"{pooled['maha']:.4f}; shrinkage {SHRINKAGE:g}: {pooled[f'maha-shrink{SHRINKAGE:g}']:.4f}.")
    return out


def markdown(result: dict) -> str:
    ood_sets = list(result["ood_sets"])
    sets = ood_sets + ["pooled"]
    rows = result["rows"]
    chosen = next(r for r in rows if r["score"] == result["chosen"])
    best = {s: max(x["auroc"][s] for x in rows) for s in sets}
    lines = ["# Out-of-distribution detection: which score, measured", "",
             f"`python -m vitserve.evaluation.ood --out docs/ood.md` ({result['date']}; {result['runtime_s']:.0f} s "
             f"with {result['threads']} thread on a {result['cores']}-core {result['cpu']}, load average "
             f"{result['load_average']} at the end). Model `{result['model']}` "
             f"(weights sha256 `{result['weights_sha256'][:12]}…`, test accuracy {_pct(result['test_accuracy'])} "
             f"through ONNX Runtime); embeddings from its checkpoint `{result['checkpoint']}` (the head applied to "
             f"them matches the file's logits within {result['head_vs_onnx_max_abs']:.1e}). The numbers are also in "
             "build/ood/ood.json.", "",
             f"- **In-distribution (ID)**: the {result['id_images']:,} Fashion-MNIST test images. Class means and "
             f"covariances fitted on the {result['train_images']:,} training images only. Thresholds: the 99th "
             f"percentile of ID scores on a seeded half of the test set ({result['calibration_images']:,} images, "
             f"seed {result['seed']}); false alarms counted on the other half ({result['report_images']:,}).",
             "- **OOD sets** (uint8 28x28, seeded): " + "; ".join(f"{s} {n:,}" for s, n in result['ood_sets'].items())
             + f". Photos: random square crops (side 16 px to the photo's short side) of {len(result['photos'])} "
               f"scikit-image photos ({', '.join(result['photos'])}), greyscale, bicubic to 28x28. Digits: Pillow's "
               "default font, size 24-48, stroke 0-2, rotation ±25°, height 12-24 px, random position, white on "
               "black. Uniform noise: every pixel uniform on 0..255. Gaussian noise: per-image mean 32-224 and sd "
               f"16-96, clipped. Inverted: 255 - a seeded {result['ood_sets']['inverted']:,} of the test images.",
             "- **Embedding**: the class token after the final LayerNorm, before the head "
             f"({result['embedding_dim']}-d). "
             f"Its within-class covariance has rank {result['maha_rank']} (eigenvalues from "
             f"{result['eigenvalues'][0]:.2f} down to {result['eigenvalues'][-2]:.1e}, then "
             f"{result['eigenvalues'][-1]:.1e}): a LayerNorm output obeys one linear constraint, so `maha` uses the "
             "pseudo-inverse (eigenvalues below 1e-6 of the largest dropped).",
             "- **Scores** (higher = more OOD): `msp` 1 - max softmax; `energy` -logsumexp(logits); `maha` squared "
             "Mahalanobis distance to the nearest class mean, shared covariance; "
             f"`maha-shrink{SHRINKAGE:g}` the same with the covariance shrunk towards trace/D; `maha-top{{k}}` only "
             "the k largest principal directions; `maha-tail{k}` all but the k largest; `rel-maha` minus the "
             "distance under one Gaussian of all training embeddings (Ren et al. 2021); `maha-l2` on L2-normalised "
             "embeddings.", "",
             "## AUROC (OOD positive)", "",
             "Bold: the best of the column. * : parameter-free (the recommendation is made among these).", "",
             "| score | " + " | ".join(sets) + " |", "|---|" + "---|" * len(sets)]
    for r in rows:
        cells = [f"**{r['auroc'][s]:.4f}**" if r["auroc"][s] == best[s] else f"{r['auroc'][s]:.4f}" for s in sets]
        mark = " *" if r["score"] in PARAMETER_FREE else ""
        lines.append(f"| {r['score']}{mark} | " + " | ".join(cells) + " |")
    lines += ["", "## Detection rate at the 1% false-alarm threshold", "",
              "Threshold = 99th percentile of the calibration half's ID scores; false alarms measured on the "
              "report half; detection = share of each OOD set scoring above the threshold.", "",
              "| score | threshold | false alarms | " + " | ".join(sets) + " |",
              "|---|---|---|" + "---|" * len(sets)]
    for r in rows:
        lines.append(f"| {r['score']} | {r['threshold']:.4g} | {_pct(r['false_alarm_rate'])} | "
                     + " | ".join(_pct(r["detection"][s]) for s in sets) + " |")
    lines += ["", "## Does a choice made on some OOD sets carry over to another?", "",
              "For each set held out: the score (all of them) with the best mean AUROC over the other four sets, its "
              "AUROC on the held-out set, and the best AUROC any score reaches there.", "",
              "| held-out set | picked on the others | its AUROC | best there | best AUROC |", "|---|---|---|---|---|"]
    for x in result["leave_one_set_out"]:
        lines.append(f"| {x['held_out']} | {x['picked']} | {x['picked_auroc']:.4f} | {x['best']} | "
                     f"{x['best_auroc']:.4f} |")
    meets = chosen["auroc"]["pooled"] >= TARGET_AUROC and chosen["false_alarm_rate"] <= FALSE_ALARM_RATE
    lines += ["", "## Chosen score", "",
              f"**{chosen['score']}**: pooled AUROC {chosen['auroc']['pooled']:.4f} (worst set "
              f"{min(chosen['auroc'][s] for s in ood_sets):.4f}), threshold {chosen['threshold']:.6g}, "
              f"false-alarm rate {_pct(chosen['false_alarm_rate'])} on the report half "
              f"({_pct(chosen['false_alarm_rate_calibration'])} on the calibration half), detection "
              + ", ".join(f"{s} {_pct(chosen['detection'][s])}" for s in sets)
              + f". Target (pooled AUROC >= {TARGET_AUROC}, false alarms <= 1%): {'met' if meets else 'NOT met'}.", "",
              "Rule: among the parameter-free scores, the best pooled AUROC; among those within 0.002 of it, the best "
              "worst-set AUROC. Scores with a rank or a shrinkage are shown to say where the signal lies, not "
              "chosen: their parameter could only be picked on these same OOD sets."]
    lines += ["", "## Reading the numbers", ""] + findings(result)
    shipped = result["shipped"]
    if shipped:
        cost = shipped["cost"]
        lines += ["", f"Statistics shipped: `{shipped['path']}` ({shipped['bytes']:,} bytes; float32): "
                  + ", ".join(f"`{k}` {tuple(v)}" for k, v in shipped["arrays"].items())
                  + ". Score = min over classes c of ||z P - M_c||^2 for the embedding z (P = the shared "
                    "covariance's eigenvectors over the square roots of their eigenvalues, M = class means @ P). "
                    f"In float32 the scores differ from float64 by at most {shipped['float32_max_rel_diff']:.1e} of "
                    f"the largest ID score; pooled AUROC {shipped['float32_pooled_auroc']:.4f}, false alarms "
                    f"{_pct(shipped['float32_false_alarm_rate'])} on the report half.", "",
                  f"Serving cost: {cost['multiply_adds']:,} multiply-adds per image ({cost['dim']}x{cost['rank']} "
                  f"projection, {cost['classes']} distances in {cost['rank']}-d); NumPy, one thread: "
                  f"{cost['seconds_single'] * 1e6:.1f} µs for one image, "
                  f"{cost['seconds_per_image_batch64'] * 1e6:.2f} µs per image in a batch of 64 (the served "
                  "file computes it in its graph instead, from its embedding output)."]
    lines += ["", "## Runtime", ""] + [f"- {k}: {v:.1f} s" for k, v in result["stages_s"].items()]
    lines += ["", "## Served", "", SERVED]
    return "\n".join(lines)


def served_check(model_path: Path, data_dir: Path, count: int, noise_count: int, seed: int, threads: int) -> str:
    """The served file's own `ood_score` output, through ONNX Runtime on the whole file as the server runs it,
    against the held-out half of the test images it was not fitted on and the OOD sets: the targets (pooled AUROC
    >= 0.95; false alarms <= 1% at the file's stored threshold) measured on what users get, as Markdown."""
    from vitserve.artifact import INPUT_NAME, OOD_SCORE_NAME, ModelInfo, normalize_pixels
    from vitserve.export.calibration import halves
    from vitserve.export.ood import threshold_split
    from vitserve.export.verify import cpu_session
    from vitserve.model.data import read_idx

    session = cpu_session(str(model_path), threads=threads)
    info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
    if not info.ood:
        raise SystemExit(f"{model_path} has no {OOD_SCORE_NAME} output: export it with --eval")
    test = read_idx(next(data_dir.glob("t10k-images-idx3-ubyte*")))[:, None]

    def scores(images: np.ndarray) -> np.ndarray:
        return np.concatenate([session.run([OOD_SCORE_NAME], {INPUT_NAME: normalize_pixels(images[i:i + 250],
                                                                                            info.mean, info.std)})[0]
                               for i in range(0, len(images), 250)])

    _, heldout = halves(len(test))  # the half the export did not fit on
    _, checking = threshold_split(heldout)  # and of it, the part that did not set the threshold either
    inside = scores(test[checking])
    threshold = float(info.ood["threshold"])
    sets = {name: scores(images) for name, images in build_ood_sets(test, count, noise_count, seed).items()}
    pooled = np.concatenate(list(sets.values()))
    lines = [f"Served file `{model_path}` ({info.name} {info.version}, {info.precision}): its `{OOD_SCORE_NAME}` "
             f"output through ONNX Runtime; statistics fitted at export on {info.ood['fit_images']} images of "
             f"{info.ood['source']}, threshold {threshold:.2f}.", "",
             "| set | images | AUROC against the check images | above the threshold |", "| --- | --- | --- | --- |",
             f"| check images: test images neither the fit nor the threshold saw (in distribution) | {len(inside)} | "
             f"- | {np.mean(inside > threshold):.2%} (false alarms) |"]
    lines += [f"| {name} | {len(values)} | {auroc(inside, values):.4f} | {np.mean(values > threshold):.1%} |"
              for name, values in sets.items()]
    lines.append(f"| pooled | {len(pooled)} | {auroc(inside, pooled):.4f} | {np.mean(pooled > threshold):.1%} |")
    low, high = wilson_interval(int(np.sum(inside > threshold)), len(inside))
    lines += ["", f"The check images' false-alarm rate per image, {np.mean(inside > threshold):.2%}, has a 95% "
                  f"interval of {low:.2%}-{high:.2%} (Wilson; {len(inside)} images): a threshold set at the 99th "
                  f"percentile of other images of the same kind cannot promise less than 1% on every sample.", ""]
    whole = scores(test)
    lines += alert_false_alarms({"check images": inside, "the whole test split (10,000; half of it fitted on)": whole},
                                threshold, seed)
    return "\n".join(lines)


def wilson_interval(hits: int, count: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a proportion (SciPy's)."""
    from scipy.stats import binomtest

    interval = binomtest(hits, count).proportion_ci(confidence_level=0.95, method="wilson")
    return float(interval.low), float(interval.high)


def alert_false_alarms(samples: dict[str, np.ndarray], threshold: float, seed: int, draws: int = 20_000) -> list[str]:
    """How often the drift alert would fire on in-distribution traffic: windows of W images drawn at random from
    each sample of in-distribution scores, the share of windows with more than DRIFT_ALERT_SHARE above the
    threshold (the alert's share condition over one 30-minute window), as Markdown lines; windows under
    DRIFT_ALERT_MIN_IMAGES, which the alert leaves alone, are shown for what the minimum spares."""
    rng = np.random.default_rng(seed)
    lines = [f"The drift alert on in-distribution images: it fires when more than {DRIFT_ALERT_SHARE:.0%} of a "
             f"30-minute window's images score above the threshold, over at least {DRIFT_ALERT_MIN_IMAGES} images "
             f"(a window with fewer cannot raise it). Windows of W images drawn at random ({draws:,} per cell); the "
             f"share of windows in which the share condition holds (below {DRIFT_ALERT_MIN_IMAGES} images, what the "
             f"alert would do without its minimum):", "",
             "| images | per image above the threshold | " + " | ".join(f"W = {w}" for w in ALERT_WINDOWS) + " |",
             "| --- | --- | " + " | ".join("---" for _ in ALERT_WINDOWS) + " |"]
    counted = []
    for name, values in samples.items():
        outside = values > threshold
        cells = [np.mean(outside[rng.integers(0, len(outside), (draws, w))].mean(axis=1) > DRIFT_ALERT_SHARE)
                 for w in ALERT_WINDOWS]
        lines.append(f"| {name} | {outside.mean():.2%} | " + " | ".join(f"{c:.3%}" for c in cells) + " |")
        worst = max(c for w, c in zip(ALERT_WINDOWS, cells) if w >= DRIFT_ALERT_MIN_IMAGES)
        counted.append((name, worst))
    lines += ["", "So the alert's false-alarm rate on in-distribution traffic, the largest share over the windows it "
              f"can fire on (W >= {DRIFT_ALERT_MIN_IMAGES}): " + "; ".join(f"{name}: {worst:.3%}" for name, worst in
                                                                         counted) + "."]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.evaluation.ood", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="the served ONNX file (logits)")
    p.add_argument("--checkpoint", type=Path, default=DEFAULT_CHECKPOINT, help="its checkpoint (embeddings)")
    p.add_argument("--data-dir", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--count", type=int, default=2000, help="images in the photo, digit and inverted sets")
    p.add_argument("--noise-count", type=int, default=1000, help="images in each noise set")
    p.add_argument("--fit-limit", type=int, default=0, help="fit on a seeded share of the training images (0: all)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--threads", type=int, default=1,
                   help="PyTorch and ONNX Runtime threads (NumPy's BLAS gets 1 unless OPENBLAS_NUM_THREADS says)")
    p.add_argument("--stats-dir", type=Path, default=DEFAULT_STATS_DIR, help="where the chosen score's .npz goes")
    p.add_argument("--out", type=Path, help="also write the report (markdown) here; the numbers go to "
                                            "STATS_DIR/ood.json")
    p.add_argument("--from-json", type=Path, help="measure nothing: rewrite the report from a run's ood.json")
    p.add_argument("--served", action="store_true",
                   help="measure the served file's own ood_score output instead (--model; no PyTorch, no fit)")
    args = p.parse_args(argv)
    if args.served:
        text = served_check(args.model, args.data_dir, args.count, args.noise_count, args.seed, args.threads)
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    if args.from_json:
        text = markdown(json.loads(args.from_json.read_text()))
        print(text)
        if args.out:
            args.out.write_text(text + "\n")
        return 0
    result = measure(args)
    text = markdown(result)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    args.stats_dir.mkdir(parents=True, exist_ok=True)
    (args.stats_dir / "ood.json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
