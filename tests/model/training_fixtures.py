"""Helpers for the training tests (conftest.py holds their fixtures): image folders on disk, strict JSON."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image


def write_image_folder(root: Path, counts: dict[str, int], size: int = 8) -> Path:
    """root/<class>/<i>.png: grey noise, each class a brighter band of rows, `counts[class]` images each."""
    rng = np.random.default_rng(0)
    for index, (name, count) in enumerate(counts.items()):
        (root / name).mkdir(parents=True, exist_ok=True)
        for i in range(count):
            image = rng.integers(0, 60, (size, size), dtype=np.uint8)
            image[index * size // len(counts):(index + 1) * size // len(counts)] += 150
            Image.fromarray(image).save(root / name / f"{i}.png")
    return root


def read_strict_json(path: Path):
    """json.loads that refuses NaN and Infinity, as strict readers (JavaScript, Go, jq) do."""
    def refuse(constant):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")
    return json.loads(Path(path).read_text(), parse_constant=refuse)
