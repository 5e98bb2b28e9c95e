"""Training loop: AdamW, linear warm-up then cosine decay, label smoothing, gradient clipping.

Reads top to bottom: set up (processes, seeds, data, model, optimiser) and say what will happen -> for each
epoch, train then evaluate -> log, plot, checkpoint. Saves come also every few minutes and on Ctrl-C, each
with the position inside the epoch, so `--resume` continues at the next batch. Runs as one process or under
torchrun (DistributedDataParallel: gloo on CPU, nccl on GPU); rank 0 alone writes files and prints.
"""
from __future__ import annotations

import csv
import math
import os
import platform
import signal
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from vitserve.machine import cpu_model_name
from vitserve.model.augment import augment_batch, normalize
from vitserve.model.checkpoint import CheckpointMeta, load_checkpoint, load_meta, save_checkpoint
from vitserve.model.config import AugmentConfig as AugmentConfig  # re-exported: `from model.train import AugmentConfig`
from vitserve.model.config import TrainConfig, TrainingInputError
from vitserve.model.data import (
    DataSplits,
    images_at_grid,
    labelled_share,
    load_fashion_mnist,
    load_image_folder,
    resize_batch,
    resize_to_grid,
)
from vitserve.model.distill import Teachers, distillation_loss, load_teachers, teacher_meta
from vitserve.model.pretrain import CORRUPTED_FRACTION, MaskedPatchPrediction, colour_classes
from vitserve.model.vit import VisionTransformer, count_parameters, resample_pos_embed, vit_config

TRAIN_STATE_FILE = "train_state.pt"
MIN_EPOCH_POINTS = 5  # fewer evaluations than this and curves.png is drawn against steps


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
    else:
        splits = load_image_folder(cfg.data, image_size or folder_image_size(cfg), cfg.channels, cfg.val_fraction,
                                   cfg.seed)
    if cfg.label_fraction < 1:
        splits.train = labelled_share(splits.train, cfg.label_fraction, cfg.seed)
    return splits


def folder_image_size(cfg: TrainConfig) -> tuple[int, int]:
    """An image folder's resolution without --image-size: the --init-from checkpoint's, else the variant's
    (fmnist 28x28, the paper's variants 224x224); a 224 image in fmnist's 4x4 patches would be 3,136 tokens."""
    if cfg.init_from:
        return load_meta(cfg.init_from).config.image_size
    return vit_config(cfg.model).image_size


def build_model(cfg: TrainConfig, splits: DataSplits) -> tuple[VisionTransformer, CheckpointMeta]:
    """A fresh model from the variant, or a checkpoint adapted to this data's resolution and classes."""
    classes = splits.train.classes
    height, width = splits.train.images.shape[-2:]
    size = (height, width)
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
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        embedding = name.rpartition(".")[2] in ("pos_embed", "cls_token", "mask_token")
        (no_decay if p.ndim <= 1 or embedding else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(0.9, 0.999))


def lr_at(step: int, total_steps: int, warmup_steps: int, cfg: TrainConfig) -> float:
    if step < warmup_steps:
        return cfg.lr * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, progress)))


