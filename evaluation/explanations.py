"""How faithful the served explanation maps are, measured so that anyone can rerun it.

    vitserve evaluate explanations CHECKPOINT --out docs/explanations.md

scores the two maps the model serves, attention rollout (export/rollout.py, class-agnostic) and conservative
relevance (export/relevance.py, class-specific), beside the candidates it was chosen from (evaluation/map_candidates.py:
gradient-weighted rollout, plain gradient x input, occlusion) and two orders that know nothing of the model: a
seeded random patch order and the centre prior (patches by distance to the image centre). Four measurements:

1. deletion and insertion (Petsiuk et al. 2018, RISE): patches switched to a baseline (or, for insertion, back from
   it), most relevant first, one patch per step; the curve is the probability of the class the model predicted on
   the untouched image, its area (trapezoid over the fraction 0..1) the score. Two baselines: the dataset mean and a
   Gaussian blur of the image.
2. 95% confidence intervals (normal approximation) of each mean area and of the paired per-image differences.
3. cascading model randomisation (Adebayo et al. 2018): the head, then the blocks from the top down, get random
   weights; a map that stays the same did not depend on the weights it claims to explain.
4. resolution consistency: the map at twice the trained size, pooled back to the trained grid; and the map at each
   smaller grid of the model's token-budget ladder (vitserve/budgets.py: the server's resampling), brought to the
   trained grid as the server draws it, against the full answer's map of the same image.

The measurements are functions of arrays, tested alone; `write_report` turns their numbers into markdown, JSON and
plots. Only the standard library is imported at the top, so that building `vitserve`'s parser stays fast.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vitserve.help_format import DefaultsHelpFormatter

if TYPE_CHECKING:  # for annotations only: numpy loads when a measurement runs
    import numpy as np

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
DEFAULT_OUT = "build/explanations/explanations.md"  # docs/ only when asked: the committed report is written on purpose
MAPS = ("rollout", "relevance")  # what the model serves
CANDIDATE_MAPS = ("chefer", "gradient-input", "occlusion")  # measured beside them (evaluation/map_candidates.py)
MODEL_MAPS = (*MAPS, *CANDIDATE_MAPS)
METHODS = (*MODEL_MAPS, "random", "centre")  # the patch orders compared
BASELINES = ("mean", "blur")
CURVES = ("deletion", "insertion")
Z95 = 1.959963984540054  # two-sided 95% quantile of the standard normal


@dataclass(frozen=True)
class ExplanationSettings:
    """What one evaluation run does; every field but `examples` is a command-line flag."""

    limit: int = 500  # test images
    batch_size: int = 64  # rows per forward pass: on one CPU thread small batches ran faster (770 vs 530 img/s at 1024)
    seed: int = 0  # the random order and the randomised weights
    blur_sigma: float = 3.0  # pixels, for the blur baseline
    resolution_factor: int = 2
    examples: int = 6  # images in the overlay figure


# ---------------------------------------------------------------------------------------------------------------
# Pure math on arrays


def trapezoid_auc(curves):
    """Area under curves sampled at evenly spaced fractions 0, 1/S, ..., 1 (last axis): (..., S + 1) -> (...)."""
    import numpy as np

    curves = np.asarray(curves, dtype=np.float64)
    steps = curves.shape[-1] - 1
    return (curves.sum(-1) - 0.5 * (curves[..., 0] + curves[..., -1])) / steps


def ranking(scores):
    """(N, P) scores -> (N, P) patch indices, highest score first; ties keep row-major patch order."""
    import numpy as np

    return np.argsort(-np.asarray(scores), axis=-1, kind="stable")


def centre_prior(grid: tuple[int, int]):
    """(gh, gw) score of each patch: minus the distance of its centre to the image centre, in patches."""
    import numpy as np

    rows = np.arange(grid[0]) + 0.5 - grid[0] / 2
    cols = np.arange(grid[1]) + 0.5 - grid[1] / 2
    return -np.hypot(rows[:, None], cols[None, :])


def random_scores(count: int, patches: int, seed: int):
    """(count, patches) uniform scores: a seeded random patch order per image."""
    import numpy as np

    return np.random.default_rng(seed).random((count, patches))


def spearman_rows(a, b):
    """Spearman rank correlation of each row of `a` with the same row of `b`: (N, P) x2 -> (N,).

    Tied values share their mean rank. A constant row has no order to agree with: its correlation is NaN.
    """
    import numpy as np
    from scipy.stats import rankdata

    ra, rb = rankdata(a, axis=-1), rankdata(b, axis=-1)
    ra -= ra.mean(-1, keepdims=True)
    rb -= rb.mean(-1, keepdims=True)
    norm = np.sqrt((ra * ra).sum(-1) * (rb * rb).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(norm > 0, (ra * rb).sum(-1) / norm, np.nan)


def mean_ci(values) -> dict:
    """Mean and its 95% interval by the normal approximation, mean ± 1.96 s/√n; NaNs left out, n counts the rest."""
    import numpy as np

    x = np.asarray(values, dtype=np.float64).ravel()
    x = x[~np.isnan(x)]
    n = len(x)
    mean = float(x.mean()) if n else float("nan")
    half = float(Z95 * x.std(ddof=1) / np.sqrt(n)) if n > 1 else float("nan")
    return {"mean": mean, "low": mean - half, "high": mean + half, "n": n}


def pool_to_grid(maps, factor: int):
    """(N, gh * f, gw * f) -> (N, gh, gw): the mean of each f x f block."""
    import numpy as np

    n, h, w = np.shape(maps)
    return np.asarray(maps).reshape(n, h // factor, factor, w // factor, factor).mean(axis=(2, 4))


def normalised_entropy(maps):
    """(N, P) non-negative maps -> (N,): entropy of each map as a distribution over patches / log P (1: flat)."""
    import numpy as np

    p = np.clip(np.asarray(maps, dtype=np.float64), 0, None)
    p = p / p.sum(-1, keepdims=True)
    with np.errstate(invalid="ignore", divide="ignore"):
        h = -np.where(p > 0, p * np.log(p), 0.0).sum(-1)
    return h / np.log(p.shape[-1])


# ---------------------------------------------------------------------------------------------------------------
# Deletion and insertion


def patch_masks(order, grid: tuple[int, int], patch: int, steps):
    """Which pixels are switched once the first k patches of `order` are, for each k in `steps`.

    Args:
        order: (N, P) int64 patch indices (row-major on the grid), the first switched first.
        grid: (gh, gw), gh * gw = P.
        patch: pixels per patch side.
        steps: (S,) int64 patch counts.
    Returns:
        bool (N, S, 1, gh * patch, gw * patch)
    """
    import torch

    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1]).expand_as(order))  # rank[n, p]: when patch p is switched
    switched = (rank[:, None, :] < steps[None, :, None]).reshape(len(order), len(steps), *grid)  # (N, S, gh, gw)
    pixels = switched.repeat_interleave(patch, dim=2).repeat_interleave(patch, dim=3)  # (N, S, H, W)
    return pixels[:, :, None]


def perturbed_images(images, baseline, order, grid, patch, steps, insertion: bool):
    """(N, C, H, W) images and baselines -> (N, S, C, H, W): each after k patches (k in `steps`) were switched.

    Deletion puts the baseline's pixels where the image's were; insertion starts from the baseline and puts the
    image's pixels back, in the same order.
    """
    import torch

    mask = patch_masks(order, grid, patch, steps)
    start, switched_to = (baseline, images) if insertion else (images, baseline)
    return torch.where(mask, switched_to[:, None], start[:, None])


def perturbation_curve(score, images, baseline, order, grid, patch, *, insertion: bool, ends, chunk: int = 32):
    """The score after 0, 1, ..., P patches were switched: (N, P + 1) float64 numpy.

    Args:
        score: (pixels (M, C, H, W), image index (M,)) -> (M,) tensor, e.g. the probability of each image's class.
        images, baseline: (N, C, H, W) model inputs.
        order: (N, P) int64, most relevant patch first.
        ends: the (N,) scores at 0 and at P patches; they are the image and the baseline whatever the order, so
            the caller computes them once for every method.
        chunk: images perturbed at a time (memory: chunk x P images).
    """
    import torch

    n, p = order.shape
    inner = torch.arange(1, p)
    middle = []
    for start in range(0, n, chunk):
        part = slice(start, start + chunk)
        stack = perturbed_images(images[part], baseline[part], order[part], grid, patch, inner, insertion)
        which = torch.arange(start, start + len(stack)).repeat_interleave(p - 1)
        middle.append(score(stack.flatten(0, 1), which).reshape(-1, p - 1))  # (chunk, P - 1)
    first, last = ends
    return torch.cat([first[:, None], torch.cat(middle), last[:, None]], dim=1).double().numpy()


def class_probability(vit, pixels, classes, batch_size: int):
    """Softmax probability of classes[i] for pixels[i], in forward passes of `batch_size` rows: (M,)."""
    import torch

    out = []
    with torch.no_grad():
        for start in range(0, len(pixels), batch_size):
            logits = vit(pixels[start:start + batch_size])  # (b, K)
            out.append(logits.softmax(-1).gather(1, classes[start:start + batch_size, None])[:, 0])
    return torch.cat(out)


def blurred(pixels, sigma: float):
    """(N, C, H, W) -> the same images, each channel blurred by a Gaussian of `sigma` pixels (reflected borders)."""
    import torch
    from scipy.ndimage import gaussian_filter

    return torch.from_numpy(gaussian_filter(pixels.numpy(), sigma=(0, 0, sigma, sigma), mode="reflect"))


def faithfulness_curves(score, pixels, orders: dict, grid, patch, baselines: dict, log=None) -> dict:
    """curves[baseline][method][deletion | insertion]: (N, P + 1) for every baseline and patch order."""
    import torch

    which = torch.arange(len(pixels))
    image_scores = score(pixels, which)
    curves: dict[str, dict[str, dict[str, np.ndarray]]] = {}
    for name, baseline in baselines.items():
        base_scores = score(baseline, which)
        curves[name] = {}
        for method, order in orders.items():
            curves[name][method] = {
                "deletion": perturbation_curve(score, pixels, baseline, order, grid, patch, insertion=False,
                                               ends=(image_scores, base_scores)),
                "insertion": perturbation_curve(score, pixels, baseline, order, grid, patch, insertion=True,
                                                ends=(base_scores, image_scores))}
            if log:  # the longest part of a run: say where it is
                log(f"  curves: {name} baseline, {method}")
    return curves


def paired_comparison(ours, theirs, curve: str) -> dict:
    """Per image AUC differences ours - theirs, and how often ours is better (deletion: lower, insertion: higher)."""
    import numpy as np

    better = ours < theirs if curve == "deletion" else ours > theirs
    return {"difference": mean_ci(np.asarray(ours) - np.asarray(theirs)), "better": mean_ci(better.astype(float))}


def compared_pairs(methods) -> list[tuple[str, str]]:
    """(ours, theirs) pairs: every method against rollout (the issue's yardstick), relevance against the rest."""
    pairs = [(m, "rollout") for m in methods if m != "rollout"]
    return pairs + [("relevance", m) for m in methods if m not in ("rollout", "relevance")]


def auc_summary(curves: dict) -> dict:
    """Per baseline: each method's mean AUC (CI) and mean curve; `compared_pairs`, paired per image."""
    summary = {}
    for baseline, methods in curves.items():
        aucs = {m: {c: trapezoid_auc(v) for c, v in per.items()} for m, per in methods.items()}
        summary[baseline] = {
            "auc": {m: {c: mean_ci(a) for c, a in per.items()} for m, per in aucs.items()},
            "mean_curve": {m: {c: v.mean(0).tolist() for c, v in per.items()} for m, per in methods.items()},
            "paired": {f"{ours}-{theirs}": {c: paired_comparison(aucs[ours][c], aucs[theirs][c], c) for c in CURVES}
                       for ours, theirs in compared_pairs(methods)},
        }
    return summary


# ---------------------------------------------------------------------------------------------------------------
# Maps, model randomisation, resolution


def explain_batched(vit, pixels, target, batch_size: int, cells: tuple[int, int] | None = None):
    """Every map of MODEL_MAPS in batches: logits (N, K) and {name: (N, gh, gw) float64 numpy}.

    The served two come from export.relevance.explain (what the graph computes), the candidates from
    evaluation.map_candidates; `cells` is occlusion's grid (default: the input's patch grid)."""
    import torch

    from vitserve.evaluation import map_candidates
    from vitserve.export.relevance import explain

    batches = [slice(s, s + batch_size) for s in range(0, len(pixels), batch_size)]
    parts = [explain(vit, pixels[b], target[b]) for b in batches]
    logits = torch.cat([p[0] for p in parts])
    maps = {name: torch.cat([p[i + 1] for p in parts]) for i, name in enumerate(MAPS)}
    maps["chefer"] = torch.cat([map_candidates.chefer_relevance(vit, pixels[b], target[b]) for b in batches])
    maps["gradient-input"] = torch.cat([map_candidates.gradient_input(vit, pixels[b], target[b]) for b in batches])
    maps["occlusion"] = map_candidates.occlusion(vit, pixels, target, cells, batch_size)
    return logits.numpy(), {name: maps[name].double().numpy() for name in MODEL_MAPS}


def cascade_order(vit) -> list[str]:
    """Module names in the order the cascade randomises them: the head, then the blocks from the top down."""
    return ["head"] + [f"blocks.{i}" for i in reversed(range(len(vit.blocks)))]


def reinitialise(module, generator) -> None:
    """Random weights for one module: xavier-uniform linear weights, zero biases, LayerNorms reset to the identity.

    The head gets xavier-uniform weights too, not the model's own zero init: a zero head has zero gradients, and
    relevance would vanish instead of being tested.
    """
    import torch
    from torch import nn

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight, generator=generator)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()


