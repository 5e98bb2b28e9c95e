"""Each token budget's accuracy, measured at export on the labelled set (`vitserve export --eval`): the float32 fast
graph through ONNX Runtime, each image brought to the rung's grid by `vitserve.budgets.resample`, the function the
server uses, so that a rung served through the server answers as the table says."""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, normalize_pixels
from vitserve.budgets import Rung, resample

BATCH = 250


def measure_ladder(session, images: np.ndarray, labels: np.ndarray, mean: list[float], std: list[float],
                   ladder: tuple[Rung, ...]) -> tuple[Rung, ...]:
    """The ladder with each rung's top-1 accuracy on uint8 (N, C, H, W) `images` at the trained size."""
    correct = np.zeros(len(ladder), np.int64)
    for start in range(0, len(images), BATCH):
        pixels = normalize_pixels(images[start:start + BATCH], mean, std)  # (B, C, H, W)
        truth = labels[start:start + BATCH]
        for i, rung in enumerate(ladder):
            logits = session.run([OUTPUT_NAMES[0]], {INPUT_NAME: resample(pixels, rung.grid)})[0]  # (B, K)
            correct[i] += int((logits.argmax(axis=1) == truth).sum())
    return tuple(replace(rung, accuracy=round(float(c) / len(images), 6)) for rung, c in zip(ladder, correct))


def ladder_table(ladder: tuple[Rung, ...]) -> str:
    """One line per rung, for the export's summary."""
    return "; ".join(f"{r.grid[0]}x{r.grid[1]} px {r.tokens} tokens cost {r.cost:.2f}"
                     + ("" if r.accuracy is None else f" {r.accuracy:.2%}") for r in ladder)