def predictions(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mean: list[float], std: list[float],
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, targets): the image labels' for a classifier; for masked-patch prediction, the corrupted patches'
    and their mean colours (computed from x, un-normalised)."""
    core = model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
    if not isinstance(core, MaskedPatchPrediction):
        return model(x), y
    shape = (1, -1, 1, 1)
    pixels = x * torch.tensor(std, device=x.device).view(shape) + torch.tensor(mean, device=x.device).view(shape)
    return model(x, pixels, generator)


@torch.no_grad()
def evaluate(model: nn.Module, images: torch.Tensor, labels: torch.Tensor, mean: list[float], std: list[float],
             rt: Runtime, batch_size: int = 500) -> tuple[float, float]:
    """(mean loss, accuracy) over the whole split; each process takes a shard, then they add up. Masked-patch
    prediction is scored on the same corruptions at every evaluation (a fixed seed)."""
    model.eval()
    totals = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    generator = torch.Generator().manual_seed(rt.rank)
    for start in range(rt.rank * batch_size, len(labels), batch_size * rt.world):
        x = normalize(images[start:start + batch_size], mean, std).to(rt.device)
        y = labels[start:start + batch_size].to(rt.device)
        with autocast(rt):
            logits, y = predictions(model, x, y, mean, std, generator)
            logits = logits.float()
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
    """log.csv (a row per evaluation), steps.csv (a row per optimiser step) and curves.png, written at every save.

    On resume the rows after the saved step are dropped: they belong to steps the run will make again. A run
    with --grid-sizes adds a held-out accuracy per size (test_acc_20, ...) and each step's input side (grid).
    """

    FIELDS = ["epoch", "step", "lr", "train_loss", "train_acc", "test_loss", "test_acc",
              "images_per_s", "elapsed_s"]
    STEP_FIELDS = ["step", "epoch", "lr", "train_loss", "train_acc"]  # the training values of one batch

    def __init__(self, out_dir: Path, resume_step: int | None = None, grid_sizes: tuple[int, ...] = ()):
        self.csv_path, self.steps_path = out_dir / "log.csv", out_dir / "steps.csv"
        self.png_path = out_dir / "curves.png"
        self.fields = self.FIELDS + [f"test_acc_{size}" for size in dict.fromkeys(grid_sizes)]
        self.step_fields = self.STEP_FIELDS + (["grid"] if grid_sizes else [])
        self.rows = _read_rows(self.csv_path, resume_step)
        self.steps = _read_rows(self.steps_path, resume_step)

    def write(self) -> None:
        for path, fields, rows in [(self.csv_path, self.fields, self.rows),
                                   (self.steps_path, self.step_fields, self.steps)]:
            with path.open("w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
                writer.writeheader()
                writer.writerows(rows)
        self.plot()

    def plot(self) -> None:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        x_name, panels = curve_series(self.rows, self.steps)
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax, (title, series), y_label in zip(axes, panels.items(), ["cross-entropy", "accuracy (%)"]):
            for label, (xs, ys) in series.items():
                ax.plot(xs, ys, label=label, **({"marker": "o"} if label.startswith("test") else {}))
            ax.set(xlabel=x_name, ylabel=y_label, title=title)
            ax.grid(alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(self.png_path, dpi=100)
        plt.close(fig)


def _read_rows(path: Path, until_step: int | None) -> list[dict]:
    if until_step is None or not path.is_file():
        return []
    with path.open() as f:  # an empty cell: a column added after the row was written
        rows = [{k: int(v) if v.lstrip("-").isdigit() else float(v) for k, v in row.items() if v != ""}
                for row in csv.DictReader(f)]
    return [row for row in rows if row["step"] <= until_step]


def curve_series(rows: list[dict], steps: list[dict]) -> tuple[str, dict[str, dict[str, tuple[list, list]]]]:
    """What curves.png draws: (x axis, {"loss" and "accuracy": {legend: (x values, y values)}}). With fewer than
    MIN_EPOCH_POINTS evaluations the x axis is the step and training is drawn per step (a mean over a few
    batches), so that a one-epoch run is a curve, not a single point; otherwise a point per evaluation."""
    x_name, train = ("step", steps) if len(rows) < MIN_EPOCH_POINTS and steps else ("epoch", rows)
    window = max(1, len(train) // 25) if train is steps else 1
    mean = f", mean of {window} steps" if window > 1 else ""
    xs = [r[x_name] for r in train]
    panels = {}
    for title, key, scale, train_label in [("loss", "loss", 1, f"train{mean}"),
                                           ("accuracy", "acc", 100, f"train (augmented{mean})")]:
        panels[title] = {
            train_label: (xs, trailing_mean([scale * r[f"train_{key}"] for r in train], window)),
            "test": ([r[x_name] for r in rows], [scale * r[f"test_{key}"] for r in rows])}
    for size in grid_columns(rows):
        scored = [r for r in rows if f"test_acc_{size}" in r]  # a size added on resume has no earlier rows
        panels["accuracy"][f"test at {size} px"] = ([r[x_name] for r in scored],
                                                    [100 * r[f"test_acc_{size}"] for r in scored])
    return x_name, panels


def grid_columns(rows: list[dict]) -> list[int]:
    """The sides of the test_acc_<side> columns (--grid-sizes) in log rows, in the order they first appear."""
    prefix = "test_acc_"
    return [int(k[len(prefix):]) for k in dict.fromkeys(k for r in rows for k in r) if k.startswith(prefix)]


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value averaged with up to window - 1 values before it."""
    if window == 1:
        return list(values)
    sums = [0.0]
    for v in values:
        sums.append(sums[-1] + v)
    return [(sums[i + 1] - sums[max(0, i + 1 - window)]) / min(window, i + 1) for i in range(len(values))]


