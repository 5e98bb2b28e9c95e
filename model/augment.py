"""Batched image augmentations on uint8/float tensors (B, C, H, W), written with torch; normalisation is
`vitserve.artifact.normalize_pixels`, the one reference for it.

Working on whole batches keeps augmentation off the per-image Python path, which on two CPU
cores would cost more than the model's forward pass. AugmentConfig lives in model.config (no torch there).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from vitserve.artifact import normalize_pixels
from vitserve.model.config import AugmentConfig  # re-exported: `from model.augment import AugmentConfig`


def random_crop_with_padding(x: torch.Tensor, padding: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """Zero-pad by `padding` on each side, then crop back to the original size at a random offset."""
    if padding <= 0:
        return x
    B, C, H, W = x.shape
    padded = F.pad(x, (padding,) * 4)
    dy = torch.randint(0, 2 * padding + 1, (B,), generator=generator)
    dx = torch.randint(0, 2 * padding + 1, (B,), generator=generator)
    rows = (dy[:, None] + torch.arange(H)[None]).view(B, 1, H, 1).expand(B, C, H, W + 2 * padding)
    out = padded.gather(2, rows)  # (B, C, H, W + 2p)
    cols = (dx[:, None] + torch.arange(W)[None]).view(B, 1, 1, W).expand(B, C, H, W)
    return out.gather(3, cols)


def random_horizontal_flip(x: torch.Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> torch.Tensor:
    flip = torch.rand(x.shape[0], generator=generator) < p
    return torch.where(flip.view(-1, 1, 1, 1), x.flip(-1), x)


def random_resized_crop(x: torch.Tensor, scale: tuple[float, float], ratio: tuple[float, float],
                        generator: torch.Generator | None = None) -> torch.Tensor:
    """Inception-style crop of a random area and aspect ratio, resized back to (H, W) bilinearly.

    One affine sampling grid per image, so the whole batch is a single grid_sample call.
    """
    B = x.shape[0]
    area = torch.empty(B).uniform_(*scale, generator=generator)
    log_r = torch.empty(B).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator)
    aspect = log_r.exp()
    w = (area * aspect).sqrt().clamp(max=1.0)  # crop size as a fraction of the image
    h = (area / aspect).sqrt().clamp(max=1.0)
    cx = (torch.rand(B, generator=generator) * 2 - 1) * (1 - w)  # centre in [-1, 1] coordinates
    cy = (torch.rand(B, generator=generator) * 2 - 1) * (1 - h)
    theta = torch.zeros(B, 2, 3)
    theta[:, 0, 0], theta[:, 0, 2] = w, cx
    theta[:, 1, 1], theta[:, 1, 2] = h, cy
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x.float(), grid, mode="bilinear", padding_mode="border", align_corners=False)


def random_erasing(x: torch.Tensor, p: float, scale: tuple[float, float], ratio: tuple[float, float],
                   generator: torch.Generator | None = None) -> torch.Tensor:
    """Zhong et al. 2017: replace one random rectangle per chosen image with Gaussian noise.

    Applied after normalisation, so N(0, 1) noise matches the data's scale.
    """
    B, C, H, W = x.shape
    area = torch.empty(B).uniform_(*scale, generator=generator) * H * W
    aspect = torch.empty(B).uniform_(math.log(ratio[0]), math.log(ratio[1]), generator=generator).exp()
    eh = (area * aspect).sqrt().round().clamp(1, H).long()
    ew = (area / aspect).sqrt().round().clamp(1, W).long()
    top = (torch.rand(B, generator=generator) * (H - eh + 1)).long()
    left = (torch.rand(B, generator=generator) * (W - ew + 1)).long()
    ys, xs = torch.arange(H).view(1, H, 1), torch.arange(W).view(1, 1, W)
    inside = ((ys >= top.view(B, 1, 1)) & (ys < (top + eh).view(B, 1, 1))
              & (xs >= left.view(B, 1, 1)) & (xs < (left + ew).view(B, 1, 1)))  # (B, H, W)
    chosen = (torch.rand(B, generator=generator) < p).view(B, 1, 1)
    mask = (inside & chosen).unsqueeze(1)  # (B, 1, H, W)
    noise = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    return torch.where(mask, noise, x)


def normalize(x: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """uint8 or float (B, C, H, W) in [0, 255] on the CPU -> float32 `(x / 255 - mean) / std` per channel.

    `vitserve.artifact.normalize_pixels` itself, the reference the exported graph's callers are tested against,
    so training sees the very floats serving will; training calls it before moving a batch to the device.
    """
    return torch.from_numpy(normalize_pixels(x.numpy(), mean, std, channel_axis=1))


def augment_batch(images: torch.Tensor, cfg: AugmentConfig, mean: list[float], std: list[float],
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """uint8 (B, C, H, W) -> augmented, normalised float (B, C, H, W)."""
    x = images.float()
    if cfg.crop == "pad":
        x = random_crop_with_padding(x, cfg.crop_padding, generator)
    elif cfg.crop == "rrc":
        x = random_resized_crop(x, cfg.rrc_scale, cfg.rrc_ratio, generator)
    elif cfg.crop != "none":
        raise ValueError(f"unknown crop {cfg.crop!r}: pad, rrc or none")
    if cfg.hflip:
        x = random_horizontal_flip(x, generator=generator)
    x = normalize(x, mean, std)
    if cfg.erasing_prob > 0:
        x = random_erasing(x, cfg.erasing_prob, cfg.erasing_scale, cfg.erasing_ratio, generator)
    return x
