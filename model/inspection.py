"""What a trained ViT learned, as the paper's Figure 7 shows it (§4.5, Appendix D.7), from a checkpoint:

- the principal components of the patch-embedding filters (the rows of E, each a C x P x P filter), with the
  share of variance each explains. A hybrid's patch embedding is a convolution over the CNN's feature map, whose
  filters are not images; its panel shows the filters that do see the pixels, the stem's 7x7 convolution;
- the cosine similarity of each patch position's embedding to every other's, as a grid of tiles;
- the mean attention distance of every head at every depth: the pixel distance between a query patch and the key
  patches, weighted by the head's attention, averaged over query patches and images. Attention from patches to
  patches only: the class token has no position in the image, so its row and column are left out and each
  query's attention over the patches is renormalised to sum to one.

`vitserve inspect CHECKPOINT --out DIR` writes the three panels as PNGs, their numbers as JSON and a short
report (`model/cli.py`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from vitserve.model.vit import VisionTransformer

SHOWN_COMPONENTS = 28  # as Figure 7 (left) shows them


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


def filter_components(weight: torch.Tensor, count: int = SHOWN_COMPONENTS) -> tuple[np.ndarray, np.ndarray]:
    """(D, C, P, P) patch-embedding filters -> their top `count` principal components (count, C, P, P) and the
    share of variance each explains (count,)."""
    filters = weight.detach().double().reshape(weight.shape[0], -1)  # (D, C*P*P)
    centred = filters - filters.mean(dim=0, keepdim=True)
    _, singular, vectors = torch.linalg.svd(centred, full_matrices=False)
    variance = singular ** 2
    count = min(count, vectors.shape[0])
    return (vectors[:count].reshape(count, *weight.shape[1:]).numpy(),
            (variance[:count] / variance.sum()).numpy())


def position_similarity(pos_embed: torch.Tensor, grid: tuple[int, int]) -> np.ndarray:
    """(1, 1 + gh*gw, D) position embeddings -> (gh, gw, gh, gw) cosine similarities between patch positions."""
    patches = torch.nn.functional.normalize(pos_embed.detach().double()[0, 1:], dim=-1)  # (N, D)
    return (patches @ patches.T).reshape(*grid, *grid).numpy()


def patch_distances(grid: tuple[int, int], patch_size: int) -> np.ndarray:
    """(N, N) pixel distances between the centres of the patches of a `grid`."""
    rows, cols = np.meshgrid(np.arange(grid[0]), np.arange(grid[1]), indexing="ij")
    centres = np.stack([rows.ravel(), cols.ravel()], axis=1) * patch_size  # (N, 2); centres differ as corners do
    return np.linalg.norm(centres[:, None, :] - centres[None, :, :], axis=-1)


def mean_distance(attention: np.ndarray, distances: np.ndarray) -> np.ndarray:
    """(B, heads, 1+N, 1+N) attention -> (heads,) mean attention distance: patch-to-patch weights renormalised
    per query, times the query-key distances, averaged over queries and images."""
    patches = attention[:, :, 1:, 1:]
    weights = patches / np.maximum(patches.sum(axis=-1, keepdims=True), 1e-12)
    return (weights * distances).sum(axis=-1).mean(axis=(0, 2))


@torch.no_grad()
def attention_distances(model: VisionTransformer, pixels: torch.Tensor, batch_size: int = 64) -> np.ndarray:
    """(depth, heads) mean attention distance in pixels over `pixels` (B, C, H, W) at the trained size."""
    model.eval()
    distances = patch_distances(model.cfg.grid_size, model.cfg.patch_size)
    totals = np.zeros((model.cfg.depth, model.cfg.num_heads))
    for start in range(0, len(pixels), batch_size):
        chunk = pixels[start:start + batch_size]
        _, attentions = model.forward_with_attention(chunk)
        for layer, attention in enumerate(attentions):
            totals[layer] += mean_distance(attention.double().numpy(), distances) * len(chunk)
    return totals / len(pixels)


def pixel_filters(model: VisionTransformer) -> tuple[torch.Tensor, str]:
    """The first filters that see pixels, (D, C, k, k), and what they are."""
    if not model.cfg.is_hybrid:
        return model.patch_embed.proj.weight, "patch-embedding filters"
    proj = model.patch_embed.proj
    return model.patch_embed.stem_filters(), (
        f"hybrid's stem convolution filters (its patch embedding is a {proj.kernel_size[0]}x{proj.kernel_size[1]} "
        f"convolution over the CNN's {proj.in_channels}-channel feature map, not over pixels)")


def inspect(model: VisionTransformer, pixels: torch.Tensor) -> Inspection:
    cfg = model.cfg
    weights, filters = pixel_filters(model)
    components, explained = filter_components(weights)
    grid = tuple(cfg.grid_size)
    return Inspection(components, filters, explained, position_similarity(model.pos_embed, grid),
                      attention_distances(model, pixels), float(patch_distances(grid, cfg.patch_size).max()),
                      len(pixels), cfg.patch_size, grid)


def to_json(i: Inspection, title: str) -> dict:
    """The numbers as JSON (what inspection.json holds, and what `vitserve export` stores in the model file)."""
    return {"title": title, "filters": i.filters, "patch_size": i.patch_size, "grid": list(i.grid),
            "images": i.images, "explained_variance": i.explained.round(6).tolist(),
            "components": i.components.round(5).tolist(), "position_similarity": i.similarity.round(5).tolist(),
            "mean_attention_distance_px": i.distances.round(4).tolist(), "max_distance_px": i.max_distance}


def from_json(data: dict) -> tuple[Inspection, str]:
    """`to_json`'s output back: (Inspection, title); KeyError/ValueError/TypeError when it is not that."""
    inspection = Inspection(np.asarray(data["components"], np.float64), str(data["filters"]),
                            np.asarray(data["explained_variance"], np.float64),
                            np.asarray(data["position_similarity"], np.float64),
                            np.asarray(data["mean_attention_distance_px"], np.float64), float(data["max_distance_px"]),
                            int(data["images"]), int(data["patch_size"]), tuple(int(g) for g in data["grid"]))
    if inspection.components.ndim != 4 or inspection.similarity.shape != (*inspection.grid, *inspection.grid) or \
            inspection.distances.ndim != 2:
        raise ValueError("the inspection's arrays do not have the shapes of components, similarity and distances")
    return inspection, str(data["title"])


