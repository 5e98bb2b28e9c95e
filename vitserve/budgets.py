"""Token budgets: the cheaper input grids one model file serves, and the one way an image is brought to them.

The exported graph takes any input grid (its position embeddings are interpolated inside it), so a smaller grid is
a shorter sequence, and a shorter sequence costs less: every weight is used once per token, and attention adds
2 tokens² x width per block. A *rung* is one such grid; a file's *ladder* is its rungs from the trained grid (the
full budget) down to about a quarter of its tokens. `vitserve export --eval` measures each rung's accuracy on the
labelled set, through `resample`, the same function the server brings an image to a rung with, and stores the
ladder in the file (`vitserve.budgets`); a file without one gets `derived_ladder` (no accuracies).

Imports numpy and Pillow only: export (which measures each rung) and the service (which serves them) share it.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

MAX_RUNGS = 5
LOWEST_TOKEN_SHARE = 0.25  # the cheapest rung keeps at least this share of the full budget's tokens


@dataclass(frozen=True)
class Rung:
    """One budget: the input grid (height, width) in pixels, its tokens (patches: the sequence the blocks compute
    on, less the class token), its multiply-adds relative to the full budget, and its accuracy on the file's
    labelled set (None: not measured)."""

    grid: tuple[int, int]
    tokens: int
    cost: float
    accuracy: float | None = None

    def to_json(self) -> dict:
        return {"grid": list(self.grid), "tokens": self.tokens, "cost": self.cost,
                "accuracy": self.accuracy}


class LadderError(ValueError):
    """A stored ladder that is not one (the artifact's reader turns it into an ArtifactError)."""


def ladder_grids(image_size: tuple[int, int], patch_size: int) -> list[tuple[int, int]]:
    """The trained grid, then up to MAX_RUNGS - 1 smaller ones: side lengths in whole patches, evenly spaced from
    the trained side down to the smallest whose tokens are at least LOWEST_TOKEN_SHARE of the full budget; a
    non-square grid shrinks both sides in proportion."""
    rows, cols = image_size[0] // patch_size, image_size[1] // patch_size
    full_tokens = rows * cols
    smallest = max(1, math.ceil(rows * math.sqrt(LOWEST_TOKEN_SHARE)))
    sides = list(range(rows, smallest - 1, -1))
    if len(sides) > MAX_RUNGS:  # evenly spaced, both ends kept
        picks = np.linspace(0, len(sides) - 1, MAX_RUNGS).round().astype(int)
        sides = [sides[i] for i in sorted(set(picks.tolist()))]
    grids = []
    for side in sides:
        col_side = max(1, round(cols * side / rows))
        if side * col_side >= LOWEST_TOKEN_SHARE * full_tokens or side == rows:
            grids.append((side * patch_size, col_side * patch_size))
    return grids


def relative_cost(architecture: dict, tokens: int, full_tokens: int) -> float:
    """A rung's multiply-adds over the full budget's: per block, the projections and the MLP use each weight once
    per token (4 D² + 2 D M), and attention adds 2 N² D (N with the class token). Without the dimensions (a file
    that does not say them), the tokens' share."""
    width, depth = architecture.get("embed_dim"), architecture.get("depth")
    mlp = architecture.get("mlp_dim") or (4 * width if width else None)
    if not (width and depth and mlp):
        return tokens / full_tokens

    def block(n: int) -> float:
        n += 1  # the class token
        return n * (4 * width * width + 2 * width * mlp) + 2 * n * n * width
    return block(tokens) / block(full_tokens)


def derived_ladder(image_size: tuple[int, int], patch_size: int, architecture: dict) -> tuple[Rung, ...]:
    """The ladder of a file that stores none: its grids and their costs, no accuracies."""
    grids = ladder_grids(image_size, patch_size)
    full_tokens = _tokens(grids[0], patch_size)
    return tuple(Rung(grid, _tokens(grid, patch_size),
                      round(relative_cost(architecture, _tokens(grid, patch_size), full_tokens), 4)) for grid in grids)


def _tokens(grid: tuple[int, int], patch_size: int) -> int:
    return (grid[0] // patch_size) * (grid[1] // patch_size)


def ladder_to_json(ladder: tuple[Rung, ...]) -> str:
    return json.dumps([rung.to_json() for rung in ladder])


def ladder_from_json(text: str, image_size: tuple[int, int], patch_size: int) -> tuple[Rung, ...]:
    """A stored ladder back, checked: the first rung the trained grid, grids in whole patches, tokens that agree
    with them, falling strictly, accuracies within [0, 1] or null; LadderError otherwise."""
    try:
        rows = json.loads(text)
        ladder = tuple(Rung((int(r["grid"][0]), int(r["grid"][1])), int(r["tokens"]), float(r["cost"]),
                            None if r.get("accuracy") is None else float(r["accuracy"])) for r in rows)
    except (ValueError, TypeError, KeyError, IndexError) as e:
        raise LadderError(f"not a ladder of budgets: {e}") from None
    if not ladder or ladder[0].grid != tuple(image_size):
        raise LadderError(f"the first budget must be the trained grid {list(image_size)}")
    for rung in ladder:
        if rung.grid[0] % patch_size or rung.grid[1] % patch_size or rung.tokens != _tokens(rung.grid, patch_size) \
                or not 0 < rung.cost <= 1 or (rung.accuracy is not None and not 0 <= rung.accuracy <= 1):
            raise LadderError(f"budget {rung.to_json()} is not whole patches of {patch_size} px with matching "
                              f"tokens, a cost in (0, 1] and an accuracy in [0, 1]")
    if any(b.tokens >= a.tokens for a, b in zip(ladder, ladder[1:])):
        raise LadderError("budgets must fall strictly in tokens")
    return ladder


def resample(pixels: np.ndarray, grid: tuple[int, int]) -> np.ndarray:
    """float32 (..., C, H, W) normalised pixels -> (..., C, h, w) at `grid`: each channel of each image resized
    alone with Pillow's bilinear filter, which widens its support when it shrinks (an antialiased area average, as
    torch's `interpolate(mode="bilinear", antialias=True)` that training uses). Resizing is linear, so resizing the
    normalised pixels equals normalising the resized ones to float32 rounding; and one image's result never depends
    on the others beside it."""
    height, width = grid
    if pixels.shape[-2:] == (height, width):
        return pixels
    flat = np.ascontiguousarray(pixels, np.float32).reshape(-1, *pixels.shape[-2:])
    out = np.empty((len(flat), height, width), np.float32)
    for i, channel in enumerate(flat):
        out[i] = np.asarray(Image.fromarray(channel).resize((width, height), Image.Resampling.BILINEAR))
    return out.reshape(*pixels.shape[:-2], height, width)
