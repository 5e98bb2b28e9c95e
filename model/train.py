"""Training loop: AdamW, linear warm-up then cosine decay, label smoothing, gradient clipping.

Reads top to bottom: set up (processes, seeds, data, model, optimiser) -> for each epoch,
train then evaluate -> log, plot, checkpoint. Runs as one process or under torchrun
(DistributedDataParallel: gloo on CPU, nccl on GPU); rank 0 alone writes files.
"""
from __future__ import annotations

import csv
import json
import math
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from model.augment import augment_batch, normalize
from model.checkpoint import CheckpointMeta, load_checkpoint, save_checkpoint
from model.config import AugmentConfig, TrainConfig  # noqa: F401 (re-exported: `from model.train import TrainConfig`)
from model.data import DataSplits, load_fashion_mnist, load_image_folder, resize_batch
from model.vit import VisionTransformer, count_parameters, resample_pos_embed, vit_config

TRAIN_STATE_FILE = "train_state.pt"


@dataclass
class Runtime:
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_runtime(cfg: TrainConfig) -> Runtime:
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu")
    if world > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    if device.type == "cpu":
        # Without it denormal floats in the small late-training gradients slowed training 14x here.
        torch.set_flush_denormal(True)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
    else:
        torch.cuda.set_device(device)
    torch.manual_seed(cfg.seed + rank)
    return Runtime(rank, world, device)


def load_data(cfg: TrainConfig, image_size: tuple[int, int] | None) -> DataSplits:
    if cfg.data == "fashion-mnist":
        splits = load_fashion_mnist(cfg.data_dir)
        if image_size:
            splits.train.images = resize_batch(splits.train.images, image_size)
            splits.test.images = resize_batch(splits.test.images, image_size)
        return splits
    return load_image_folder(cfg.data, image_size or (224, 224), cfg.channels, cfg.val_fraction, cfg.seed)


def build_model(cfg: TrainConfig, splits: DataSplits) -> tuple[VisionTransformer, CheckpointMeta]:
    """A fresh model from the variant, or a checkpoint adapted to this data's resolution and classes."""
    classes = splits.train.classes
    size = tuple(splits.train.images.shape[-2:])
    channels = splits.train.images.shape[1]
    if not cfg.init_from:
        overrides = {**cfg.model_overrides, "image_size": size, "in_channels": channels,
                     "num_classes": len(classes)}
        model = VisionTransformer(vit_config(cfg.model, **overrides))
        return model, CheckpointMeta(model.cfg, classes, splits.mean, splits.std, cfg.name, cfg.version)
    source, source_meta = load_checkpoint(cfg.init_from)
    new_cfg = replace(source.cfg, image_size=size, num_classes=len(classes), representation_size=None,
                      **{k: v for k, v in cfg.model_overrides.items() if k in ("dropout", "attention_dropout")})
    model = VisionTransformer(new_cfg)
    state = source.state_dict()
    # Fine-tuning at a higher resolution (paper, sec. 3.2): interpolate the learned embeddings to the new grid.
    state["pos_embed"] = resample_pos_embed(state["pos_embed"], source.cfg.grid_size, new_cfg.grid_size)
    if source.cfg.num_classes != len(classes) or source.cfg.representation_size:
        state = {k: v for k, v in state.items() if not k.startswith(("head.", "pre_logits."))}
    model.load_state_dict(state, strict=False)
    meta = CheckpointMeta(new_cfg, classes, source_meta.mean, source_meta.std, cfg.name, cfg.version)
    return model, meta


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    # No weight decay on biases, LayerNorm gains, position embeddings or the class token.
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if p.ndim <= 1 or name in ("pos_embed", "cls_token") else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))


