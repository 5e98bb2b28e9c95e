"""`vitserve train` and `vitserve import`: argument parsing only; torch is imported when a command runs.

`vitserve train`'s flags are made from model.config's `TrainConfig`, its nested `AugmentConfig`, and the ViTConfig
fields that `TrainConfig.model_overrides` lists: name, type, choices and help come from the dataclasses, and so
do the defaults, which a flag left out keeps. model.config imports neither torch nor numpy, so the flags are
added with the parser, which `vitserve` builds for every command (`vitserve serve` too). `--quick` alone is not
a field: it sets two (model.config.QUICK_RUN), and `command_line` turns a TrainConfig back into flags.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import types
import typing

from vitserve.help_format import DefaultsHelpFormatter
from vitserve.model.config import FASHION_MNIST_DIR, QUICK_RUN, AugmentConfig, TrainConfig, TrainingInputError

TRAIN_DESCRIPTION = (
    "Train a ViT and write a checkpoint for `vitserve export`. With no flags: the fmnist variant (805k parameters) "
    "on Fashion-MNIST for 40 epochs, about 2 h on two idle CPU cores; --quick makes one short epoch (a minute or "
    "two) to try the whole path, --time-limit stops after so many minutes. It says first what it will do (data, "
    "model, steps, device, files) and last where the checkpoint is and what to run next. A checkpoint is saved at "
    "every epoch's end, every --save-every minutes and on Ctrl-C, which then exits with status 130; the same "
    "command with --resume continues from there. Each flag sets one field of model.config.TrainConfig (or of its "
    "AugmentConfig, or one ViTConfig field in its model_overrides); a flag left out keeps the default shown.")


def _size(text: str) -> list[int]:
    parts = [int(p) for p in text.lower().replace("x", ",").split(",")]
    return parts * 2 if len(parts) == 1 else parts


def _layers(text: str) -> tuple[int, ...]:
    """'2,2' -> (2, 2); '0' -> () (a hybrid's stem alone)."""
    try:
        parts = tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: blocks per stage, e.g. 2,2 (0: the stem alone)") from None
    return () if parts == (0,) else parts


def add_train_parser(subparsers) -> None:
    p = subparsers.add_parser("train", help="train a ViT on Fashion-MNIST or an image folder",
                              description=TRAIN_DESCRIPTION, formatter_class=DefaultsHelpFormatter)
    quick = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in QUICK_RUN.items())
    p.add_argument("--quick", action="store_true",
                   help=f"a short run to try training, export and serving: {quick}, unless given (the default "
                        f"model: a minute or two on two CPU cores, about 50%% test accuracy) (default: off)")
    add_config_flags(p)
    p.set_defaults(func=run_train)


def add_config_flags(parser: argparse.ArgumentParser) -> None:
    """A flag per field, in a group per dataclass. A flag sets its field's path ("epochs", "augment.crop",
    "model_overrides.depth") only when given, so a default lives in its dataclass alone."""
    run = parser.add_argument_group("TrainConfig")
    for f, hint in _fields(TrainConfig):
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):  # a nested config class, as augment's
            group = parser.add_argument_group(f"{f.name} ({hint.__name__})", f.metadata.get("help"))
            for sub, sub_hint in _fields(hint):
                _add_flag(group, f"{f.name}.{sub.name}", sub_hint, sub.metadata, sub.default)
        elif "flags" in f.metadata:  # {ViTConfig field: (its type, help)}
            group = parser.add_argument_group(f"{f.name} (ViTConfig fields)", f.metadata["help"])
            for name, (vit_hint, help_text) in f.metadata["flags"].items():
                group.add_argument("--" + name.replace("_", "-"), dest=f"{f.name}.{name}", default=argparse.SUPPRESS,
                                   help=help_text.replace("%", "%%"), **_value_kwargs(vit_hint))
        else:
            _add_flag(run, f.name, hint, f.metadata, f.default)


def _fields(cls) -> list[tuple[dataclasses.Field, typing.Any]]:
    hints = typing.get_type_hints(cls)  # the annotations are strings (`from __future__ import annotations`)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls)]


def _add_flag(group, dest: str, hint, metadata, default) -> None:
    name = metadata.get("flag", dest.rpartition(".")[2]).replace("_", "-")
    kwargs: dict
    if hint is bool:  # the flag flips the default: --resume turns it on, --no-hflip turns it off
        flag = f"--no-{name}" if default else f"--{name}"
        kwargs, shown = {"action": "store_false" if default else "store_true"}, "on" if default else "off"
    else:
        flag, kwargs, shown = f"--{name}", _value_kwargs(hint), _shown(default)
        if metadata.get("parse") == "pixel-sizes":  # one comma-separated word, not the backbone's blocks per stage
            kwargs["type"] = _pixel_sizes
    if "metavar" in metadata:
        kwargs["metavar"] = metadata["metavar"]
    help_text = f"{metadata['help']} (default: {shown})"
    group.add_argument(flag, dest=dest, default=argparse.SUPPRESS, help=help_text.replace("%", "%%"), **kwargs)