class InspectionInputError(ValueError):
    """No images to average the attention distances over: the user's to fix, in one line."""


def inspection_images(channels: int, size: tuple[int, int], count: int, images_dir: str | None,
                      data_dir: str) -> torch.Tensor:
    """uint8 (N, C, H, W) images for the attention distances: the image files of `images_dir`, else Fashion-MNIST's
    test set for a 1-channel 28x28 model. InspectionInputError when neither applies."""
    from vitserve.model.data import fashion_mnist_test_images, load_image

    if count < 1:
        raise InspectionInputError("--images must be at least 1")
    if images_dir:
        folder = Path(images_dir)
        if not folder.is_dir():
            raise InspectionInputError(f"{images_dir} is not a folder")
        files = sorted(p for p in folder.iterdir() if p.is_file())[:count]
        if not files:
            raise InspectionInputError(f"{images_dir} holds no image files")
        return torch.from_numpy(np.stack([load_image(f, size, channels) for f in files]))
    if channels == 1 and tuple(size) == (28, 28):
        try:
            return fashion_mnist_test_images(data_dir)[:count]
        except FileNotFoundError as e:
            raise InspectionInputError(f"{e}, or give --images-dir") from None
    raise InspectionInputError(f"a {channels}-channel {size[0]}x{size[1]} model needs --images-dir (the default "
                               "images are Fashion-MNIST's, 1-channel 28x28)")


def write(inspection: Inspection, out: Path, title: str) -> list[Path]:
    """The three panels (PNG), their numbers (JSON) and a report (Markdown) in `out`; the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    i = inspection
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
