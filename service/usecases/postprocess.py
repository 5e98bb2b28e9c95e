"""Model outputs -> answer parts: softmax top-k, the rollout grid scaled to [0, 1], heat-map PNGs.

Pure functions of arrays (and, for the overlay, the decoded image); no HTTP here. `encode_result` puts the
parts together into the response models, for the server and for `vitserve predict` alike. Heat-maps and
overlays are drawn at `PreparedImage.render_size` (the input's size within the service's
`max_rollout_image_side`), so their cost does not grow with the input's.
"""
from __future__ import annotations

import base64
import io
from functools import cache

import numpy as np
from PIL import Image

from vitserve.artifact import softmax
from vitserve.service.schemas.v1 import Prediction, RolloutFormat, RolloutGrid, RolloutImage
from vitserve.service.usecases.preprocess import PreparedImage

# A perceptual dark-blue -> cyan -> yellow -> red ramp (anchor colours of a 'turbo'-like map).
_RAMP = np.array([[48, 18, 59], [70, 107, 227], [40, 188, 235], [50, 242, 152], [164, 252, 60],
                  [251, 185, 56], [245, 105, 24], [122, 4, 3]], np.float32)
_RAMP_LEVELS = 1024  # entries of the table `colorize` gathers from: within a level of the exact ramp (tested)


def top_k(probabilities: np.ndarray, k: int) -> list[tuple[int, float]]:
    """(K,) -> the k most probable (index, probability), highest first; ties keep the lower index first."""
    order = np.argsort(-probabilities, kind="stable")[:k]
    return [(int(i), float(probabilities[i])) for i in order]


def top_k_capped(k: int, classes: int) -> str | None:
    """The sentence that says a request's top_k was more than the model's classes, or None when it was not."""
    if k <= classes:
        return None
    return f"top_k={k} is more than the model's {classes} classes: all {classes} are returned"


def six_places(grid: np.ndarray) -> list[list[float]]:
    """The grid's values rounded to 6 decimal places (short in JSON), as nested lists: in numpy, not a Python
    `round` per value (196 of them were most of a /v1 answer's postprocessing). n / 1e6 is the double nearest to the
    decimal n x 10^-6; a value within a rounding error of a half step may round to the other neighbour."""
    return (np.rint(grid.astype(np.float64) * 1e6) / 1e6).tolist()


def scale_unit(grid: np.ndarray) -> np.ndarray:
    """Min-max scale to [0, 1]; a constant map becomes all zeros."""
    grid = grid.astype(np.float32)
    low, high = float(grid.min()), float(grid.max())
    if not np.isfinite(low) or not np.isfinite(high) or high - low <= 1e-12:
        return np.zeros_like(grid)
    return (grid - low) / (high - low)


def ramp_colors(unit: np.ndarray) -> np.ndarray:
    """Values in [0, 1] (any shape) -> (..., 3) uint8: linear interpolation between the ramp's anchors."""
    position = np.clip(unit, 0, 1) * (len(_RAMP) - 1)
    low = np.floor(position).astype(int).clip(0, len(_RAMP) - 2)
    frac = (position - low)[..., None]
    return (_RAMP[low] * (1 - frac) + _RAMP[low + 1] * frac).round().astype(np.uint8)


@cache
def _ramp_table() -> np.ndarray:
    """(_RAMP_LEVELS, 3) uint8: the ramp sampled finely enough that a gather is within a level of `ramp_colors`."""
    return ramp_colors(np.linspace(0.0, 1.0, _RAMP_LEVELS))


def colorize(unit: np.ndarray) -> np.ndarray:
    """(H, W) in [0, 1] -> (H, W, 3) uint8 through the ramp: one gather from a table instead of a dozen float
    passes over (H, W, 3) arrays, which dominated a heat-map's memory and time."""
    index = np.rint(np.clip(unit, 0, 1) * np.float32(_RAMP_LEVELS - 1)).astype(np.uint16)
    return _ramp_table()[index]


def heatmap(unit_grid: np.ndarray, size: tuple[int, int], box: tuple[int, int, int, int]) -> Image.Image:
    """The patch grid stretched over `box` of an image of `size` (W, H); outside the box (cropped away) is 0."""
    left, top, right, bottom = box
    canvas = np.zeros((size[1], size[0]), np.float32)
    grid_image = Image.fromarray(unit_grid.astype(np.float32))
    canvas[top:bottom, left:right] = np.asarray(grid_image.resize((right - left, bottom - top),
                                                                  Image.Resampling.BILINEAR))
    return Image.fromarray(colorize(canvas))


def scale_box(box: tuple[int, int, int, int], size: tuple[int, int],
              render: tuple[int, int]) -> tuple[int, int, int, int]:
    """`box` of an image of `size` (W, H) -> the same box on that image drawn at `render` (W, H)."""
    scale_x, scale_y = render[0] / size[0], render[1] / size[1]
    left, top = min(round(box[0] * scale_x), render[0] - 1), min(round(box[1] * scale_y), render[1] - 1)
    # At least one rendered pixel each way: a thin crop of a wide input must not round away to an empty box.
    return left, top, max(round(box[2] * scale_x), left + 1), max(round(box[3] * scale_y), top + 1)


def overlay(image: Image.Image, heat: Image.Image, alpha: float = 0.5) -> Image.Image:
    return Image.blend(image.convert("RGB"), heat, alpha)


def png_base64(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", compress_level=1)  # speed over size: this is on the request path
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def encode_result(labels: list[str], prepared: PreparedImage, logits: np.ndarray, rollout: np.ndarray, k: int,
                  rollout_format: RolloutFormat, temperature: float | np.ndarray = 1.0
                  ) -> tuple[list[Prediction], RolloutGrid | RolloutImage | None]:
    """One image's logits and rollout -> its top-k predictions (probabilities at `temperature`, the model's for
    these logits: ModelInfo.temperature_for) and the rollout in the asked format."""
    probabilities = softmax(logits, temperature)
    predictions = [Prediction(index=i, label=labels[i], score=p)
                   for i, p in top_k(probabilities, min(k, len(labels)))]
    if rollout_format == "none":
        return predictions, None
    unit = scale_unit(rollout)  # (h, w) in [0, 1]
    if rollout_format == "grid":
        return predictions, RolloutGrid(height=unit.shape[0], width=unit.shape[1], values=six_places(unit))
    # Drawn at the bounded render size, never the input's: a 6320x6320 input would take gigabytes.
    render = prepared.render_size
    heat = heatmap(unit, render, scale_box(prepared.crop_box, prepared.size, render))
    if rollout_format == "png":
        image = heat
    else:
        assert prepared.source is not None, "an overlay's image was prepared with keep_source"
        image = overlay(prepared.source, heat)  # the source is kept at `render`
    return predictions, RolloutImage(height=image.height, width=image.width, data=png_base64(image))
