"""Random-weight models: a checkpoint, and its ONNX export, of a real architecture without training.

The one place that makes them: benchmarks (speed does not depend on the weights), the Docker test's stand-in
for a default model not trained yet, and the test suite's tiny models.

    python -m vitserve.export.presets NAME OUT.onnx [--verify]

`vitserve bench --model NAME` runs it in a child process, so that the serving world never imports torch.
"""
from __future__ import annotations

import argparse
import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

IMAGENET_MEAN, IMAGENET_STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
FASHION_MNIST_MEAN, FASHION_MNIST_STD = [0.286], [0.353]


@dataclass(frozen=True)
class RandomModel:
    """A model.vit variant with overrides, and the metadata its checkpoint carries."""

    variant: str
    overrides: dict = field(default_factory=dict)
    labels: list[str] | None = None  # default: class_0 ... class_{K-1}
    mean: list[float] | None = None  # default: ImageNet's for 3 channels, 0.5 for 1
    std: list[float] | None = None
    name: str = "random"
    version: str = "random"
    metrics: dict = field(default_factory=dict)


PRESETS = {
    "vit-s16": RandomModel("S/16", {"image_size": (224, 224), "num_classes": 1000}, name="vit-s16",
                           mean=IMAGENET_MEAN, std=IMAGENET_STD),
    "vit-b16": RandomModel("B/16", {"image_size": (224, 224), "num_classes": 1000}, name="vit-b16",
                           mean=IMAGENET_MEAN, std=IMAGENET_STD),
    "vit-fmnist-random": RandomModel("fmnist", name="vit-fmnist-random", mean=[0.5], std=[0.5]),
    # the Docker test's stand-in for models/vit-fmnist/model.onnx: its interface, a fraction of its size
    "vit-fmnist-stand-in": RandomModel("fmnist", {"embed_dim": 32, "depth": 2, "num_heads": 2, "mlp_dim": 64},
                                       mean=FASHION_MNIST_MEAN, std=FASHION_MNIST_STD,
                                       name="vit-fmnist-docker-test", version="0"),
}


def random_checkpoint(spec: RandomModel, out_dir: str | Path, seed: int = 0) -> Path:
    """Save a checkpoint of `spec` with seeded random weights; returns its directory."""
    import torch

    from vitserve.model.checkpoint import CheckpointMeta, save_checkpoint
    from vitserve.model.data import FASHION_MNIST_LABELS
    from vitserve.model.vit import VisionTransformer, vit_config

    torch.manual_seed(seed)
    cfg = vit_config(spec.variant, **spec.overrides)
    vit = VisionTransformer(cfg)
    with torch.no_grad():  # the zero-initialised head would make every prediction a tie, and a near-zero
        vit.head.weight.normal_(0, 0.5)  # position embedding would hide interpolation mistakes
        vit.pos_embed.normal_(0, 0.5)
    labels = spec.labels or (list(FASHION_MNIST_LABELS) if spec.variant == "fmnist" and cfg.num_classes == 10
                             else [f"class_{i}" for i in range(cfg.num_classes)])
    default_mean, default_std = (IMAGENET_MEAN, IMAGENET_STD) if cfg.in_channels == 3 else ([0.5], [0.5])
    meta = CheckpointMeta(cfg, labels, spec.mean or default_mean, spec.std or default_std, name=spec.name,
                          version=spec.version, metrics=dict(spec.metrics))
    return save_checkpoint(Path(out_dir), vit.eval(), meta)


def export_random_model(spec: RandomModel, out_path: str | Path, *, verify: bool = False, seed: int = 0,
                        precision: str = "fp32", relevance: bool = True):
    """`spec` with random weights, exported to `out_path` (`relevance`: with the relevance path); returns the
    ExportReport."""
    from vitserve.export.onnx_export import export_onnx

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = random_checkpoint(spec, Path(tmp) / "checkpoint", seed)
        return export_onnx(checkpoint, out_path, verify=verify, precision=precision, relevance=relevance)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vitserve.export.presets", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(PRESETS))
    parser.add_argument("out", type=Path, help="the ONNX file to write")
    parser.add_argument("--verify", action="store_true", help="verify against PyTorch, as `vitserve export` does")
    parser.add_argument("--precision", choices=("fp32", "fp16", "int8"), default="fp32")
    parser.add_argument("--no-relevance", dest="relevance", action="store_false",
                        help="leave the relevance path out (map=relevance then unavailable): ViT-B/16 at depth 2 "
                             "exports in 6.7 s instead of 21.3")
    parser.add_argument("--override", action="append", default=[], metavar="FIELD=VALUE",
                        help="a model.vit config field changed, e.g. depth=2 (a block's cost without the whole "
                             "model's export time); repeatable")
    args = parser.parse_args(argv)
    spec = PRESETS[args.name]
    if args.override:
        overrides = dict(spec.overrides)
        for item in args.override:
            field_name, sep, value = item.partition("=")
            if not sep or not value.lstrip("-").isdigit():
                parser.error(f"--override takes FIELD=INTEGER, not {item!r}")
            overrides[field_name] = int(value)
        spec = dataclasses.replace(spec, overrides=overrides)
    try:
        report = export_random_model(spec, args.out, verify=args.verify, precision=args.precision,
                                     relevance=args.relevance)
    except TypeError as e:  # ViTConfig's own refusal of a field it does not have
        if not args.override:
            raise
        parser.error(f"--override: {e}")
    print(report.path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
