"""The paper's Figure 7 numbers of a ViT as a value, its JSON, and the panels and report `vitserve inspect` writes.

No torch here: an exported file carries these numbers (vitserve.artifact.INSPECTION_KEY), so `vitserve inspect
model.onnx` reads and draws them in the serving install, which has no torch; computing them from a checkpoint is
model/inspection.py's. The panels need matplotlib (the training and export install's); without it the numbers and
the report are written alone.
"""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class Inspection:
    components: np.ndarray  # (k, C, P, P): the filters' principal components, most variance first
    filters: str  # what the filters are: the patch embedding's, or a hybrid's stem convolution's
    explained: np.ndarray  # (k,): the share of the filters' variance each explains
    similarity: np.ndarray  # (gh, gw, gh, gw): cosine similarity of position (i, j) to position (k, l)
    distances: np.ndarray  # (depth, heads): mean attention distance in pixels
    max_distance: float  # the largest distance between two patch centres at the trained size, in pixels
    images: int  # how many images the distances average over
    patch_size: int
    grid: tuple[int, int]


def to_json(i: Inspection, title: str) -> dict:
    """The numbers as JSON (what inspection.json holds, and what `vitserve export` stores in the model file)."""
    return {"title": title, "filters": i.filters, "patch_size": i.patch_size, "grid": list(i.grid),
            "images": i.images, "explained_variance": i.explained.round(6).tolist(),
            "components": i.components.round(5).tolist(), "position_similarity": i.similarity.round(5).tolist(),
            "mean_attention_distance_px": i.distances.round(4).tolist(), "max_distance_px": i.max_distance}


def from_json(data: dict) -> tuple[Inspection, str]:
    """`to_json`'s output back: (Inspection, title); KeyError/ValueError/TypeError when it is not that."""
    rows, cols = (int(g) for g in data["grid"])  # ValueError unless two
    inspection = Inspection(np.asarray(data["components"], np.float64), str(data["filters"]),
                            np.asarray(data["explained_variance"], np.float64),
                            np.asarray(data["position_similarity"], np.float64),
                            np.asarray(data["mean_attention_distance_px"], np.float64), float(data["max_distance_px"]),
                            int(data["images"]), int(data["patch_size"]), (rows, cols))
    if inspection.components.ndim != 4 or inspection.similarity.shape != (*inspection.grid, *inspection.grid) or \
            inspection.distances.ndim != 2:
        raise ValueError("the inspection's arrays do not have the shapes of components, similarity and distances")
    return inspection, str(data["title"])


class InspectionInputError(ValueError):
    """No images to average the attention distances over: the user's to fix, in one line."""


def can_draw_panels() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def write(inspection: Inspection, out: Path, title: str) -> list[Path]:
    """The three panels (PNG, where matplotlib is installed), their numbers (JSON) and a report (Markdown) in
    `out`; the paths written."""
    out.mkdir(parents=True, exist_ok=True)
    written = _write_panels(inspection, out, title) if can_draw_panels() else []
    i = inspection
    k, (gh, gw) = len(i.components), i.grid

    (out / "inspection.json").write_text(json.dumps(to_json(i, title)))
    written.append(out / "inspection.json")
    first, last = i.distances[0], i.distances[-1]
    report = [f"# {title}: inspecting the trained ViT (the paper's Figure 7)", "",
              f"- **Filters** (filters.png): the top {k} principal components of the "
              f"{'x'.join(map(str, i.components.shape[-2:]))} {i.filters} explain {i.explained.sum():.1%} of their "
              f"variance (the first {i.explained[0]:.1%}).",
              f"- **Position embeddings** (position_similarity.png): on a {gh}x{gw} grid, neighbours are more "
              f"alike than far positions when the model learned the image's 2-D layout: mean similarity of "
              f"adjacent positions {_adjacent_similarity(i.similarity):.3f}, of all pairs "
              f"{i.similarity.mean():.3f}.",
              f"- **Attention distance** (attention_distance.png): over {i.images} images, in pixels (at most "
              f"{i.max_distance:.1f} at the trained size): layer 1 heads {first.min():.1f}-{first.max():.1f}, "
              f"layer {len(i.distances)} heads {last.min():.1f}-{last.max():.1f}.", ""]
    (out / "REPORT.md").write_text("\n".join(report))
    written.append(out / "REPORT.md")
    return written


def _write_panels(i: Inspection, out: Path, title: str) -> list[Path]:
    """filters.png, position_similarity.png and attention_distance.png in `out`."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    k = len(i.components)
    columns = 7
    figure, axes = plt.subplots(math.ceil(k / columns), columns, figsize=(columns * 1.2, math.ceil(k / columns) * 1.3))
    for n, axis in enumerate(np.atleast_1d(axes).ravel()):
        axis.axis("off")
        if n < k:
            component = i.components[n]
            image = component.transpose(1, 2, 0) if component.shape[0] == 3 else component[0]
            image = (image - image.min()) / max(image.max() - image.min(), 1e-12)
            axis.imshow(image, cmap=None if image.ndim == 3 else "gray", interpolation="nearest")
            axis.set_title(f"{i.explained[n]:.1%}", fontsize=7)
    figure.suptitle(f"{title}: principal components of the {i.filters.split(' (')[0]}", fontsize=9)
    written.append(_save(figure, out / "filters.png"))

    gh, gw = i.grid
    figure, axes = plt.subplots(gh, gw, figsize=(gw * 0.9, gh * 0.9))
    for (row, col), axis in np.ndenumerate(np.asarray(axes).reshape(gh, gw)):
        axis.imshow(i.similarity[row, col], vmin=-1, vmax=1, cmap="viridis", interpolation="nearest")
        axis.set_xticks([])
        axis.set_yticks([])
    figure.suptitle(f"{title}: position-embedding similarity\n(each tile: one position against all)", fontsize=9)
    written.append(_save(figure, out / "position_similarity.png"))

    figure, axis = plt.subplots(figsize=(5, 4))
    depth, heads = i.distances.shape
    for head in range(heads):
        axis.scatter(np.arange(1, depth + 1), i.distances[:, head], s=12)
    axis.set_xlabel("network depth (layer)")
    axis.set_ylabel("mean attention distance (pixels)")
    axis.set_ylim(0, i.max_distance)
    axis.set_title(f"{title}: {heads} heads per layer, {i.images} images")
    written.append(_save(figure, out / "attention_distance.png"))
    return written


def _adjacent_similarity(similarity: np.ndarray) -> float:
    gh, gw = similarity.shape[:2]
    pairs = [similarity[r, c, r + dr, c + dc] for r in range(gh) for c in range(gw)
             for dr, dc in ((0, 1), (1, 0)) if r + dr < gh and c + dc < gw]
    return float(np.mean(pairs)) if pairs else float("nan")


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    import matplotlib.pyplot as plt
    plt.close(figure)
    return path