def cascade_stage(vit, stage: int, seed: int):
    """A copy of `vit` with the first `stage` modules of `cascade_order` randomised.

    Each module draws from its own seed, so a module randomised at stage s has the same weights at every later
    stage: the cascade adds randomness, it never redraws it.
    """
    import copy

    import torch

    model = copy.deepcopy(vit).eval()
    modules = dict(model.named_modules())
    for index, name in enumerate(cascade_order(model)[:stage]):
        reinitialise(modules[name], torch.Generator().manual_seed(seed * 1000 + index))
    return model


def stage_label(names: list[str]) -> str:
    """'trained', 'head', 'head + top 3 blocks'."""
    if not names:
        return "trained"
    blocks = len(names) - 1
    return "head" if not blocks else f"head + top {blocks} block{'s' if blocks > 1 else ''}"


def randomisation_test(vit, pixels, labels, predicted, trained_maps: dict, batch_size: int, seed: int) -> list[dict]:
    """Per cascade stage: accuracy and each map's per-image Spearman with the trained model's map (mean, CI).

    Relevance explains, at every stage, the class the trained model predicted, so that only the weights change.
    """
    import torch

    order, rows = cascade_order(vit), []
    for stage in range(len(order) + 1):
        logits, maps = explain_batched(cascade_stage(vit, stage, seed), pixels, torch.from_numpy(predicted),
                                       batch_size)
        row = {"stage": stage, "label": stage_label(order[:stage]), "randomised": order[:stage],
               "accuracy": float((logits.argmax(1) == labels).mean()),
               "agreement_with_trained": float((logits.argmax(1) == predicted).mean())}
        for name in MODEL_MAPS:
            row[name] = mean_ci(spearman_rows(maps[name].reshape(len(pixels), -1),
                                              trained_maps[name].reshape(len(pixels), -1)))
        rows.append(row)
    return rows


