"""`vitserve evaluate calibration`: how well a file's served probabilities match how often its answers are right,
before and after the calibration its export fitted (export/calibration.py: one temperature, and one per answer),
measured through ONNX Runtime on a labelled set, as the server scores them. Writes docs/calibration.md's tables and
a reliability diagram.

The figures that count are on the half of the set the calibration was not fitted on (the same seeded halves as
the export, when the set is the one it was fitted on); the whole set's are beside them.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vitserve.artifact import ModelInfo, softmax
from vitserve.export.accuracy_gate import load_labelled_set
from vitserve.export.calibration import BINS, calibrate, graph_logits, halves, negative_log_likelihood, reliability
from vitserve.export.verify import cpu_session


def measure(model_path: str | Path, eval_dir: str | Path, limit: int | None = None, threads: int = 0) -> dict:
    session = cpu_session(str(model_path), threads=threads)
    info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
    labelled = load_labelled_set(eval_dir, list(info.labels), info.channels, info.image_size, limit)
    logits, labels = graph_logits(session, labelled.images, info.mean, info.std), labelled.labels
    _, report = halves(len(labels))
    parts = {"held-out half (not fitted on)": report, "whole set": np.arange(len(labels))}
    # what a calibration divides the logits by: none, the file's one temperature, and the server's (the curve)
    ways: dict[str, Callable[[np.ndarray], float | np.ndarray]] = {
        "none": lambda z: 1.0, f"one temperature ({info.temperature:.4f})": lambda z: info.temperature}
    if info.temperature_by_entropy is not None:
        ways["per answer, by its entropy (served)"] = info.temperature_for
    rows, diagram = [], {}
    for name, index in parts.items():
        for way, temperature_of in ways.items():
            temperature = temperature_of(logits[index])
            probabilities = softmax(logits[index], temperature)
            ece, bins = reliability(probabilities, labels[index])
            rows.append({"images": name, "count": len(index), "calibration": way, "ece": ece,
                         "nll": negative_log_likelihood(logits[index], labels[index], temperature),
                         "accuracy": float((probabilities.argmax(1) == labels[index]).mean()),
                         "mean_confidence": float(probabilities.max(1).mean())})
            if index is report:
                diagram[way] = bins
    return {"model": str(model_path), "name": f"{info.name} {info.version} ({info.precision})",
            "set": labelled.source, "temperature": info.temperature,
            "curve": None if info.temperature_by_entropy is None else info.temperature_by_entropy.to_json(),
            "stored": info.calibration, "rows": rows, "diagram": diagram,
            "spread": ece_interval(logits[report], labels[report], info.temperature),
            "oracle": best_temperature(logits[report], labels[report]), "splits": other_splits(logits, labels)}


def other_splits(logits: np.ndarray, labels: np.ndarray, seeds: range = range(8)) -> list[dict]:
    """Both fits redone on other seeded halves of the same set, each scored on its own held-out half: whether the
    curve's gain over one temperature holds beyond the one split the export used."""
    rows = []
    for seed in seeds:
        result, (_, report) = calibrate(logits, labels, "a split", seed), halves(len(labels), seed)
        rows.append({"seed": seed, "ece_one": result.ece_single_temperature, "ece_curve": result.ece_after,
                     "nll_one": negative_log_likelihood(logits[report], labels[report], result.temperature),
                     "nll_curve": result.nll_after})
    return rows


def ece_interval(logits: np.ndarray, labels: np.ndarray, temperature: float, draws: int = 500,
                 seed: int = 0) -> tuple[float, float]:
    """The 2.5th and 97.5th percentiles of the expected calibration error over bootstrap resamples of the images:
    how much of a difference between two ECE figures the sample alone could make."""
    rng = np.random.default_rng(seed)
    values = [reliability(softmax(logits[pick], temperature), labels[pick])[0]
              for pick in (rng.integers(0, len(labels), len(labels)) for _ in range(draws))]
    return float(np.percentile(values, 2.5)), float(np.percentile(values, 97.5))


