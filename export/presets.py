"""Random-weight models of real architectures, exported for benchmarks: speed does not depend on the weights.

`python -m export.presets NAME OUT.onnx`; `vitserve bench --model NAME` runs it in a child process so that
the serving package never imports torch.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

# name -> (model.vit variant, ViTConfig overrides)
PRESETS = {"vit-s16": ("S/16", {"image_size": (224, 224), "num_classes": 1000}),
           "vit-fmnist-random": ("fmnist", {})}


def export_preset(name: str, out_path: str) -> None:
    import torch

    from export.onnx_export import export_onnx
    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.vit import VisionTransformer, vit_config

    variant, overrides = PRESETS[name]
    torch.manual_seed(0)
    cfg = vit_config(variant, **overrides)
    vit = VisionTransformer(cfg).eval()
    mean, std = ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]) if cfg.in_channels == 3 else ([0.5], [0.5])
    meta = CheckpointMeta(cfg, [f"class_{i}" for i in range(cfg.num_classes)], mean, std, name=name, version="random")
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp) / "checkpoint", vit, meta)
        export_onnx(Path(tmp) / "checkpoint", out_path, verify=False)


if __name__ == "__main__":
    export_preset(sys.argv[1], sys.argv[2])