def progress_bar(total: int, desc: str, enabled: bool, initial: int = 0):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, dynamic_ncols=True, leave=False,
                file=sys.stderr)


def steps_per_epoch(n_train: int, cfg: TrainConfig, world: int) -> int:
    """Optimiser steps per epoch, the same on every rank (DDP needs each rank to make every step).

    Counted from the whole set, not from a rank's shard: with an odd number of images rank 0's shard is
    one longer, and counting shards gave it an extra step that left the other rank's collectives unpaired.
    """
    per_rank = cfg.batch_size // world
    if per_rank < 1 or n_train // world < per_rank:
        raise TrainingInputError(f"{n_train} training images cannot fill one batch of {cfg.batch_size} on "
                                 f"{world} process(es)")
    steps = n_train // world // per_rank
    return steps if cfg.max_steps_per_epoch is None else min(steps, cfg.max_steps_per_epoch)


def fit_batch_size(cfg: TrainConfig, n_train: int, rt: Runtime) -> TrainConfig:
    """The batch cut to the training set when that is smaller (a small image folder), said in one line."""
    if n_train >= cfg.batch_size or n_train < rt.world:  # too few images for the processes: steps_per_epoch says so
        return cfg
    fitted = n_train // rt.world * rt.world
    if rt.is_main:
        print(f"batch size {fitted}: --batch-size {cfg.batch_size} is more than the {n_train} training images",
              file=sys.stderr)
    return replace(cfg, batch_size=fitted)


@dataclass
class Position:
    """How far a run has come; saved with the optimiser, so that a run stopped mid-epoch resumes at its next batch."""

    epoch: int = 0  # the epoch under way
    batch: int = 0  # batches done in it
    step: int = 0  # optimiser steps done in all
    # This epoch's training loss sum, correct predictions and images seen, on this rank.
    sums: torch.Tensor = field(default_factory=lambda: torch.zeros(3, dtype=torch.float64))
    elapsed_s: float = 0.0  # the run's wall time at the last save, earlier sessions included

    def epochs_done(self, epoch_steps: int) -> int | float:
        done = self.epoch + self.batch / epoch_steps
        return int(done) if done.is_integer() else round(done, 4)