def best_temperature(logits: np.ndarray, labels: np.ndarray) -> dict:
    """The temperature with the lowest ECE on these very images (a grid of 0.01 from 0.25 to 4), and that ECE: the
    floor any single temperature fitted elsewhere could reach here. An oracle, for reference; never shipped."""
    grid = np.round(np.arange(0.25, 4.0, 0.01), 2)
    errors = [reliability(softmax(logits, t), labels)[0] for t in grid]
    best = int(np.argmin(errors))
    return {"temperature": float(grid[best]), "ece": float(errors[best])}


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ways = list(result["diagram"])
    figure, axes = plt.subplots(1, len(ways), figsize=(4.5 * len(ways), 4.2), sharey=True)
    for ax, key in zip(axes, ways):
        title = "softmax(logits)" if key == "none" else key
        bins = result["diagram"][key]
        centres = [(b.low + b.high) / 2 for b in bins]
        ax.bar(centres, [b.accuracy or 0.0 for b in bins], width=1 / BINS, edgecolor="black", color="#4c72b0",
               label="accuracy")
        ax.bar(centres, [(b.confidence or 0.0) - (b.accuracy or 0.0) if b.count else 0.0 for b in bins],
               bottom=[b.accuracy or 0.0 for b in bins], width=1 / BINS, color="#dd8452", alpha=0.5, label="gap")
        ax.plot([0, 1], [0, 1], "k--", linewidth=1)
        ax.set_title(title)
        ax.set_xlabel("confidence (top-1 probability)")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
    axes[0].set_ylabel("accuracy")
    axes[0].legend(loc="upper left")
    figure.suptitle(f"{result['name']}: reliability on the held-out half, by calibration")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


INTRODUCTION = """# Calibrated probabilities

A classifier's softmax is usually over-confident: of the answers a network gives with 95% confidence, far fewer
than 95% are right (Guo et al. 2017, arXiv 1706.04599). `vitserve export --eval DIR` fits a calibration on half of
a labelled set (a seeded shuffle; export/calibration.py), by minimising the negative log-likelihood, and stores it
in the file with the figures it measured on the other half. Two are fitted:

- **one temperature** T for every answer (Guo et al.'s temperature scaling): softmax(logits / T);
- **a temperature per answer**, set by how unsure the raw softmax is: T(z) = exp(c0 + c1 u + c2 u^2), where u is
  the entropy of softmax(z), standardised by the fitted images' mean and spread and held within their range (a
  sample-dependent temperature, as in Balanya et al. 2022, arXiv 2208.00461, and Joy et al. 2023, arXiv
  2207.06211). It has the single temperature as its special case (c1 = c2 = 0) and is searched from it.

The file carries both (`vitserve.temperature` and `vitserve.temperature_by_entropy`); the server scores every /v1
answer (top-k and the relevance map's class) with the per-answer temperature where the file has it, else the one
temperature. Dividing an answer's logits by any positive number changes none of its ranking, so the classes, their
order and the accuracy stay exactly as they were. /v2 keeps the raw logits (its classification extension
included), as Triton gives them. `GET /v1/model` shows the temperatures and the figures, and the web page says when
the confidence it shows is calibrated. A labelled set whose fit half has fewer than 1,000 images gets the one
temperature only (three numbers need more images than one).

Expected calibration error: the answers are put in 15 equal-width bins of top-1 confidence; the error is the
answer-weighted mean of |accuracy - mean confidence| over the bins. Fashion-MNIST has no validation split beside its
test split, so the calibration is fitted on half of the test split and every figure that counts below is on the
other half, which it never saw; the whole split's figures are beside them, for reference.

Reproduce: `make export-default` (the export, then this page), or
`vitserve evaluate calibration models/vit-fmnist/model.onnx --eval /usr/share/datasets/fashion-mnist \
--out docs/calibration.md`.

## Measured
"""


