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