@dataclass
class Run:
    """What a training run works with; rank 0 alone keeps the log."""

    cfg: TrainConfig
    rt: Runtime
    splits: DataSplits
    model: VisionTransformer
    objective: nn.Module  # what is trained: the model, or the model inside MaskedPatchPrediction
    meta: CheckpointMeta
    optimizer: torch.optim.Optimizer
    generator: torch.Generator  # augmentation
    ddp_model: nn.Module  # the model itself on one process
    epoch_steps: int
    log: TrainLog | None
    teachers: Teachers | None = None  # --distill-from
    test_at_grids: dict[int, torch.Tensor] = field(default_factory=dict)  # --grid-sizes: held-out images per side

    @property
    def out_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def total_steps(self) -> int:
        return self.epoch_steps * self.cfg.epochs

    @property
    def warmup_steps(self) -> int:
        # Capped at half the run: a 3-epoch warm-up in a one-epoch run would end before the peak learning rate.
        return max(1, min(int(self.epoch_steps * self.cfg.warmup_epochs), self.total_steps // 2))


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C stopped the run after the step under way, and the checkpoint and training state were saved."""

    def __init__(self, out_dir: Path, epochs_done: float, step: int, total_steps: int):
        super().__init__(f"stopped at step {step} of {total_steps}; saved in {out_dir}")
        self.out_dir, self.epochs_done, self.step, self.total_steps = out_dir, epochs_done, step, total_steps


class Clock:
    """The run's wall time (earlier sessions included), and whether this session should save or stop."""

    def __init__(self, cfg: TrainConfig, elapsed_before: float):
        self.session_start = self.last_save = time.monotonic()
        self.elapsed_before = elapsed_before
        self.save_every_s = cfg.save_every * 60
        self.limit_s = None if cfg.time_limit is None else cfg.time_limit * 60

    def elapsed(self) -> float:
        return self.elapsed_before + time.monotonic() - self.session_start

    def save_due(self) -> bool:
        return self.save_every_s > 0 and time.monotonic() - self.last_save >= self.save_every_s

    def out_of_time(self) -> bool:
        return self.limit_s is not None and time.monotonic() - self.session_start >= self.limit_s


@contextmanager
def deferred_sigint(announce: bool):
    """Ctrl-C sets the event that the loop reads after each step instead of raising inside one (a half-made
    optimiser step must not be saved); a second Ctrl-C raises at once. Only the main thread takes signals."""
    pressed = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield pressed
        return

    def on_sigint(signum, frame):
        if pressed.is_set():
            raise KeyboardInterrupt
        pressed.set()
        if announce:
            print("\nCtrl-C: stopping after this step to save (Ctrl-C again: stop now, unsaved)", file=sys.stderr)

    previous = signal.signal(signal.SIGINT, on_sigint)
    try:
        yield pressed
    finally:
        signal.signal(signal.SIGINT, previous)


def train(cfg: TrainConfig) -> dict:
    """Trains, evaluating and saving at every epoch's end; returns the last evaluation's row ({} when a resumed
    run had nothing left to do).

    It also saves every cfg.save_every minutes, and on Ctrl-C, which stops after the step under way and raises
    TrainingInterrupted; cfg.time_limit ends the run early, evaluated and saved as at an epoch's end.
    """
    cfg.check()
    run, pos = start_run(cfg)
    clock, row = Clock(run.cfg, pos.elapsed_s), {}
    try:
        with deferred_sigint(run.rt.is_main) as pressed:
            while pos.epoch < cfg.epochs:
                stop, images_per_s = train_epoch(run, pos, clock, pressed)
                if stop == "interrupt":
                    if run.rt.is_main:
                        save_progress(run, pos, clock)
                    raise TrainingInterrupted(run.out_dir, pos.epochs_done(run.epoch_steps), pos.step, run.total_steps)
                row = evaluate_and_save(run, pos, clock, images_per_s)
                stop = stop or (stop_reason(run, clock, pressed) if pos.epoch < cfg.epochs else None)
                if stop == "interrupt":  # pressed during the evaluation, which has just been saved
                    raise TrainingInterrupted(run.out_dir, pos.epochs_done(run.epoch_steps), pos.step, run.total_steps)
                if stop == "time":
                    break
    finally:
        if run.rt.world > 1:
            dist.destroy_process_group()
    return row


def start_run(cfg: TrainConfig) -> tuple[Run, Position]:
    """Processes, data, model and optimiser, restored from --out's training state with --resume; says what will
    happen."""
    if cfg.init_from:
        load_meta(cfg.init_from)  # a wrong path fails before the data are read
    for teacher in cfg.distill_from:
        teacher_meta(teacher)
    rt = setup_runtime(cfg)
    out_dir = Path(cfg.out_dir)
    splits = load_data(cfg, tuple(cfg.model_overrides["image_size"]) if "image_size" in cfg.model_overrides else None)
    cfg = fit_batch_size(cfg, len(splits.train), rt)
    model, meta = build_model(cfg, splits)
    check_grid_sizes(cfg.grid_sizes, model.cfg)
    objective = MaskedPatchPrediction(model) if cfg.pretrain == "masked-patch" else model
    objective.to(rt.device).train()
    optimizer = make_optimizer(objective, cfg)
    generator = torch.Generator().manual_seed(cfg.seed * 1000 + rt.rank)
    resuming = cfg.resume and (out_dir / TRAIN_STATE_FILE).is_file()
    scored = scored_sizes(cfg.grid_sizes, out_dir / "log.csv" if resuming else None)
    pos = restore_state(out_dir, objective, optimizer, generator, rt) if resuming else Position()
    # Pre-training leaves the classifier head unused: DistributedDataParallel must be told
    ddp_model = nn.parallel.DistributedDataParallel(objective, find_unused_parameters=objective is not model) \
        if rt.world > 1 else objective
    epoch_steps = steps_per_epoch(len(splits.train), cfg, rt.world)
    log = None
    if rt.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        log = TrainLog(out_dir, pos.step if resuming else None, scored)
    teachers = load_teachers(cfg.distill_from, meta.labels, model.cfg.in_channels, splits.mean, splits.std,
                             rt.device) if cfg.distill_from else None
    test_at_grids = {size: images_at_grid(splits.test.images, size) for size in scored}
    run = Run(cfg, rt, splits, model, objective, meta, optimizer, generator, ddp_model, epoch_steps, log, teachers,
              test_at_grids)
    if rt.is_main:
        announce(run, pos, resuming)
    return run, pos


def scored_sizes(grid_sizes: tuple[int, ...], resumed_log: Path | None) -> tuple[int, ...]:
    """The sides the held-out set is scored at: --grid-sizes, and those a resumed run's log.csv already has (a run
    resumed with another list keeps its columns and their history), smallest first."""
    logged: list[int] = []
    if resumed_log is not None and resumed_log.is_file():
        with resumed_log.open() as f:
            logged = grid_columns([dict.fromkeys(next(csv.reader(f), []))])
    return tuple(sorted(set(grid_sizes) | set(logged)))


def _tokens(c) -> str:
    """What one token is: a patch of pixels, or a patch of a hybrid's feature map."""
    if not c.is_hybrid:
        return f"{c.patch_size}x{c.patch_size} patches"
    stages = f"stages of {','.join(map(str, c.backbone_layers))} blocks" if c.backbone_layers else "the stem alone"
    return f"a ResNet of width {c.backbone_width}, {stages}, then tokens of {c.patch_size}x{c.patch_size} pixels"


def announce(run: Run, pos: Position, resuming: bool) -> None:
    """Says, before any step, what the run will do and where its files go."""
    cfg, c, splits = run.cfg, run.model.cfg, run.splits
    source = f"Fashion-MNIST ({cfg.data_dir})" if cfg.data == "fashion-mnist" else f"image folder {cfg.data}"
    held_out = "test" if cfg.data == "fashion-mnist" else "validation"
    full = len(splits.train) // cfg.batch_size
    capped = f" (--max-steps-per-epoch; a full pass is {full:,})" if run.epoch_steps < full else ""
    lines = [
        f"data: {source}: {len(splits.train):,} training and {len(splits.test):,} {held_out} images, "
        f"{len(run.meta.labels)} classes, {c.in_channels}x{c.image_size[0]}x{c.image_size[1]}",
        f"model: {cfg.model}{', from ' + cfg.init_from if cfg.init_from else ''}, "
        f"{count_parameters(run.model):,} parameters ({c.depth} blocks, width {c.embed_dim}, {c.num_heads} heads, "
        f"{_tokens(c)}: a {c.grid_size[0]}x{c.grid_size[1]} grid)",
        f"plan: {cfg.epochs} epoch(s) of {run.epoch_steps:,} steps{capped} = {run.total_steps:,} steps of "
        f"{cfg.batch_size} images; lr warm-up {run.warmup_steps:,} steps to {cfg.lr:g}, cosine to {cfg.min_lr:g}; "
        f"on {machine_description(run.rt)}",
        f"files: {run.out_dir}/ checkpoint/ (at each epoch's end, every {cfg.save_every:g} min and on Ctrl-C), "
        f"log.csv, steps.csv, curves.png, {TRAIN_STATE_FILE} (for --resume)",
    ]
    if run.objective is not run.model:
        lines.insert(2, f"task: masked-patch pre-training, no labels: {CORRUPTED_FRACTION:.0%} of each image's patches "
                        f"corrupted, their mean colour predicted ({colour_classes(c.in_channels)} classes); "
                        f"'acc' is that prediction's, the checkpoint is the ViT for --init-from")
    if run.teachers is not None:
        taught = ", ".join(f"{meta.name} {meta.version} ({path})" for meta, path in zip(run.teachers.metas,
                                                                                         cfg.distill_from))
        lines.insert(2, f"distillation: from {taught}; {cfg.distill_weight:.0%} of the loss is their mean "
                        f"probabilities at temperature {cfg.distill_temperature:g}, the rest the labels")
    if cfg.grid_sizes:
        lines.insert(2, grids_line(cfg, c, tuple(run.test_at_grids)))
    if cfg.label_fraction < 1:
        lines.insert(1, f"labels: {cfg.label_fraction:.0%} of each class's training images ({len(splits.train):,}), "
                        f"chosen with seed {cfg.seed}")
    if resuming and pos.epoch >= cfg.epochs:
        lines.append(f"resuming: all {cfg.epochs} epochs are done (step {pos.step:,}); nothing left to do")
    elif resuming:
        lines.append(f"resuming at epoch {pos.epoch + 1}, batch {pos.batch} (step {pos.step:,} of {run.total_steps:,})")
    elif cfg.resume:
        lines.append(f"--resume: no {TRAIN_STATE_FILE} in {run.out_dir}; starting from the beginning")
    elif (run.out_dir / TRAIN_STATE_FILE).is_file():
        lines.append(f"note: this run starts over and replaces the one in {run.out_dir} (--resume would continue it)")
    print("\n".join(lines), file=sys.stderr)


def grids_line(cfg: TrainConfig, c, scored: tuple[int, ...]) -> str:
    tokens = ", ".join(f"{size} px ({(size // c.patch_size) ** 2} tokens)" for size in dict.fromkeys(cfg.grid_sizes))
    teachers = f"; the teachers see the {c.image_size[0]} px image" if cfg.distill_from else ""
    odds = " (a size repeated is drawn as often as it is listed)" if len(set(cfg.grid_sizes)) < len(cfg.grid_sizes) \
        else ""
    return (f"grids: each step's batch resized to one of {tokens}{odds}, drawn with seed {cfg.seed}{teachers}; "
            f"held-out accuracy at {', '.join(map(str, scored))} px")


def train_epoch(run: Run, pos: Position, clock: Clock, pressed: threading.Event) -> tuple[str | None, float]:
    """Trains from pos to the end of its epoch, or until a stop; returns ("interrupt", "time" or None, training
    images per second)."""
    cfg, rt = run.cfg, run.rt
    per_rank = cfg.batch_size // rt.world
    order = torch.randperm(len(run.splits.train), generator=torch.Generator().manual_seed(cfg.seed * 1000 + pos.epoch))
    order = order[rt.rank::rt.world]
    bar = progress_bar(run.epoch_steps, f"epoch {pos.epoch + 1}/{cfg.epochs}", cfg.progress and rt.is_main, pos.batch)
    seen, start, stop = 0, time.perf_counter(), None
    while pos.batch < run.epoch_steps and stop is None:
        idx = order[pos.batch * per_rank:(pos.batch + 1) * per_rank]
        lr = lr_at(pos.step, run.total_steps, run.warmup_steps, cfg)
        loss, correct, count, side = train_step(run, idx, lr)
        pos.batch, pos.step, seen = pos.batch + 1, pos.step + 1, seen + len(idx)
        pos.sums += torch.tensor([loss * count, correct, count], dtype=torch.float64)
        if run.log:
            run.log.steps.append({"step": pos.step, "epoch": pos.epochs_done(run.epoch_steps), "lr": lr,
                                  "train_loss": loss, "train_acc": correct / count, "grid": side})
        bar.set_postfix(loss=f"{pos.sums[0] / pos.sums[2]:.4f}", acc=f"{pos.sums[1] / pos.sums[2]:.4f}",
                        img_s=f"{seen * rt.world / (time.perf_counter() - start):.0f}")
        bar.update()
        stop = stop_reason(run, clock, pressed)
        if stop is None and pos.batch < run.epoch_steps and rt.is_main and clock.save_due():
            save_progress(run, pos, clock)
    bar.close()
    return stop, seen * rt.world / max(time.perf_counter() - start, 1e-9)


def train_step(run: Run, idx: torch.Tensor, lr: float) -> tuple[float, int, int, int]:
    """One optimiser step on the training images at idx; returns (mean loss, correct predictions, predictions,
    the input's side in pixels): a prediction per image, or one per corrupted patch in masked-patch pre-training."""
    cfg, rt, data = run.cfg, run.rt, run.splits
    x = augment_batch(data.train.images[idx], cfg.augment, data.mean, data.std, run.generator).to(rt.device)
    y = data.train.labels[idx].to(rt.device)
    grid = draw_grid(cfg.grid_sizes, run.generator)
    seen = x if grid is None else resize_to_grid(x, grid)  # (B, C, grid, grid)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    with autocast(rt):
        logits, y = predictions(run.ddp_model, seen, y, data.mean, data.std, run.generator)
        loss = F.cross_entropy(logits.float(), y, label_smoothing=cfg.label_smoothing)
        if run.teachers is not None:  # FlexiViT's teacher sees the full image, whatever grid the student has
            taught = distillation_loss(logits.float(), run.teachers.probabilities(x, cfg.distill_temperature),
                                       cfg.distill_temperature)
            loss = (1 - cfg.distill_weight) * loss + cfg.distill_weight * taught
    run.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if cfg.grad_clip:
        nn.utils.clip_grad_norm_(run.objective.parameters(), cfg.grad_clip)
    run.optimizer.step()
    return float(loss.item()), int((logits.argmax(1) == y).sum().item()), len(y), seen.shape[-1]


def draw_grid(sizes: tuple[int, ...], generator: torch.Generator) -> int | None:
    """The input side of one step, drawn uniformly from sizes (--grid-sizes) with the run's generator, which
    train_state.pt keeps, so that --resume draws what the run would have; None: the training size."""
    if not sizes:
        return None
    return sizes[int(torch.randint(len(sizes), (1,), generator=generator))]


def check_grid_sizes(sizes: tuple[int, ...], c) -> None:
    """TrainingInputError unless each size cuts into whole tokens."""
    for size in sizes:
        if size % c.patch_size:
            raise TrainingInputError(f"--grid-sizes {size}: not a multiple of the patch size {c.patch_size} "
                                     f"(the model sees a grid of whole patches)")


def stop_reason(run: Run, clock: Clock, pressed: threading.Event) -> str | None:
    """"interrupt" (Ctrl-C), "time" (--time-limit) or None; with several processes all ranks stop at one step."""
    flags = torch.tensor([pressed.is_set(), clock.out_of_time()], dtype=torch.int32, device=run.rt.device)
    if run.rt.world > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    interrupt, out_of_time = flags.tolist()
    return "interrupt" if interrupt else "time" if out_of_time else None


def evaluate_and_save(run: Run, pos: Position, clock: Clock, images_per_s: float) -> dict:
    """Evaluates the weights as they stand, logs the row and saves; at an epoch's end pos moves to the next one."""
    rt, splits = run.rt, run.splits
    test_loss, test_acc = evaluate(run.objective, splits.test.images, splits.test.labels, splits.mean, splits.std, rt)
    at_grids = accuracy_at_grids(run, test_acc)
    sums = pos.sums.clone()
    if rt.world > 1:
        dist.all_reduce(sums)
    row = {"epoch": pos.epochs_done(run.epoch_steps), "step": pos.step, "lr": run.optimizer.param_groups[0]["lr"],
           "train_loss": (sums[0] / sums[2]).item(), "train_acc": (sums[1] / sums[2]).item(),
           "test_loss": test_loss, "test_acc": test_acc, "images_per_s": images_per_s, "elapsed_s": clock.elapsed(),
           **{f"test_acc_{size}": acc for size, acc in at_grids.items()}}
    if pos.batch == run.epoch_steps:
        pos.epoch, pos.batch, pos.sums = pos.epoch + 1, 0, torch.zeros(3, dtype=torch.float64)
    if rt.is_main:
        print(f"epoch {row['epoch']}/{run.cfg.epochs}: train loss {row['train_loss']:.4f} acc {row['train_acc']:.4f} | "
              f"test loss {test_loss:.4f} acc {test_acc:.4f}{_grid_words(at_grids)} | {images_per_s:.0f} img/s | "
              f"{row['elapsed_s']:.0f}s", file=sys.stderr)
        assert run.log is not None  # rank 0 keeps the log
        run.log.rows.append(row)
        save_progress(run, pos, clock, row)
    if rt.world > 1:
        dist.barrier()
    return row


def accuracy_at_grids(run: Run, test_acc: float) -> dict[int, float]:
    """{side: held-out accuracy with the images resized to side x side} for each --grid-sizes size; the training
    size's is test_acc, not computed twice."""
    splits, trained = run.splits, run.model.cfg.image_size
    return {size: test_acc if (size, size) == tuple(trained) else
            evaluate(run.objective, images, splits.test.labels, splits.mean, splits.std, run.rt)[1]
            for size, images in run.test_at_grids.items()}


def _grid_words(at_grids: dict[int, float]) -> str:
    return "".join(f" | at {size} px {acc:.4f}" for size, acc in at_grids.items())


def save_progress(run: Run, pos: Position, clock: Clock, evaluated: dict | None = None) -> None:
    """Writes the log, the checkpoint and the training state (rank 0). `evaluated` is the row of the evaluation
    these weights have just had; without one (a periodic save, Ctrl-C) the checkpoint records no accuracy."""
    pos.elapsed_s = clock.elapsed()
    epochs_done = pos.epochs_done(run.epoch_steps)
    if evaluated and run.objective is not run.model:  # no classifier was trained: no test accuracy to claim
        run.meta.metrics = {"masked_patch_accuracy": evaluated["test_acc"],
                            "masked_patch_loss": evaluated["test_loss"], "epoch": evaluated["epoch"]}
    elif evaluated:
        run.meta.metrics = {"test_accuracy": evaluated["test_acc"], "test_loss": evaluated["test_loss"],
                            "epoch": evaluated["epoch"],
                            **{f"test_accuracy_{size}": evaluated[f"test_acc_{size}"]
                               for size in grid_columns([evaluated])}}
    else:
        run.meta.metrics = {"epoch": epochs_done, "step": pos.step}
    record = {**run.meta.training, **asdict(run.cfg)}  # keeps the last evaluation's images/s through later saves
    record.update(epochs_done=epochs_done, wall_time_s=round(pos.elapsed_s, 1), train_images=len(run.splits.train),
                  parameters=count_parameters(run.model), machine=machine_description(run.rt), cpu=cpu_model_name(),
                  torch=torch.__version__, command=" ".join(sys.argv))
    if run.teachers is not None:
        record["teachers"] = run.teachers.described
    if evaluated:
        record["last_epoch_images_per_s"] = round(evaluated["images_per_s"], 1)
    run.meta.training = record
    assert run.log is not None  # rank 0 keeps the log, and saves
    run.log.write()
    save_checkpoint(run.out_dir / "checkpoint", run.model, run.meta)
    save_state(run.out_dir, run.optimizer, run.generator, pos, _beside_the_model(run.objective))
    clock.last_save = time.monotonic()


def machine_description(rt: Runtime) -> str:
    if rt.device.type == "cuda":
        return f"{rt.world} x {torch.cuda.get_device_name(rt.device)}"
    cpu = platform.processor() or platform.machine()
    return f"{cpu}, {os.cpu_count()} CPU cores, {torch.get_num_threads()} threads, {rt.world} process(es)"


def _beside_the_model(objective: nn.Module) -> dict:
    """What is trained besides the ViT the checkpoint holds: masked-patch pre-training's mask token and head."""
    return {k: v for k, v in objective.state_dict().items() if not k.startswith("vit.")} \
        if isinstance(objective, MaskedPatchPrediction) else {}


def save_state(out_dir: Path, optimizer, generator, pos: Position, beside: dict | None = None) -> None:
    state = {"epoch": pos.epoch, "batch": pos.batch, "step": pos.step, "sums": pos.sums, "elapsed_s": pos.elapsed_s,
             "optimizer": optimizer.state_dict(), "generator": generator.get_state(),
             "torch_rng": torch.get_rng_state(), "beside_the_model": beside or {}}
    tmp = out_dir / (TRAIN_STATE_FILE + ".tmp")
    torch.save(state, tmp)
    tmp.replace(out_dir / TRAIN_STATE_FILE)  # a crash mid-write never leaves a torn state behind


def restore_state(out_dir: Path, objective, optimizer, generator, rt: Runtime) -> Position:
    saved, _ = load_checkpoint(out_dir / "checkpoint")
    state = torch.load(out_dir / TRAIN_STATE_FILE, map_location=rt.device, weights_only=False)
    if isinstance(objective, MaskedPatchPrediction):
        beside = state.get("beside_the_model") or {}
        if not beside:
            raise TrainingInputError(f"{out_dir} was not a masked-patch pre-training run: resume it without --pretrain")
        objective.load_state_dict({**{f"vit.{k}": v for k, v in saved.state_dict().items()}, **beside})
    else:
        objective.load_state_dict(saved.state_dict())
    optimizer.load_state_dict(state["optimizer"])
    generator.set_state(state["generator"])
    torch.set_rng_state(state["torch_rng"])
    # States from before mid-epoch saves hold epoch ends only. The epoch's sums are rank 0's alone (saving them
    # from every rank would need a collective at each save), so other ranks restart theirs: with several
    # processes a resumed epoch's training loss and accuracy leave out the other ranks' batches before the stop.
    sums = state.get("sums") if rt.is_main else None
    return Position(state["epoch"], state.get("batch", 0), state["step"],
                    torch.zeros(3, dtype=torch.float64) if sums is None else sums.cpu(), state["elapsed_s"])