def markdown(result: dict, image_name: str | None) -> str:
    lines = [INTRODUCTION, f"Model: {result['name']}, `{result['model']}`; labelled set: {result['set']}; stored "
             f"temperature {result['temperature']:.4f}" + ("" if result["curve"] is None else
                                                           f"; stored curve `{json.dumps(result['curve'])}`") + ".", "",
             "| images | count | calibration | expected calibration error (15 bins) | NLL | accuracy "
             "| mean confidence |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['images']} | {r['count']} | {r['calibration']} | {r['ece']:.2%} | {r['nll']:.4f} | "
              f"{r['accuracy']:.2%} | {r['mean_confidence']:.2%} |" for r in result["rows"]]
    direction = ("under-confident (its softmax too flat, as training with label smoothing makes it): T < 1 "
                 "sharpens it" if result["temperature"] < 1 else "over-confident: T > 1 softens its softmax")
    lines += ["", f"The model was {direction}."]
    low, high = result["spread"]
    oracle = result["oracle"]
    lines += ["", "How far one temperature can go here: the held-out half's ECE after the stored temperature has a "
                  f"95% bootstrap interval of {low:.2%}-{high:.2%} (500 resamples of its images), and the "
                  f"temperature that would be best on the held-out half itself (an oracle, fitted on the very "
                  f"images it is scored on) is {oracle['temperature']:.2f}, with an ECE of {oracle['ece']:.2%}: "
                  f"no single temperature does better on these images. One temperature moves every confidence the "
                  f"same way; what remains after it is in the middle bins (below), which the per-answer "
                  f"temperature reaches."]
    splits = result["splits"]
    lines += ["", "Whether that holds beyond the export's one split: both fits redone on other seeded halves of the "
                  "same set, each scored on the half it did not see:", "",
              "| seed | ECE, one temperature | ECE, per answer | NLL, one temperature | NLL, per answer |",
              "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r['seed']} | {r['ece_one']:.2%} | {r['ece_curve']:.2%} | {r['nll_one']:.4f} | {r['nll_curve']:.4f} |"
              for r in splits]
    mean = {key: float(np.mean([r[key] for r in splits])) for key in ("ece_one", "ece_curve", "nll_one", "nll_curve")}
    lines += [f"| mean | {mean['ece_one']:.2%} | {mean['ece_curve']:.2%} | {mean['nll_one']:.4f} | "
              f"{mean['nll_curve']:.4f} |", "",
              f"The per-answer temperature has the lower NLL in {sum(r['nll_curve'] < r['nll_one'] for r in splits)} "
              f"of {len(splits)} splits and the lower ECE in {sum(r['ece_curve'] < r['ece_one'] for r in splits)}."]
    ways = list(result["diagram"])
    lines += ["", "Reliability diagram, held-out half (answers per confidence bin and their accuracy, by "
                  "calibration):", "",
              "| confidence | " + " | ".join(f"{w}: answers | accuracy | confidence" for w in ways) + " |",
              "| --- |" + " --- | --- | --- |" * len(ways)]
    for i, b in enumerate(result["diagram"][ways[0]]):
        def cells(x):
            if x.count == 0:
                return "0 | - | -"
            return f"{x.count} | {x.accuracy:.1%} | {x.confidence:.1%}"
        lines.append(f"| {b.low:.2f}-{b.high:.2f} | " + " | ".join(cells(result["diagram"][w][i]) for w in ways) + " |")
    if image_name:
        lines += ["", f"![reliability diagram]({image_name})"]
    return "\n".join(lines) + "\n"


def run(args) -> int:
    result = measure(args.model, args.eval_dir, args.limit, args.threads)
    text = markdown(result, None)
    if args.out:
        out = Path(args.out)
        image = out.with_suffix(".png")
        plot(result, image)
        text = markdown(result, image.name)
        out.write_text(text)
    print(text)
    return 0
