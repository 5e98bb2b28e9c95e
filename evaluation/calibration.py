"""`vitserve evaluate calibration`: how well a file's served probabilities match how often its answers are right,
before and after the temperature its export fitted (export/calibration.py), measured through ONNX Runtime on a
labelled set, as the server scores them. Writes docs/calibration.md's tables and a reliability diagram.

The figures that count are on the half of the set the temperature was not fitted on (the same seeded halves as
the export, when the set is the one it was fitted on); the whole set's are beside them.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from vitserve.artifact import ModelInfo
from vitserve.export.accuracy_gate import load_labelled_set
from vitserve.export.calibration import BINS, graph_logits, halves, negative_log_likelihood, reliability, softmax
from vitserve.export.verify import cpu_session


def measure(model_path: str | Path, eval_dir: str | Path, limit: int | None = None, threads: int = 0) -> dict:
    session = cpu_session(str(model_path), threads=threads)
    info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
    labelled = load_labelled_set(eval_dir, list(info.labels), info.channels, tuple(info.image_size), limit)
    logits, labels = graph_logits(session, labelled.images, info.mean, info.std), labelled.labels
    _, report = halves(len(labels))
    parts = {"held-out half (not fitted on)": report, "whole set": np.arange(len(labels))}
    rows, diagram = [], {}
    for name, index in parts.items():
        for temperature in (1.0, info.temperature):
            probabilities = softmax(logits[index], temperature)
            ece, bins = reliability(probabilities, labels[index])
            rows.append({"images": name, "count": len(index), "temperature": temperature, "ece": ece,
                         "nll": negative_log_likelihood(logits[index], labels[index], temperature),
                         "accuracy": float((probabilities.argmax(1) == labels[index]).mean()),
                         "mean_confidence": float(probabilities.max(1).mean())})
            if index is report:
                diagram["before" if temperature == 1.0 else "after"] = bins
    return {"model": str(model_path), "name": f"{info.name} {info.version} ({info.precision})",
            "set": labelled.source, "temperature": info.temperature, "stored": info.calibration, "rows": rows,
            "diagram": diagram, "spread": ece_interval(logits[report], labels[report], info.temperature),
            "oracle": best_temperature(logits[report], labels[report])}


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

    figure, axes = plt.subplots(1, 2, figsize=(9, 4.2), sharey=True)
    for ax, (key, title) in zip(axes, (("before", "softmax(logits)"),
                                       ("after", f"softmax(logits / {result['temperature']:.3f})"))):
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
    figure.suptitle(f"{result['name']}: reliability on the held-out half")
    figure.tight_layout()
    figure.savefig(out, dpi=90)
    plt.close(figure)


INTRODUCTION = """# Calibrated probabilities

A classifier's softmax is usually over-confident: of the answers a network gives with 95% confidence, far fewer
than 95% are right (Guo et al. 2017, arXiv 1706.04599). `vitserve export --eval DIR` fits one temperature T on half
of a labelled set (a seeded shuffle; export/calibration.py), by minimising the negative log-likelihood, and stores
it in the file with the figures it measured on the other half. The server then scores every /v1 answer (top-k and
the relevance map's class) as softmax(logits / T); dividing all logits by one positive number changes no ranking,
so the classes, their order and the accuracy stay exactly as they were. /v2 keeps the raw logits (its
classification extension included), as Triton gives them. `GET /v1/model` shows the temperature and the figures,
and the web page says when the confidence it shows is calibrated.

Expected calibration error: the answers are put in 15 equal-width bins of top-1 confidence; the error is the
answer-weighted mean of |accuracy - mean confidence| over the bins. Fashion-MNIST has no validation split beside its
test split, so the temperature is fitted on half of the test split and every figure that counts below is on the
other half, which it never saw; the whole split's figures are beside them, for reference.

Reproduce: `make export-default` (the export, then this page), or
`vitserve evaluate calibration models/vit-fmnist/model.onnx --eval /usr/share/datasets/fashion-mnist --out docs/calibration.md`.

## Measured
"""


def markdown(result: dict, image_name: str | None) -> str:
    lines = [INTRODUCTION, f"Model: {result['name']}, `{result['model']}`; labelled set: {result['set']}; stored temperature "
             f"{result['temperature']:.4f}.", "",
             "| images | count | temperature | expected calibration error (15 bins) | NLL | accuracy | mean confidence |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['images']} | {r['count']} | {r['temperature']:.4f} | {r['ece']:.2%} | {r['nll']:.4f} | "
              f"{r['accuracy']:.2%} | {r['mean_confidence']:.2%} |" for r in result["rows"]]
    direction = ("under-confident (its softmax too flat, as training with label smoothing makes it): T < 1 "
                 "sharpens it" if result["temperature"] < 1 else "over-confident: T > 1 softens its softmax")
    lines += ["", f"The model was {direction}. One temperature cannot fix every bin at once: what remains is in the "
              "middle bins (below)."]
    if "spread" in result:
        low, high = result["spread"]
        oracle = result["oracle"]
        lines += ["", "How far one temperature can go here: the held-out half's ECE after the stored temperature has a "
                      f"95% bootstrap interval of {low:.2%}-{high:.2%} (500 resamples of its images), and the "
                      f"temperature that would be best on the held-out half itself (an oracle, fitted on the very "
                      f"images it is scored on) is {oracle['temperature']:.2f}, with an ECE of {oracle['ece']:.2%}: "
                      f"no single temperature does better on these images."]
    lines += ["", "Reliability diagram, held-out half (answers per confidence bin and their accuracy):", "",
              "| confidence | answers before | accuracy before | answers after | accuracy after | confidence after |",
              "| --- | --- | --- | --- | --- | --- |"]
    for b, a in zip(result["diagram"]["before"], result["diagram"]["after"]):
        def cell(x, value):
            return "-" if x.count == 0 else f"{value:.1%}"
        lines.append(f"| {b.low:.2f}-{b.high:.2f} | {b.count} | {cell(b, b.accuracy or 0)} | {a.count} | "
                     f"{cell(a, a.accuracy or 0)} | {cell(a, a.confidence or 0)} |")
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
