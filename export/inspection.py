"""The paper's Figure 7 numbers stored in the exported file, so that a server without torch can show them.

`vitserve export` inspects the float32 model (model/inspection.py) and writes the numbers as JSON under the
artifact's `INSPECTION_KEY`; `GET /v1/models/{name}/inspect`, the web page's model card and
`vitserve inspect MODEL.onnx` read them back. The attention distances average over the images the user names,
else Fashion-MNIST's test images for a 1-channel 28x28 model, else scikit-image's photos (the export's own
verification images, so that any model gets its distances with nothing to download).
"""
from __future__ import annotations

import json

import torch

from vitserve.model.augment import normalize
from vitserve.model.checkpoint import CheckpointMeta
from vitserve.model.config import FASHION_MNIST_DIR
from vitserve.model.inspection import inspect, inspection_images
from vitserve.model.inspection_report import InspectionInputError, to_json
from vitserve.model.vit import VisionTransformer

DEFAULT_IMAGES = 256  # `vitserve export --inspection-images`'s default


def inspection_pixels(vit: VisionTransformer, meta: CheckpointMeta, count: int = DEFAULT_IMAGES,
                      images_dir: str | None = None) -> tuple[torch.Tensor, str]:
    """Normalised pixels (N, C, H, W) at the trained size and where they came from."""
    from vitserve.export.verify import photo_batch

    cfg = vit.cfg
    try:
        images = inspection_images(cfg.in_channels, cfg.image_size, count, images_dir, FASHION_MNIST_DIR)
    except InspectionInputError:
        if images_dir:
            raise
        photos = torch.from_numpy(photo_batch(cfg.in_channels, cfg.image_size, meta.mean, meta.std))
        return photos[:count], f"{min(count, len(photos))} scikit-image photos"
    source = images_dir or "Fashion-MNIST's test set"
    return normalize(images, meta.mean, meta.std), f"{len(images)} images of {source}"


def inspection_json(vit: VisionTransformer, meta: CheckpointMeta, pixels: torch.Tensor) -> str:
    """What the artifact stores under INSPECTION_KEY."""
    return json.dumps(to_json(inspect(vit, pixels), f"{meta.name} {meta.version}"), separators=(",", ":"))
