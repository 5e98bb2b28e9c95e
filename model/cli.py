"""`vitserve train` and `vitserve import`: argument parsing only; torch is imported when a command runs."""
from __future__ import annotations

import argparse
import json


def _size(text: str) -> list[int]:
    parts = [int(p) for p in text.lower().replace("x", ",").split(",")]
    return parts * 2 if len(parts) == 1 else parts


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a ViT on Fashion-MNIST or an image folder",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data", default="fashion-mnist", help="'fashion-mnist' or an ImageFolder root (one folder per class)")
    p.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist", help="Fashion-MNIST IDX directory")
    p.add_argument("--model", default="fmnist", help="variant: fmnist, tiny, small, base, large, huge, B/16, L/32, ...")
    p.add_argument("--image-size", type=_size, help="training resolution H[xW] (default: the data's own)")
    p.add_argument("--patch-size", type=int)
    p.add_argument("--embed-dim", type=int)
    p.add_argument("--depth", type=int)
    p.add_argument("--num-heads", type=int)
    p.add_argument("--mlp-dim", type=int)
    p.add_argument("--dropout", type=float)
    p.add_argument("--attention-dropout", type=float)
    p.add_argument("--representation-size", type=int, help="hidden size of the pre-training MLP head")
    p.add_argument("--channels", type=int, default=3, choices=(1, 3), help="for image folders")
    p.add_argument("--epochs", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=1e-5)
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--warmup-epochs", type=float, default=3.0)
    p.add_argument("--label-smoothing", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--crop", choices=("pad", "rrc", "none"), default="pad")
    p.add_argument("--crop-padding", type=int, default=2)
    p.add_argument("--no-hflip", action="store_true")
    p.add_argument("--erasing-prob", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--out", default="runs/train", help="output directory (checkpoint/, log.csv, curves.png)")
    p.add_argument("--resume", action="store_true", help="continue from the last epoch saved in --out")
    p.add_argument("--init-from", help="fine-tune from this checkpoint (position embeddings resampled)")
    p.add_argument("--name", default="vit")
    p.add_argument("--version", default="1")
    p.add_argument("--threads", type=int)
    p.add_argument("--max-steps-per-epoch", type=int, help=argparse.SUPPRESS)
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run_train)


def run_train(args) -> int:
    from model.augment import AugmentConfig
    from model.train import TrainConfig, train

    overrides = {k: getattr(args, k) for k in ("patch_size", "embed_dim", "depth", "num_heads", "mlp_dim",
                                              "dropout", "attention_dropout", "representation_size")
                 if getattr(args, k) is not None}
    if args.image_size:
        overrides["image_size"] = args.image_size
    cfg = TrainConfig(
        data=args.data, data_dir=args.data_dir, model=args.model, model_overrides=overrides, channels=args.channels,
        epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr,
        weight_decay=args.weight_decay, warmup_epochs=args.warmup_epochs, label_smoothing=args.label_smoothing,
        grad_clip=args.grad_clip, seed=args.seed, out_dir=args.out, resume=args.resume, init_from=args.init_from,
        augment=AugmentConfig(crop=args.crop, crop_padding=args.crop_padding, hflip=not args.no_hflip,
                              erasing_prob=args.erasing_prob),
        val_fraction=args.val_fraction, name=args.name, version=args.version, threads=args.threads,
        max_steps_per_epoch=args.max_steps_per_epoch, progress=not args.no_progress)
    row = train(cfg)
    if row:
        print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}))
    return 0


def add_import_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "import", help="convert a local timm or Hugging Face ViT checkpoint into a vitserve checkpoint",
        description="Convert a timm VisionTransformer state dict or a Hugging Face ViTForImageClassification "
                    "checkpoint. Depth, width, patch size, grid, classes, channels and MLP size are read from "
                    "the weights; checkpoints using features vitserve's ViT lacks (layer scale, register "
                    "tokens, fc_norm, distillation token, ...) are refused with the keys named.")
    p.add_argument("source", metavar="FILE",
                   help="timm: a .pth/.pt/.bin or .safetensors state dict; hf: a save_pretrained directory "
                        "(or its weights file) with config.json")
    p.add_argument("--format", required=True, choices=("timm", "hf"), dest="source_format")
    p.add_argument("--out", required=True, metavar="DIR", help="checkpoint directory to write")
    p.add_argument("--num-heads", type=int, help="attention heads; required for timm (its state dicts do not "
                                                 "record it), read from config.json for hf")
    p.add_argument("--image-size", type=_size, metavar="H[xW]",
                   help="resolution the position embeddings were learned at (default: hf config.json, "
                        "else a square grid)")
    p.add_argument("--labels", metavar="FILE", help="class names: one per line, or a JSON list "
                                                    "(default: hf config.json id2label, else class_0..class_K-1)")
    p.add_argument("--mean", type=float, nargs="+", help="per-channel mean, or one value for all (default: "
                                                         "hf preprocessor_config.json if present, else 0.5 as "
                                                         "timm and HF ViTs use)")
    p.add_argument("--std", type=float, nargs="+",
                   help="per-channel std, or one value for all (default as --mean: 0.5)")
    p.add_argument("--layer-norm-eps", type=float,
                   help="LayerNorm epsilon (default: timm's 1e-6; hf reads config.json's layer_norm_eps)")
    p.add_argument("--name", help="model name (default: the source's file or directory name)")
    p.add_argument("--version", default="1", help="model version (default: 1)")
    p.set_defaults(func=run_import)


def run_import(args) -> int:
    import sys

    from model.convert import CheckpointImportError, ImportOptions, import_checkpoint, read_labels

    try:
        options = ImportOptions(
            num_heads=args.num_heads, image_size=tuple(args.image_size) if args.image_size else None,
            labels=read_labels(args.labels) if args.labels else None, mean=args.mean, std=args.std,
            name=args.name, version=args.version, layer_norm_eps=args.layer_norm_eps)
        out, meta = import_checkpoint(args.source, args.source_format, args.out, options)
    except CheckpointImportError as e:
        # A refusal is an answer, not a crash: one line on stderr, no traceback.
        print(f"vitserve import: error: {e}", file=sys.stderr)
        return 1
    print(json.dumps({"checkpoint": str(out), "name": meta.name, "architecture": meta.config.to_dict(),
                      "labels": len(meta.labels), "mean": meta.mean, "std": meta.std}))
    return 0
