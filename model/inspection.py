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
report (`model/cli.py`, `model/inspection_report.py`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from vitserve.model.hybrid import HybridEmbed
from vitserve.model.inspection_report import Inspection, InspectionInputError
from vitserve.model.vit import PatchEmbed, VisionTransformer

SHOWN_COMPONENTS = 28  # as Figure 7 (left) shows them


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
    embed = model.patch_embed
    if isinstance(embed, PatchEmbed):
        return embed.proj.weight, "patch-embedding filters"
    assert isinstance(embed, HybridEmbed), "a checkpoint's model embeds with PatchEmbed or HybridEmbed"
    proj = embed.proj
    return embed.stem_filters(), (
        f"hybrid's stem convolution filters (its patch embedding is a {proj.kernel_size[0]}x{proj.kernel_size[1]} "
        f"convolution over the CNN's {proj.in_channels}-channel feature map, not over pixels)")


def inspect(model: VisionTransformer, pixels: torch.Tensor) -> Inspection:
    cfg = model.cfg
    weights, filters = pixel_filters(model)
    components, explained = filter_components(weights)
    grid = cfg.grid_size
    return Inspection(components, filters, explained, position_similarity(model.pos_embed, grid),
                      attention_distances(model, pixels), float(patch_distances(grid, cfg.patch_size).max()),
                      len(pixels), cfg.patch_size, grid)


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