def model_input(images, channels: int, mean, std):
    """uint8 (N, C, H, W) -> the model's float32 input (vitserve.artifact.normalize_pixels), channels repeated."""
    import torch

    from vitserve.artifact import normalize_pixels

    if images.shape[1] != channels:
        images = images.expand(-1, channels, -1, -1)
    return torch.from_numpy(normalize_pixels(images.numpy(), mean, std, channel_axis=1))


def resolution_consistency(vit, images, mean, std, predicted, trained_maps: dict, factor: int,
                           batch_size: int) -> dict:
    """Each map at `factor` times the size (bicubic), pooled back to the trained grid, against the map at the
    trained size: per-image Spearman. The maps explain the class predicted at the trained size; occlusion hides
    the same cells as at the trained size (so needs no pooling)."""
    import torch

    from vitserve.model.data import resize_batch

    size = (images.shape[-2] * factor, images.shape[-1] * factor)
    pixels = model_input(resize_batch(images, size), vit.cfg.in_channels, mean, std)
    grid = trained_maps["rollout"].shape[1:]
    logits, maps = explain_batched(vit, pixels, torch.from_numpy(predicted), batch_size, cells=grid)
    n = len(images)
    out = {"size": list(size), "top1_agreement": float((logits.argmax(1) == predicted).mean())}
    for name in MODEL_MAPS:
        pooled = maps[name] if name == "occlusion" else pool_to_grid(maps[name], factor)
        out[name] = mean_ci(spearman_rows(pooled.reshape(n, -1), trained_maps[name].reshape(n, -1)))
    return out


def to_grid(maps, grid: tuple[int, int]):
    """(N, h, w) maps -> (N, *grid) averaged over each cell's area (vitserve.budgets.resample, what the server does
    to pixels), so that a finer map is compared on the coarser grid, as the 2x maps are pooled."""
    import numpy as np

    from vitserve.budgets import resample

    return resample(np.asarray(maps, np.float32)[:, None], grid)[:, 0].astype(np.float64)