def _pixel_sizes(text: str) -> tuple[int, ...]:
    """'12,16,20' -> (12, 16, 20): --grid-sizes."""
    try:
        return tuple(int(p) for p in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: sizes in pixels, comma-separated, e.g. 20,24,28") from None


def _value_kwargs(hint) -> dict:
    """type, choices, nargs, metavar for int, float, str, X | None, Literal[...], tuple[float, float] and
    tuple[int, int] (an image size, written H[xW])."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):  # X | None: the flag takes an X
        return _value_kwargs(args[0])
    if origin is typing.Literal:
        return {"type": type(args[0]), "choices": args}
    if hint == tuple[int, int]:
        return {"type": _size, "metavar": "H[xW]"}
    if hint == tuple[int, ...]:
        return {"type": _layers, "metavar": "N[,N...]"}
    if hint == tuple[str, ...]:  # a flag given once per value
        return {"type": str, "action": _AppendTuple}
    if origin is tuple:
        return {"type": args[0], "nargs": len(args), "metavar": ("MIN", "MAX"), "action": _StoreTuple}
    return {"type": hint, "metavar": {int: "N", float: "X"}.get(hint)}


class _StoreTuple(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, tuple(values))  # the field is a tuple; nargs makes a list


class _AppendTuple(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, (*getattr(namespace, self.dest, ()), values))


def _shown(value) -> str:
    if value is None or value == ():
        return "none"
    if isinstance(value, tuple):
        return " ".join(map(_shown, value))
    return f"{value:g}" if isinstance(value, float) else str(value)


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig the flags describe: the flags given, dataclass defaults for the rest."""
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    given: dict = {"model_overrides": {}, "augment": {}}
    for key, value in vars(args).items():
        name, _, sub = key.partition(".")
        if name in names and sub:
            given[name][sub] = value
        elif name in names:
            given[name] = value
    if getattr(args, "quick", False):
        given = {**QUICK_RUN, **given}
    return TrainConfig(**{**given, "augment": AugmentConfig(**given["augment"])})


def command_line(cfg: TrainConfig) -> str:
    """The `vitserve train` command that makes cfg: a flag for each field that differs from its default."""
    words = ["vitserve", "train"]
    for f, hint in _fields(TrainConfig):
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(hint):
            for sub, _ in _fields(hint):
                words += _flag_words(sub, getattr(value, sub.name), getattr(AugmentConfig(), sub.name))
        elif "flags" in f.metadata:
            for name, override in value.items():
                words += [f"--{name.replace('_', '-')}", *_override_words(name, override)]
        else:
            words += _flag_words(f, value, getattr(TrainConfig(), f.name))
    return shlex.join(words)


def _flag_words(f: dataclasses.Field, value, default) -> list[str]:
    if value == default:
        return []
    name = f.metadata.get("flag", f.name).replace("_", "-")
    if isinstance(value, bool):
        return [f"--no-{name}" if default else f"--{name}"]
    if f.metadata.get("parse") == "pixel-sizes":
        return [f"--{name}", ",".join(map(str, value))]
    if default == ():  # a flag given once per value (--distill-from)
        return [word for item in value for word in (f"--{name}", str(item))]
    return [f"--{name}", *_value_words(value)]


def _override_words(name: str, value) -> list[str]:
    """A ViTConfig override as its flag's words: an image size H[xW], backbone layers N[,N...] (0: none)."""
    if name == "image_size":
        return ["x".join(map(str, value))]
    if name == "backbone_layers":
        return [",".join(map(str, value)) or "0"]
    return _value_words(value)


def _value_words(value) -> list[str]:
    return [repr(v) if isinstance(v, float) else str(v) for v in (value if isinstance(value, tuple) else [value])]


def run_train(args) -> int:
    """Trains; a user's error is one line (exit 1), Ctrl-C says where the run was saved and how to resume (exit
    130), and the end says where the checkpoint is and what to run next."""
    from vitserve.model.checkpoint import CheckpointError, strict_json
    from vitserve.model.train import TrainingInterrupted, train

    cfg = train_config(args)
    speaks = int(os.environ.get("RANK", 0)) == 0  # under torchrun, rank 0 alone
    try:
        row = train(cfg)
    except TrainingInterrupted as stop:
        if speaks:
            print(f"vitserve train: interrupted at epoch {stop.epochs_done} (step {stop.step:,} of "
                  f"{stop.total_steps:,}); the checkpoint and training state are saved in {stop.out_dir}\n"
                  f"continue with: {command_line(dataclasses.replace(cfg, resume=True))}", file=sys.stderr)
        return 130
    except (TrainingInputError, CheckpointError, FileNotFoundError) as e:
        # The user's to fix (flags, data, a checkpoint path): one line, no traceback.
        print(f"vitserve train: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 1
    if speaks:
        if row and row["epoch"] < cfg.epochs:  # --time-limit ended it
            print(f"time limit reached at epoch {row['epoch']} of {cfg.epochs}; continue with: "
                  f"{command_line(dataclasses.replace(cfg, resume=True))}", file=sys.stderr)
        print(next_steps(cfg, row), file=sys.stderr)
        if row:
            print(json.dumps(strict_json({k: _rounded(v) for k, v in row.items()}), allow_nan=False))
    return 0


def _rounded(value):
    """Four decimals, or four significant digits below 0.01: a learning rate of 1e-05 is not 0.0."""
    if not isinstance(value, float):
        return value
    return round(value, 4) if abs(value) >= 0.01 else float(f"{value:.4g}")


def next_steps(cfg: TrainConfig, row: dict) -> str:
    """Where the checkpoint is, and the commands that export and serve it."""
    out = cfg.out_dir.rstrip("/")
    checkpoint, onnx = shlex.quote(f"{out}/checkpoint"), shlex.quote(f"{out}/model.onnx")
    scored = "masked-patch accuracy" if cfg.pretrain != "none" else "held-out accuracy"
    done = (f"{scored} {100 * row['test_acc']:.2f}% after epoch {row['epoch']} (step {row['step']:,})"
            if row else "nothing left to train")
    if cfg.pretrain != "none":
        return (f"checkpoint: {checkpoint} ({done}): pre-trained, no classifier yet\n"
                f"next: vitserve train --init-from {checkpoint} --out {shlex.quote(out + '-finetuned')}")
    return (f"checkpoint: {checkpoint} ({done})\n"
            f"next: vitserve export {checkpoint} --out {onnx}\n"
            f"      vitserve serve --model {onnx}")


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

    from vitserve.model.convert import CheckpointImportError, ImportOptions, import_checkpoint, read_labels

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


def add_inspect_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "inspect", help="what a trained ViT learned: the paper's Figure 7 panels from a checkpoint or an export",
        description="Writes to --out: the principal components of the patch-embedding filters (filters.png), the "
                    "cosine similarity of the position embeddings (position_similarity.png), the mean attention "
                    "distance of every head against depth (attention_distance.png), their numbers "
                    "(inspection.json) and a short REPORT.md. From a checkpoint, attention distances average over "
                    "--images images: Fashion-MNIST's test set for a 1-channel 28x28 model, or the image files of "
                    "--images-dir. From an exported file (any precision), the numbers `vitserve export` computed "
                    "from the float32 weights and stored in it.",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("model", metavar="MODEL", help="checkpoint directory (config.json + model.safetensors) or .onnx "
                                                  "file from `vitserve export`")
    p.add_argument("--out", required=True, metavar="DIR", help="where the panels, the JSON and the report go")
    p.add_argument("--images", type=int, default=256, help="images the attention distances average over")
    p.add_argument("--images-dir", metavar="DIR", help="image files to use instead of Fashion-MNIST's test set")
    p.add_argument("--data-dir", default=FASHION_MNIST_DIR,
                   help="Fashion-MNIST's folder (Debian's dataset-fashion-mnist)")
    p.set_defaults(func=run_inspect)


def run_inspect(args) -> int:
    """From an exported file, the numbers stored in it (no torch: the serving install runs this too); from a
    checkpoint, computed by the model (torch)."""
    from pathlib import Path

    from vitserve.model.inspection_report import InspectionInputError, can_draw_panels, write

    try:
        if Path(args.model).is_file():
            inspection, title = _stored_inspection(Path(args.model))
        else:
            inspection, title = _computed_inspection(args)
    except InspectionInputError as e:
        print(f"vitserve inspect: {e}", file=sys.stderr)
        return 2
    for path in write(inspection, Path(args.out), title):
        print(f"wrote {path}")
    if not can_draw_panels():
        print("vitserve inspect: the panels (PNG) need matplotlib, which this install lacks: pip install matplotlib")
    return 0


def _computed_inspection(args):
    """(Inspection, title) of a checkpoint, its attention distances averaged over the images `args` names."""
    from vitserve.model.augment import normalize
    from vitserve.model.checkpoint import load_checkpoint
    from vitserve.model.inspection import inspect, inspection_images

    model, meta = load_checkpoint(args.model)
    images = inspection_images(model.cfg.in_channels, model.cfg.image_size, args.images, args.images_dir,
                               args.data_dir)
    return inspect(model, normalize(images, meta.mean, meta.std)), f"{meta.name} {meta.version}"


def _stored_inspection(path):
    """(Inspection, title) from an exported file's metadata; InspectionInputError when it has none."""
    from vitserve.artifact import ArtifactError
    from vitserve.model.inspection_report import InspectionInputError, from_json
    from vitserve.onnx_header import read_stored_inspection

    try:
        data = read_stored_inspection(path)
    except ArtifactError as e:
        raise InspectionInputError(f"{path}: {e}") from None
    if data is None:
        raise InspectionInputError(f"{path} carries no inspection (exported with --inspection-images 0, or "
                                   "before vitserve stored one): inspect its checkpoint, or export it again")
    try:
        return from_json(data)
    except (KeyError, ValueError, TypeError) as e:
        raise InspectionInputError(f"{path}: its stored inspection is malformed ({type(e).__name__}: {e})") from None
