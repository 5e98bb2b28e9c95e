"""What the artifact buys, measured: ONNX Runtime accuracy at several resolutions, and speed vs PyTorch.

`python -m export.evaluate accuracy MODEL.onnx --sizes 28,24,36,56` and
`python -m export.evaluate bench --checkpoint DIR` (or `--variant small` for ViT-S/16 at 224).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from export.verify import cpu_session


def normalise(images: torch.Tensor, mean: list[float], std: list[float]) -> np.ndarray:
    """uint8 (N, C, H, W) -> float32, as the service does: (x / 255 - mean) / std."""
    x = images.numpy().astype(np.float32) / 255.0
    return ((x - np.reshape(mean, (1, -1, 1, 1))) / np.reshape(std, (1, -1, 1, 1))).astype(np.float32)


def accuracy_at_sizes(model_path: str | Path, images: torch.Tensor, labels: torch.Tensor,
                      sizes: list[tuple[int, int]], *, threads: int = 0, batch_size: int = 500) -> list[dict]:
    """Top-1 accuracy of the ONNX model (CPU) on uint8 images (N, C, h, w), resized (bicubic) to each size."""
    from model.data import resize_batch

    session = cpu_session(str(model_path), threads=threads)
    props = session.get_modelmeta().custom_metadata_map
    mean, std = json.loads(props["vitserve.mean"]), json.loads(props["vitserve.std"])
    channels = int(props["vitserve.channels"])
    rows = []
    for size in sizes:
        started, correct = time.perf_counter(), 0
        for start in range(0, len(labels), batch_size):
            batch = resize_batch(images[start:start + batch_size], size)
            batch = batch.expand(-1, channels, -1, -1) if batch.shape[1] != channels else batch
            (logits,) = session.run(["logits"], {"pixel_values": normalise(batch, mean, std)})
            correct += int((logits.argmax(1) == labels[start:start + batch_size].numpy()).sum())
        trained = [int(props["vitserve.image_height"]), int(props["vitserve.image_width"])]
        rows.append({"size": list(size), "trained_size": trained, "images": len(labels),
                     "accuracy": correct / len(labels), "seconds": round(time.perf_counter() - started, 1)})
    return rows


def onnx_accuracy(model_path: str | Path, sizes: list[tuple[int, int]], *, data_dir: str | Path,
                  limit: int | None = None, threads: int = 0) -> list[dict]:
    """Accuracy on the Fashion-MNIST test split (10,000 images unless `limit`)."""
    from model.data import load_fashion_mnist

    test = load_fashion_mnist(data_dir).test
    images, labels = test.images[:limit], test.labels[:limit]
    return accuracy_at_sizes(model_path, images, labels, sizes, threads=threads)


def variant_model(name: str):
    """A named variant with random weights at its default resolution, e.g. 'small' = ViT-S/16 at 224."""
    from model.vit import VisionTransformer, vit_config

    torch.manual_seed(0)
    return VisionTransformer(vit_config(name)).eval()


def images_per_second(run, batch: int, min_seconds: float) -> tuple[float, int]:
    """Calls `run()` (one batch) after a warm-up until min_seconds and at least 3 calls have passed."""
    run()
    calls, started = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - started < min_seconds:
        run()
        calls += 1
    return batch * calls / (time.perf_counter() - started), calls


def benchmark(vit, batch_sizes: list[int], *, threads: int | None = None, min_seconds: float = 3.0,
              rounds: int = 3) -> list[dict]:
    """images/s of ONNX Runtime (CPU) and PyTorch eager, logits only (fused attention) and logits + rollout.

    The four cases of a batch size take turns for `rounds` rounds and each keeps its best rate, so a
    burst of load from other processes penalises one round, not one case.
    """
    from export.onnx_export import OUTPUT_NAMES, ViTWithRollout, example_input, to_onnx

    if threads:
        torch.set_num_threads(threads)
    patch = vit.cfg.patch_size
    modules = {False: vit, True: ViTWithRollout(vit)}
    sessions = {False: cpu_session(to_onnx(vit, patch, example_input(vit), ("logits",)), threads=threads or 0),
                True: cpu_session(to_onnx(modules[True], patch, example_input(vit), OUTPUT_NAMES), threads=threads or 0)}
    rows = []
    for batch in batch_sizes:
        x = example_input(vit, batch)
        feed = {"pixel_values": x.numpy()}
        cases = {("torch", r): (lambda r=r: modules[r](x)) for r in (False, True)}
        cases.update({("onnxruntime", r): (lambda r=r: sessions[r].run(None, feed)) for r in (False, True)})
        best = dict.fromkeys(cases, 0.0)
        with torch.inference_mode():
            for _ in range(rounds):
                for key, run in cases.items():
                    best[key] = max(best[key], images_per_second(run, batch, min_seconds / rounds)[0])
        rows += [{"runtime": runtime, "rollout": rollout, "batch": batch, "images_per_s": round(rate, 1),
                  "size": list(vit.cfg.image_size), "threads": threads or torch.get_num_threads()}
                 for (runtime, rollout), rate in best.items()]
    return rows


def main(argv: list[str] | None = None) -> int:
    from export.cli import add_evaluate_parser

    parser = argparse.ArgumentParser(prog="python -m export.evaluate")
    add_evaluate_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["evaluate", *(sys.argv[1:] if argv is None else argv)])
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
