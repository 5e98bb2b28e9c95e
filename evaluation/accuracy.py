"""What the artifact buys, measured: ONNX Runtime accuracy on Fashion-MNIST at several resolutions.

`vitserve evaluate accuracy MODEL.onnx --sizes 28,24,36,56` (its command line is evaluation/cli.py's).
The speed comparison with PyTorch (`vitserve evaluate bench`) lives with the other benchmarks, in bench/raw.py.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, ModelInfo, normalize_pixels
from vitserve.export.verify import cpu_session


def accuracy_at_sizes(model_path: str | Path, images: torch.Tensor, labels: torch.Tensor,
                      sizes: list[tuple[int, int]], *, threads: int = 0, batch_size: int = 500) -> list[dict]:
    """Top-1 accuracy of the ONNX model (CPU) on uint8 images (N, C, h, w), resized (bicubic) to each size."""
    from vitserve.model.data import resize_batch

    session = cpu_session(str(model_path), threads=threads)
    info = ModelInfo.from_metadata(session.get_modelmeta().custom_metadata_map)
    logits_name = OUTPUT_NAMES[0]
    rows = []
    for size in sizes:
        started, correct = time.perf_counter(), 0
        for start in range(0, len(labels), batch_size):
            batch = resize_batch(images[start:start + batch_size], size)
            batch = batch.expand(-1, info.channels, -1, -1) if batch.shape[1] != info.channels else batch
            pixels = normalize_pixels(batch.numpy(), info.mean, info.std, channel_axis=1)  # (B, C, H, W) float32
            (logits,) = session.run([logits_name], {INPUT_NAME: pixels})
            correct += int((logits.argmax(1) == labels[start:start + batch_size].numpy()).sum())
        rows.append({"size": list(size), "trained_size": list(info.image_size), "images": len(labels),
                     "accuracy": correct / len(labels), "seconds": round(time.perf_counter() - started, 1)})
    return rows


def onnx_accuracy(model_path: str | Path, sizes: list[tuple[int, int]], *, data_dir: str | Path,
                  limit: int | None = None, threads: int = 0) -> list[dict]:
    """Accuracy on the Fashion-MNIST test split (10,000 images unless `limit`)."""
    from vitserve.model.data import load_fashion_mnist

    test = load_fashion_mnist(data_dir).test
    images, labels = test.images[:limit], test.labels[:limit]
    return accuracy_at_sizes(model_path, images, labels, sizes, threads=threads)