def lr_at(step: int, total_steps: int, warmup_steps: int, cfg: TrainConfig) -> float:
    if step < warmup_steps:
        return cfg.lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: list[float], std: list[float],
             rt: Runtime, batch_size: int = 500) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split; each process takes a shard, then they add up."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    for start in range(rt.rank * batch_size, len(labels), batch_size * rt.world):
        x = normalize(images[start:start + batch_size], mean, std).to(rt.device)
        y = labels[start:start + batch_size].to(rt.device)
        with autocast(rt):
            logits = model(x).float()
        totals += torch.tensor([F.cross_entropy(logits, y, reduction="sum").item(),
                                (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
    if rt.world > 1:
        dist.all_reduce(totals)
    model.train()
    return (totals[0] / totals[2]).item(), (totals[1] / totals[2]).item()


def autocast(rt: Runtime):
    # bf16 on CUDA; on CPU float32 (bf16 autocast there cost accuracy for little speed).
    return torch.autocast("cuda", dtype=torch.bfloat16, enabled=rt.device.type == "cuda")


class TrainLog:
    """CSV of per-epoch metrics and a PNG of the curves, rewritten after every epoch."""

    FIELDS = ["epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc",
              "images_per_s", "elapsed_s"]

    def __init__(self, out_dir: Path, keep_rows: bool):
        self.csv_path, self.png_path = out_dir / "log.csv", out_dir / "curves.png"
        self.rows: list[dict] = []
        if keep_rows and self.csv_path.is_file():
            with self.csv_path.open() as f:
                self.rows = [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]

    def append(self, row: dict) -> None:
        self.rows.append(row)
        with self.csv_path.open("w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=self.FIELDS)
            writer.writeheader()
            writer.writerows(self.rows)
        self.plot()

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        epochs = [r["epoch"] for r in self.rows]
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
        ax_loss.plot(epochs, [r["train_loss"] for r in self.rows], label="train")
        ax_loss.plot(epochs, [r["test_loss"] for r in self.rows], label="test")
        ax_loss.set(xlabel="epoch", ylabel="cross-entropy", title="loss")
        ax_acc.plot(epochs, [100 * r["train_acc"] for r in self.rows], label="train (augmented)")
        ax_acc.plot(epochs, [100 * r["test_acc"] for r in self.rows], label="test")
        ax_acc.set(xlabel="epoch", ylabel="accuracy (%)", title="accuracy")
        for ax in (ax_loss, ax_acc):
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        plt.close(fig)


def progress_bar(total: int, desc: str, enabled: bool):
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False, file=sys.stderr)


def steps_per_epoch(n_train: int, cfg: TrainConfig, world: int) -> int:
    """Optimiser steps per epoch, the same on every rank (DDP needs each rank to make every step).

    Counted from the whole set, not from a rank's shard: with an odd number of images rank 0's shard is
    one longer, and counting shards gave it an extra step that left the other rank's collectives unpaired.
    """
    per_rank = cfg.batch_size // world
    if per_rank < 1 or n_train // world < per_rank:
        raise ValueError(f"{n_train} training images cannot fill one batch of {cfg.batch_size} on {world} process(es)")
    steps = n_train // world // per_rank
    return steps if cfg.max_steps_per_epoch is None else min(steps, cfg.max_steps_per_epoch)


def train_one_epoch(model, optimizer, splits: DataSplits, cfg: TrainConfig, rt: Runtime, epoch: int,
                    step: int, total_steps: int, warmup_steps: int, generator: torch.Generator) -> tuple[dict, int]:
    images, labels = splits.train.images, splits.train.labels
    per_rank = cfg.batch_size // rt.world
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(cfg.seed * 1000 + epoch))
    order = order[rt.rank::rt.world]
    steps = steps_per_epoch(len(labels), cfg, rt.world)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, seen
    start = time.perf_counter()
    bar = progress_bar(steps, f"epoch {epoch + 1}/{cfg.epochs}", cfg.progress and rt.is_main)
    for i in range(steps):
        idx = order[i * per_rank:(i + 1) * per_rank]
        x = augment_batch(images[idx], cfg.augment, splits.mean, splits.std, generator).to(rt.device)
        y = labels[idx].to(rt.device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, total_steps, warmup_steps, cfg)
        with autocast(rt):
            logits = model(x)
            loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip:
            nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        optimizer.step()
        step += 1
        sums += torch.tensor([loss.item() * len(y), (logits.argmax(1) == y).sum().item(), len(y)], dtype=torch.float64)
        rate = sums[2].item() * rt.world / (time.perf_counter() - start)
        bar.set_postfix(loss=f"{sums[0] / sums[2]:.4f}", acc=f"{sums[1] / sums[2]:.4f}", img_s=f"{rate:.0f}")
        bar.update()
    bar.close()
    if rt.world > 1:
        dist.all_reduce(sums)
    elapsed = time.perf_counter() - start
    return {"train_loss": (sums[0] / sums[2]).item(), "train_acc": (sums[1] / sums[2]).item(),
            "images_per_s": sums[2].item() / elapsed, "lr": optimizer.param_groups[0]["lr"]}, step


def machine_description(rt: Runtime) -> str:
    if rt.device.type == "cuda":
        return f"{rt.world} x {torch.cuda.get_device_name(rt.device)}"
    return f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads, {rt.world} process(es)"


def train(cfg: TrainConfig) -> dict:
    """Trains, evaluating and checkpointing every epoch; returns the final metrics."""
    rt = setup_runtime(cfg)
    out_dir = Path(cfg.out_dir)
    splits = load_data(cfg, tuple(cfg.model_overrides["image_size"]) if "image_size" in cfg.model_overrides else None)
    model, meta = build_model(cfg, splits)
    model.to(rt.device).train()
    optimizer = make_optimizer(model, cfg)
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rt.rank)
    first_epoch, step, elapsed_before = 0, 0, 0.0
    if cfg.resume and (out_dir / TRAIN_STATE_FILE).is_file():
        first_epoch, step, elapsed_before = restore_state(out_dir, model, optimizer, generator, rt)
    ddp_model = nn.parallel.DistributedDataParallel(model) if rt.world > 1 else model
    epoch_steps = steps_per_epoch(len(splits.train.labels), cfg, rt.world)
    total_steps, warmup_steps = epoch_steps * cfg.epochs, max(1, int(epoch_steps * cfg.warmup_epochs))
    log = None
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        log = TrainLog(out_dir, keep_rows=cfg.resume)
        print(f"model {cfg.model}: {count_parameters(model):,} parameters, {json.dumps(model.cfg.to_dict())}", file=sys.stderr)
        print(f"data: {len(splits.train)} train / {len(splits.test)} test images, {len(meta.labels)} classes; "
              f"{machine_description(rt)}", file=sys.stderr)
    started = time.perf_counter() - elapsed_before
    row: dict = {}
    for epoch in range(first_epoch, cfg.epochs):
        stats, step = train_one_epoch(ddp_model, optimizer, splits, cfg, rt, epoch, step, total_steps,
                                      warmup_steps, generator)
        test_loss, test_acc = evaluate(model, splits.test.images, splits.test.labels, splits.mean, splits.std, rt)
        row = {"epoch": epoch + 1, "step": step, **stats, "test_loss": test_loss, "test_acc": test_acc,
               "elapsed_s": time.perf_counter() - started}
        if rt.is_main:
            print(f"epoch {epoch + 1}/{cfg.epochs}: train loss {stats['train_loss']:.4f} acc {stats['train_acc']:.4f} | "
                  f"test loss {test_loss:.4f} acc {test_acc:.4f} | {stats['images_per_s']:.0f} img/s | "
                  f"{row['elapsed_s']:.0f}s", file=sys.stderr)
            log.append(row)
            meta.metrics = {"test_accuracy": test_acc, "test_loss": test_loss, "epoch": epoch + 1}
            meta.training = training_record(cfg, rt, row, len(splits.train), count_parameters(model))
            save_checkpoint(out_dir / "checkpoint", model, meta)
            save_state(out_dir, model, optimizer, generator, epoch + 1, step, row["elapsed_s"])
        if rt.world > 1:
            dist.barrier()
    if rt.world > 1:
        dist.destroy_process_group()
    return row


def training_record(cfg: TrainConfig, rt: Runtime, row: dict, n_train: int, n_params: int) -> dict:
    record = asdict(cfg)
    record.update(epochs_done=row["epoch"], wall_time_s=round(row["elapsed_s"], 1), train_images=n_train,
                  parameters=n_params, machine=machine_description(rt), torch=torch.__version__,
                  last_epoch_images_per_s=round(row["images_per_s"], 1), command=" ".join(sys.argv))
    return record


def save_state(out_dir: Path, model, optimizer, generator, epoch: int, step: int, elapsed: float) -> None:
    state = {"epoch": epoch, "step": step, "elapsed_s": elapsed, "optimizer": optimizer.state_dict(),
             "generator": generator.get_state(), "torch_rng": torch.get_rng_state()}
    tmp = out_dir / (TRAIN_STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_dir / TRAIN_STATE_FILE)  # a crash mid-write never leaves a torn state behind


def restore_state(out_dir: Path, model, optimizer, generator, rt: Runtime) -> tuple[int, int, float]:
    saved, _ = load_checkpoint(out_dir / "checkpoint")
    model.load_state_dict(saved.state_dict())
    state = torch.load(out_dir / TRAIN_STATE_FILE, map_location=rt.device, weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    if rt.is_main:
        print(f"resuming after epoch {state['epoch']} (step {state['step']})", file=sys.stderr)
    return state["epoch"], state["step"], state["elapsed_s"]
