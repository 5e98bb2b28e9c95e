"""A stand-in for models/vit-fmnist/model.onnx while the default model does not exist yet.

docker/test.sh bakes it into the image under test only when the default model is missing. It has the
default's interface (one 28x28 channel, Fashion-MNIST's ten labels, 4-pixel patches) but random weights,
so its predictions are well-formed and meaningless. Made with the project's own export, verified.

    .venv/bin/python docker/make_test_model.py build/docker-test/model.onnx
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path


def make_test_model(out_path: Path) -> Path:
    import torch

    from export.onnx_export import export_onnx
    from model.checkpoint import CheckpointMeta, save_checkpoint
    from model.data import FASHION_MNIST_LABELS
    from model.vit import VisionTransformer, vit_config

    torch.manual_seed(0)
    cfg = vit_config("fmnist", embed_dim=32, depth=2, num_heads=2, mlp_dim=64)
    model = VisionTransformer(cfg)
    with torch.no_grad():  # the zero-initialised head would make every prediction a tie
        model.head.weight.normal_(0, 0.5)
    meta = CheckpointMeta(cfg, list(FASHION_MNIST_LABELS), [0.286], [0.353], name="vit-fmnist-docker-test",
                          version="0")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = save_checkpoint(Path(tmp) / "checkpoint", model.eval(), meta)
        export_onnx(checkpoint, out_path)
    return out_path


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository's model/ and export/
    out = Path(sys.argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    print(make_test_model(out))