def rung_consistency(vit, pixels, predicted, trained_maps: dict, batch_size: int) -> list[dict]:
    """Per smaller grid of the model's token-budget ladder: the image resampled as the server does
    (vitserve.budgets.resample), each map against the full answer's map brought to that grid (`to_grid`); the
    class explained is the full answer's. Also that grid's top-1 agreement with the full answer."""
    import torch

    from vitserve.budgets import ladder_grids, resample

    patch, rows, n = vit.cfg.patch_size, [], len(pixels)
    for size in ladder_grids(tuple(pixels.shape[-2:]), patch)[1:]:  # input sizes in pixels, the full one first
        small = torch.from_numpy(resample(pixels.numpy(), size))
        logits, maps = explain_batched(vit, small, torch.from_numpy(predicted), batch_size)
        rung_grid = (size[0] // patch, size[1] // patch)
        row = {"grid": list(rung_grid), "tokens": rung_grid[0] * rung_grid[1],
               "top1_agreement": float((logits.argmax(1) == predicted).mean())}
        for name in MODEL_MAPS:
            row[name] = mean_ci(spearman_rows(maps[name].reshape(n, -1),
                                              to_grid(trained_maps[name], rung_grid).reshape(n, -1)))
        rows.append(row)
    return rows


def map_statistics(scores: dict, grid) -> dict:
    """Cheap extras per served map: Spearman with the centre prior, and normalised entropy."""
    import numpy as np

    prior = np.broadcast_to(centre_prior(grid).ravel(), scores["rollout"].shape)
    return {name: {"spearman_with_centre_prior": mean_ci(spearman_rows(scores[name], prior)),
                   "positive_share": mean_ci((scores[name] > 0).mean(-1)),
                   "normalised_entropy": mean_ci(normalised_entropy(scores[name]))} for name in MODEL_MAPS}


# ---------------------------------------------------------------------------------------------------------------
# The evaluation


def method_scores(maps: dict, grid, seed: int) -> dict:
    """Flat (N, P) scores of every method: the maps, a seeded random order, the centre prior."""
    import numpy as np

    n = len(maps["rollout"])
    flat = {name: maps[name].reshape(n, -1) for name in MODEL_MAPS}
    patches = grid[0] * grid[1]
    return {**flat, "random": random_scores(n, patches, seed),
            "centre": np.tile(centre_prior(grid).ravel(), (n, 1))}


def timed(log, what: str, started: float) -> float:
    log(f"{what}: {time.perf_counter() - started:.0f} s")
    return time.perf_counter()


def evaluate_explanations(vit, images, labels, mean, std, settings: ExplanationSettings, log=print):
    """Every measurement on uint8 images (N, C, H, W) and their int64 labels.

    Returns:
        a JSON-ready dict of numbers, and the examples the overlay figure shows.
    """
    import torch

    started = t0 = time.perf_counter()
    pixels = model_input(images, vit.cfg.in_channels, mean, std)
    grid, patch = (pixels.shape[-2] // vit.cfg.patch_size, pixels.shape[-1] // vit.cfg.patch_size), vit.cfg.patch_size
    logits, maps = explain_batched(vit, pixels, torch.full((len(pixels),), -1), settings.batch_size)
    predicted, labels_np = logits.argmax(1), labels.numpy()
    scores = method_scores(maps, grid, settings.seed)
    t0 = timed(log, "maps", t0)
    classes = torch.from_numpy(predicted)

    def score(x, which):  # the probability of the class predicted on the untouched image
        return class_probability(vit, x, classes[which], settings.batch_size)

    baselines = {"mean": torch.zeros_like(pixels), "blur": blurred(pixels, settings.blur_sigma)}
    orders = {m: torch.from_numpy(ranking(s)) for m, s in scores.items()}
    curves = faithfulness_curves(score, pixels, orders, grid, patch, baselines, log=log)
    t0 = timed(log, "deletion and insertion", t0)
    cascade = randomisation_test(vit, pixels, labels_np, predicted, maps, settings.batch_size, settings.seed)
    t0 = timed(log, "model randomisation", t0)
    resolution = resolution_consistency(vit, images, mean, std, predicted, maps, settings.resolution_factor,
                                        settings.batch_size)
    rungs = rung_consistency(vit, pixels, predicted, maps, settings.batch_size)
    timed(log, "resolution and budgets", t0)
    results = {"images": len(images), "grid": list(grid), "patch_size": patch,
               "accuracy": float((predicted == labels_np).mean()), "settings": asdict(settings),
               "faithfulness": auc_summary(curves), "randomisation": cascade, "resolution": resolution,
               "budgets": rungs,
               "map_statistics": map_statistics(scores, grid),
               "seconds": round(time.perf_counter() - started, 1)}
    shown = slice(0, settings.examples)
    examples = {"images": images[shown].numpy(), "labels": labels_np[shown].tolist(),
                "predicted": predicted[shown].tolist(),
                "maps": {m: s[shown].reshape(-1, *grid) for m, s in scores.items()},
                "budgets": budget_examples(vit, pixels[shown], predicted[shown])}
    return results, examples


def budget_examples(vit, pixels, predicted) -> list[dict]:
    """The served maps of a few images at every grid of the ladder, each on its own grid: [{grid, maps}]."""
    import torch

    from vitserve.budgets import ladder_grids, resample
    from vitserve.export.relevance import explain

    patch, out = vit.cfg.patch_size, []
    for size in ladder_grids(tuple(pixels.shape[-2:]), patch):  # input sizes in pixels
        small = torch.from_numpy(resample(pixels.numpy(), size))
        _, rollout, relevance = explain(vit, small, torch.from_numpy(predicted))
        grid = (size[0] // patch, size[1] // patch)
        maps = {"rollout": rollout.double().numpy(), "relevance": relevance.double().numpy()}
        out.append({"grid": grid, "maps": maps})
    return out


# ---------------------------------------------------------------------------------------------------------------
# Targets and the report


GAP_TARGET, GAP_CI_TARGET = -0.05, -0.03  # relevance's deletion AUC minus rollout's: mean, upper end of its CI
STABILITY_TARGET = 0.85  # Spearman of a served map with itself across resolutions and budgets
RANDOM_HALF_TARGET = 0.3  # Spearman with the trained map once the head and half the blocks are random


def deletion_gap_check(summary: dict, method: str, baseline: str) -> dict:
    d = summary[baseline]["paired"][f"{method}-rollout"]["deletion"]["difference"]
    auc = summary[baseline]["auc"]
    return {"target": f"deletion AUC, {baseline} baseline: {method} - rollout <= {GAP_TARGET}, CI upper end <= "
                      f"{GAP_CI_TARGET}",
            "measured": f"{auc[method]['deletion']['mean']:.3f} vs {auc['rollout']['deletion']['mean']:.3f}, "
                        f"difference {fmt_ci(d)}",
            "passed": bool(d["mean"] <= GAP_TARGET and d["high"] <= GAP_CI_TARGET)}


def stability_checks(results: dict) -> list[dict]:
    """Every served map: Spearman >= STABILITY_TARGET at twice the size and at each smaller budget."""
    rows = []
    comparisons = [(f"{'x'.join(map(str, results['resolution']['size']))} px", results["resolution"])]
    comparisons += [(f"{r['tokens']} tokens ({'x'.join(map(str, r['grid']))})", r) for r in results["budgets"]]
    for name in MAPS:
        for label, measured in comparisons:
            rows.append({"target": f"stability: {name} at {label} against the full answer >= {STABILITY_TARGET}",
                         "measured": fmt_plain(measured[name]), "passed": measured[name]["mean"] >= STABILITY_TARGET})
    return rows


def target_checks(results: dict) -> list[dict]:
    """The targets of the served relevance map beside the measured numbers."""
    rows = [deletion_gap_check(results["faithfulness"], "relevance", b) for b in BASELINES]
    rows.extend(stability_checks(results))
    rows.extend(randomisation_checks(results["randomisation"]))
    return rows


def randomisation_checks(stages: list[dict], name: str = "relevance") -> list[dict]:
    """A map's Spearman with the trained map: falling with every step, <= RANDOM_HALF_TARGET from half the blocks;
    and, as a second reading (Adebayo et al. also read the absolute value: a map turned upside down still carries
    the trained one), its absolute value falling until its 95% CI holds 0 (chance: no further fall can be
    measured), and within 0.1 of 0 from there."""
    means = [s[name]["mean"] for s in stages]
    depth = len(stages) - 2
    half = 1 + depth // 2  # the stage at which the head and half the blocks are random
    falls = [later < earlier for earlier, later in zip(means, means[1:])]
    at_chance = [s[name]["low"] <= 0 <= s[name]["high"] for s in stages]
    first_chance = next((i for i, c in enumerate(at_chance) if c), len(stages))
    size_falls = [abs(later) < abs(earlier) for earlier, later in zip(means[:first_chance], means[1:first_chance + 1])]
    to_chance = all(size_falls) and all(abs(m) <= 0.1 for m in means[first_chance:])
    listing = ", ".join(f"{m:.3f}" for m in means)
    return [
        {"target": f"randomisation: {name} Spearman falls at every step (stages 0..{depth + 1})",
         "measured": f"{sum(falls)} of {len(falls)} steps fall ({listing})", "passed": all(falls)},
        {"target": f"randomisation (second reading): |{name} Spearman| falls until its CI holds 0, then stays "
                   f"within 0.1 of 0",
         "measured": f"at chance from stage {first_chance}" if first_chance < len(stages) else "never at chance",
         "passed": to_chance},
        {"target": f"randomisation: {name} Spearman <= {RANDOM_HALF_TARGET} once half the blocks are random "
                   f"(stage >= {half})",
         "measured": f"max {max(means[half:]):.3f}", "passed": max(means[half:]) <= RANDOM_HALF_TARGET},
    ]


def candidate_rows(results: dict) -> list[list]:
    """One row per map: deletion AUC gap to rollout (both baselines), stability, randomisation at half, at a glance."""
    half = 1 + (len(results["randomisation"]) - 2) // 2
    rows = []
    for name in MODEL_MAPS:
        gaps = []
        for b in BASELINES:
            auc = results["faithfulness"][b]["auc"][name]["deletion"]["mean"]
            pair = results["faithfulness"][b]["paired"].get(f"{name}-rollout")
            gaps.append(f"{auc:.3f}" + (f" ({fmt_ci(pair['deletion']['difference'])})" if pair else ""))
        budgets = ", ".join(f"{r[name]['mean']:.2f}" for r in results["budgets"])
        stages = [s[name]["mean"] for s in results["randomisation"]]
        falls = sum(b < a for a, b in zip(stages, stages[1:]))
        rows.append([f"{name}{' (served)' if name in MAPS else ''}", *gaps,
                     f"{results['resolution'][name]['mean']:.3f}", budgets or "-",
                     f"{falls} of {len(stages) - 1}", f"{max(stages[half:]):.3f}"])
    return rows


def fmt_ci(ci: dict, digits: int = 3) -> str:
    return f"{ci['mean']:+.{digits}f} [{ci['low']:+.{digits}f}, {ci['high']:+.{digits}f}]"


def fmt_plain(ci: dict, digits: int = 3) -> str:
    return f"{ci['mean']:.{digits}f} [{ci['low']:.{digits}f}, {ci['high']:.{digits}f}]"


def markdown_table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def report_paths(out: Path) -> tuple[Path, Path, Path]:
    """The markdown, the JSON beside it, and the folder of figures named after it (docs/explanations/)."""
    return out, out.with_suffix(".json"), out.parent / out.stem


WHAT_THE_MAPS_SHOW = """\
- **Attention rollout** (Abnar & Zuidema 2020) is class-agnostic: one map per image whatever the class asked about.
  It shows how attention flows from the class token to the patches through the layers (each layer's head-averaged
  attention mixed with the identity for the residual path, multiplied through). It never looks at the head, so it
  cannot say which patches made the model choose one class over another.
- **Relevance** (conservative propagation, Ali et al. 2022, with AttnLRP's GELU rule; export/relevance.py) is
  class-specific: it explains one chosen class's logit (here always the class the trained model predicted). The
  attention weights, each LayerNorm's scale and each GELU's gate are held at their values on the image, which makes
  the network linear in its tokens; a patch's relevance is its token minus the mean image's, times the logit's
  gradient. The patches' relevance sums to what the image's content added to the logit; it is signed (a patch can
  count against the class). It is exact for that linearised network, not for the model: the numbers below say how
  far the model behaves as if it were.
- Measured beside them, not served (evaluation/map_candidates.py): **chefer**, gradient-weighted attention rollout
  (Chefer, Gur & Wolf 2021; what the model served before); **gradient-input**, gradient x (tokens - the mean
  image's) with nothing held; **occlusion**, each patch set to the mean image in turn and the class's probability
  drop measured, one forward pass per patch (the model's own answer, at a cost no server pays per request).
- No map is a segmentation, and all live on the patch grid: nothing finer than a patch can be read from them."""

METHOD_NOTES = """\
- **Deletion / insertion** (Petsiuk et al. 2018): patches ranked by the map, most relevant first; deletion switches
  them one per step to the baseline, insertion starts from the baseline and puts them back in the same order. The
  curve is the softmax probability of the class the model predicted on the untouched image, at fractions
  0, 1/P, ..., 1 of the patches; AUC is its trapezoid area over 0..1 (lower is better for deletion, higher for
  insertion). Ties in an order (the centre prior's rings) keep row-major patch order.
- **Baselines**: *mean* is the dataset mean, i.e. normalised pixel value 0 in the model's input space (uint8
  255 x mean); *blur* is the image blurred by a Gaussian of sigma = {sigma} pixels (scipy.ndimage, reflected borders),
  in the same normalised space.
- **Methods**: rollout and relevance as served, the candidates above; *random*, a seeded uniform random order per
  image (seed {seed}); *centre*, patches by distance to the image centre, the same order for every image.
- **Confidence intervals**: 95%, normal approximation, mean ± 1.96 s / √n over images; the differences are paired
  (per image, then averaged). "Better" counts images where the first map's AUC is lower (deletion) or higher
  (insertion).
- **Model randomisation** (Adebayo et al. 2018), cascading: stage 1 randomises the head, stage k + 1 also the top k
  blocks, down to every block. Random weights: xavier-uniform for every linear layer (the head too: the model's own
  init zeroes the head, whose zero gradients would make relevance vanish rather than test it), zero biases, LayerNorms
  reset to the identity, each module from its own seed ({seed} x 1000 + its place in the cascade) so that it keeps
  its random weights at later stages. The patch embedding, position embeddings, class token and final LayerNorm stay
  trained. At every stage the class-specific maps explain the class the *trained* model predicted. Spearman rank
  correlation (ties at mean rank) of each image's map with the trained model's map; a constant map would count as
  undefined and be left out (n shows how many remain).
- **Resolution**: images resized bicubic ({factor}x, model.data.resize_batch), maps on the {factor}x grid averaged
  over {factor} x {factor} blocks back to the trained grid (occlusion hides the same cells as at the trained size),
  Spearman with the map at the trained size; the maps explain the class predicted at the trained size.
- **Budgets**: each smaller input grid of the model's token-budget ladder (vitserve/budgets.py), the image
  resampled as the server resamples it; each map on its own grid against the full answer's map averaged down to
  that grid (vitserve.budgets.resample), explaining the full answer's class."""


def provenance_section(results: dict) -> str:
    model, run = results["model"], results["run"]
    rows = [["command", f"`{run['command']}`"], ["date", run["date"]], ["code commit", run.get("commit") or "unknown"],
            ["model", f"{model['name']} v{model['version']} (`{model['checkpoint']}`)"],
            ["weights sha256", f"`{model['weights_sha256']}`"],
            ["images", f"{results['images']} (the first of the test split), grid {results['grid'][0]}x"
                       f"{results['grid'][1]} of {results['patch_size']}-pixel patches"],
            ["top-1 accuracy on them", f"{results['accuracy']:.4f}"],
            ["wall time", f"{results['seconds']:.0f} s, {run['threads']} torch thread(s)"]]
    return markdown_table(["", ""], rows)


def targets_section(targets: list[dict]) -> str:
    rows = [[t["target"], t["measured"], "**pass**" if t["passed"] else "**fail**"] for t in targets]
    return markdown_table(["target (served relevance)", "measured (mean [95% CI])", ""], rows)


def candidates_section(results: dict) -> str:
    budgets = ", ".join(str(r["tokens"]) for r in results["budgets"])
    return markdown_table(["map", "deletion AUC, mean baseline (minus rollout's)", "deletion AUC, blur baseline "
                           "(minus rollout's)", "Spearman at 2x size", f"Spearman at {budgets} tokens",
                           "randomisation: steps that fall", "randomisation: max from half the blocks"],
                          candidate_rows(results))


def faithfulness_section(summary: dict) -> str:
    curve = summary["mean_curve"]["rollout"]["deletion"]
    ends = f"P(predicted class): {curve[0]:.3f} on the image, {curve[-1]:.3f} on the baseline."
    aucs = markdown_table(["method", "deletion AUC (lower better)", "insertion AUC (higher better)"],
                          [[m, fmt_plain(summary["auc"][m]["deletion"]), fmt_plain(summary["auc"][m]["insertion"])]
                           for m in METHODS])
    paired = markdown_table(
        ["paired, per image", "curve", "difference [95% CI]", "the first better on"],
        [[name.replace("-rollout", " - rollout").replace("relevance-", "relevance - "), c,
          fmt_ci(v[c]["difference"]), f"{100 * v[c]['better']['mean']:.1f}% "
          f"[{100 * v[c]['better']['low']:.1f}, {100 * v[c]['better']['high']:.1f}]"]
         for name, v in summary["paired"].items() for c in CURVES])
    return f"{ends}\n\n{aucs}\n\n{paired}"


def randomisation_section(stages: list[dict]) -> str:
    rows = [[s["stage"], s["label"], f"{s['accuracy']:.3f}", *[fmt_plain(s[m], 2) for m in MODEL_MAPS]]
            for s in stages]
    return markdown_table(["stage", "random", "accuracy", *[f"{m} Spearman vs trained" for m in MODEL_MAPS]], rows)


def resolution_section(resolution: dict, grid: list[int]) -> str:
    size = "x".join(str(s) for s in resolution["size"])
    rows = [[m, fmt_plain(resolution[m]), resolution[m]["n"]] for m in MODEL_MAPS]
    note = (f"At {size}, pooled to {grid[0]}x{grid[1]}; top-1 agrees with the trained size's on "
            f"{100 * resolution['top1_agreement']:.1f}% of the images.")
    return note + "\n\n" + markdown_table(["map", "Spearman with the map at the trained size", "n"], rows)


def budgets_section(rungs: list[dict], grid: list[int]) -> str:
    if not rungs:
        return "The model's ladder has no smaller grid."
    rows = [[f"{r['tokens']} ({'x'.join(map(str, r['grid']))})", f"{100 * r['top1_agreement']:.1f}%",
             *[fmt_plain(r[m], 2) for m in MODEL_MAPS]] for r in rungs]
    note = (f"Each smaller grid of the model's ladder, the image resampled as the server does; each map compared "
            f"with the full answer's map of the same image ({grid[0]}x{grid[1]}) averaged down to its grid (the "
            f"finer map pooled to the coarser grid, as at 2x).")
    return note + "\n\n" + markdown_table(["tokens (grid)", "top-1 = full answer's",
                                            *[f"{m} Spearman" for m in MODEL_MAPS]], rows)


def statistics_section(stats: dict) -> str:
    rows = [[m, fmt_plain(stats[m]["spearman_with_centre_prior"]), fmt_plain(stats[m]["positive_share"])]
            for m in MODEL_MAPS]
    return markdown_table(["map", "Spearman with the centre prior", "share of patches above 0"], rows)


def markdown_report(results: dict, figures: dict[str, str]) -> str:
    """The whole report; `figures` maps a figure's name to its path relative to the report."""
    s = results["settings"]
    notes = METHOD_NOTES.format(sigma=s["blur_sigma"], seed=s["seed"], factor=s["resolution_factor"])
    parts = [
        "# How faithful are the explanation maps?", "",
        "Written by `vitserve evaluate explanations` (evaluation/explanations.py); rerun the command below to "
        "reproduce it. The numbers are also in the JSON file beside this one.", "",
        provenance_section(results), "", "## What each map shows, and what it does not", "", WHAT_THE_MAPS_SHOW, "",
        "## Targets", "", targets_section(results["targets"]), "",
        "## Every candidate at a glance", "", candidates_section(results), "",
        *[line for b in BASELINES for line in (f"## Deletion and insertion, {b} baseline", "",
                                               faithfulness_section(results["faithfulness"][b]), "")],
        f"![deletion and insertion curves]({figures['curves']})", "",
        "## Cascading model randomisation", "", randomisation_section(results["randomisation"]), "",
        f"![Spearman with the trained map per randomisation stage]({figures['randomisation']})", "",
        "## Resolution consistency", "", resolution_section(results["resolution"], results["grid"]), "",
        "## Every budget", "", budgets_section(results["budgets"], results["grid"]), "",
        f"![the served maps of the same images at every budget]({figures['budgets']})", "",
        "## Map statistics", "", statistics_section(results["map_statistics"]), "",
        "## Examples", "", f"![maps over test images]({figures['overlays']})", "",
        "## How it was measured", "", notes, ""]
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------------------------
# Figures (matplotlib's object API, Agg canvas: no pyplot state, no display)


def plot_curves(summaries: dict, path: Path) -> None:
    """Mean deletion and insertion curves per method: rows the baselines, columns the curves."""
    import numpy as np
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 7.5))
    axes = fig.subplots(len(BASELINES), len(CURVES), sharex=True, sharey=True, squeeze=False)
    for row, baseline in enumerate(BASELINES):
        for col, curve in enumerate(CURVES):
            ax = axes[row, col]
            for method in METHODS:
                y = summaries[baseline]["mean_curve"][method][curve]
                auc = summaries[baseline]["auc"][method][curve]["mean"]
                ax.plot(np.linspace(0, 1, len(y)), y, label=f"{method} (AUC {auc:.3f})")
            ax.set_title(f"{curve}, {baseline} baseline")
            ax.set_xlabel("fraction of patches switched")
            ax.set_ylabel("P(class predicted on the image)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_randomisation(stages: list[dict], path: Path) -> None:
    """Mean Spearman with the trained map per cascade stage (95% CI bars), and the stage's accuracy."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(9, 4.8))
    ax = fig.subplots()
    x = [s["stage"] for s in stages]
    for name in MODEL_MAPS:
        mean = [s[name]["mean"] for s in stages]
        err = [[m - s[name]["low"] for m, s in zip(mean, stages)], [s[name]["high"] - m for m, s in zip(mean, stages)]]
        ax.errorbar(x, mean, yerr=err, marker="o", capsize=3, label=f"{name}: Spearman vs trained")
    ax.plot(x, [s["accuracy"] for s in stages], "k--", alpha=0.6, label="accuracy")
    ax.set_xticks(x, [s["label"] for s in stages], rotation=30, ha="right", fontsize=8)
    lowest = min(s[name]["low"] for s in stages for name in MODEL_MAPS)
    ax.set_ylim(min(-0.2, lowest - 0.05), 1.05)
    ax.axhline(0, color="grey", lw=0.5)
    ax.set_title("Cascading model randomisation (top-down)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def heat_layer(ax, image_shape, grid_map) -> None:
    """A map over an image: min-max scaled on the inferno ramp when it is never negative; a signed map on a
    diverging ramp centred at 0 (red raised the class's score, blue lowered it). Nearest upsampling keeps the
    patch grid visible."""
    import numpy as np

    scale = image_shape[-2] // grid_map.shape[0], image_shape[-1] // grid_map.shape[1]
    if grid_map.min() < 0:
        bound = float(np.abs(grid_map).max()) or 1.0
        ax.imshow(np.kron(grid_map / bound, np.ones(scale)), cmap="RdBu_r", vmin=-1, vmax=1, alpha=0.6)
        return
    span = grid_map.max() - grid_map.min()
    heat = (grid_map - grid_map.min()) / (span if span > 0 else 1)
    ax.imshow(np.kron(heat, np.ones(scale)), cmap="inferno", alpha=0.55)


def plot_budgets(examples: dict, path: Path) -> None:
    """Rows: a few images; columns: rollout, then relevance, at each grid of the ladder (full first), on its own
    grid over the image resized to that grid's pixels."""
    import torch
    from matplotlib.figure import Figure

    from vitserve.model.data import resize_batch

    images, rungs = examples["images"], examples["budgets"]
    count = min(len(images), 4)
    columns = len(MAPS) * len(rungs)
    fig = Figure(figsize=(1.6 * columns, 1.8 * count))
    axes = fig.subplots(count, columns, squeeze=False)
    for i in range(count):
        for m, name in enumerate(MAPS):
            for r, rung in enumerate(rungs):
                ax = axes[i, m * len(rungs) + r]
                patch = images.shape[-1] // rungs[0]["grid"][1]
                size = (rung["grid"][0] * patch, rung["grid"][1] * patch)
                shown = resize_batch(torch.from_numpy(images[i:i + 1]), size)[0].numpy()
                ax.imshow(shown[0] if shown.shape[0] == 1 else shown.transpose(1, 2, 0), cmap="gray")
                heat_layer(ax, shown.shape, rung["maps"][name][i])
                if i == 0:
                    ax.set_title(f"{name}\n{rung['grid'][0] * rung['grid'][1]} tokens", fontsize=8)
                ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def plot_overlays(examples: dict, labels: list[str], path: Path) -> None:
    """Test images, and each method's map upsampled (nearest: the patch grid stays visible) and blended over them."""
    from matplotlib.figure import Figure

    images = examples["images"]  # uint8 (E, C, H, W)
    count, columns = len(images), 1 + len(METHODS)
    fig = Figure(figsize=(2.1 * columns, 2.2 * count))
    axes = fig.subplots(count, columns, squeeze=False)
    for i, image in enumerate(images):
        shown = image[0] if image.shape[0] == 1 else image.transpose(1, 2, 0)
        name = labels[examples["labels"][i]] if examples["labels"][i] < len(labels) else str(examples["labels"][i])
        axes[i, 0].imshow(shown, cmap="gray")
        axes[i, 0].set_title(f"{name}\npredicted {labels[examples['predicted'][i]]}", fontsize=7)
        for j, method in enumerate(METHODS, start=1):
            axes[i, j].imshow(shown, cmap="gray")
            heat_layer(axes[i, j], image.shape, examples["maps"][method][i])
            axes[i, j].set_title(method, fontsize=8)
    for ax in axes.ravel():
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def write_report(results: dict, examples: dict, labels: list[str], out: Path) -> list[Path]:
    """The markdown, the JSON beside it and the figures in the folder named after it; returns the paths written."""
    md_path, json_path, figure_dir = report_paths(out)
    figure_dir.mkdir(parents=True, exist_ok=True)
    figures = {name: figure_dir / f"{name}.png" for name in ("curves", "randomisation", "overlays", "budgets")}
    plot_budgets(examples, figures["budgets"])
    plot_curves(results["faithfulness"], figures["curves"])
    plot_randomisation(results["randomisation"], figures["randomisation"])
    plot_overlays(examples, labels, figures["overlays"])
    relative = {name: f"{figure_dir.name}/{p.name}" for name, p in figures.items()}
    md_path.write_text(markdown_report(results, relative))
    # NaN (an interval of one image) as null: strict readers refuse NaN
    from vitserve.model.checkpoint import strict_json

    json_path.write_text(json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n")
    return [md_path, json_path, *figures.values()]


# ---------------------------------------------------------------------------------------------------------------
# The command


def add_explanations_command(commands) -> None:
    """Adds `explanations` to the `vitserve evaluate` subcommands."""
    p = commands.add_parser(
        "explanations", formatter_class=DefaultsHelpFormatter,
        help="faithfulness of the rollout and relevance maps: deletion/insertion AUCs with CIs, model "
             "randomisation, resolution consistency; writes a markdown report, its JSON and plots",
        description="Measures the served explanation maps on Fashion-MNIST test images (PyTorch, CPU). Writes OUT, "
                    "OUT with .json, and figures in the folder OUT's stem names beside it.")
    p.add_argument("checkpoint", help="checkpoint directory (config.json + model.safetensors)")
    p.add_argument("--data-dir", default=DEFAULT_DATA_DIR, help="Fashion-MNIST IDX files")
    p.add_argument("--limit", type=int, default=ExplanationSettings.limit, help="the first N test images")
    p.add_argument("--batch-size", type=int, default=ExplanationSettings.batch_size, help="rows per forward pass")
    p.add_argument("--seed", type=int, default=ExplanationSettings.seed, help="random order and random weights")
    p.add_argument("--blur-sigma", type=float, default=ExplanationSettings.blur_sigma,
                   help="Gaussian sigma in pixels of the blur baseline")
    p.add_argument("--out", default=DEFAULT_OUT, help="markdown report; pass docs/explanations.md to update the docs")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.set_defaults(func=run_explanations)


def load_test_images(data_dir: str, limit: int):
    """The first `limit` Fashion-MNIST test images (uint8 (N, 1, 28, 28)) and labels."""
    from vitserve.model.data import load_fashion_mnist

    test = load_fashion_mnist(data_dir).test
    return test.images[:limit], test.labels[:limit]


def command_line(args) -> str:
    return (f"vitserve evaluate explanations {args.checkpoint} --data-dir {args.data_dir} --limit {args.limit} "
            f"--batch-size {args.batch_size} --seed {args.seed} --blur-sigma {args.blur_sigma} "
            f"--threads {args.threads} --out {args.out}")


def code_commit() -> str:
    """The repository's HEAD, if this runs in a git checkout (the report names the code that measured)."""
    import subprocess

    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def run_explanations(args, load_images=load_test_images) -> int:
    """`vitserve evaluate explanations`; `load_images(data_dir, limit) -> (uint8 images, labels)` is replaceable."""
    from datetime import UTC, datetime

    import torch

    from vitserve.model.checkpoint import load_checkpoint, weights_sha256

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    vit, meta = load_checkpoint(args.checkpoint)
    images, labels = load_images(args.data_dir, args.limit)
    settings = ExplanationSettings(limit=args.limit, batch_size=args.batch_size, seed=args.seed,
                                   blur_sigma=args.blur_sigma)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    results, examples = evaluate_explanations(vit, images, labels, meta.mean, meta.std, settings, log=log)
    results["model"] = {"name": meta.name, "version": meta.version, "checkpoint": str(args.checkpoint),
                        "weights_sha256": weights_sha256(vit.state_dict()), "metrics": meta.metrics}
    results["run"] = {"command": command_line(args), "commit": code_commit(), "threads": torch.get_num_threads(),
                      "date": datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")}
    results["targets"] = target_checks(results)
    for path in write_report(results, examples, meta.labels, Path(args.out)):
        print(path)
    for t in results["targets"]:
        print(f"{'PASS' if t['passed'] else 'FAIL'}  {t['target']}: {t['measured']}")
    return 0
