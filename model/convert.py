"""Import pretrained ViTs: a timm `VisionTransformer` state dict or a Hugging Face
`ViTForImageClassification` checkpoint, converted into our checkpoint directory.

Both formats are first renamed into our parameter names (which are timm's, see model/vit.py);
one function then reads the architecture from the tensors' shapes, and the model is loaded
strictly, so a checkpoint either maps key for key or is refused with the keys that did not fit.
Nothing is guessed silently: what the weights cannot say (a timm state dict's number of heads)
must be given, and features our ViT lacks (layer scale, register tokens, ...) are refused.
"""
from __future__ import annotations

import json
import math
import pickle
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from vitserve.model.checkpoint import CheckpointError, CheckpointMeta, save_checkpoint
from vitserve.model.hybrid import backbone_stride
from vitserve.model.vit import VisionTransformer, ViTConfig

FORMATS = ("timm", "hf")
# timm's and HF's ViT preprocessing is (x/255 - 0.5) / 0.5 for every channel.
DEFAULT_MEAN_STD = 0.5
# timm builds its ViT with partial(nn.LayerNorm, eps=1e-6); a state dict does not record it.
TIMM_LAYER_NORM_EPS = 1e-6
# Usual head counts per width (ViT-Ti/S/B/L/H), offered when --num-heads is missing.
_USUAL_HEADS = {192: 3, 384: 6, 768: 12, 1024: 16, 1280: 16}


class CheckpointImportError(CheckpointError):
    """A source checkpoint cannot be converted: unreadable, uses a feature we do not implement,
    or lacks information that must then be given (e.g. the number of heads)."""


@dataclass(frozen=True)
class ImportOptions:
    """What the user says about the source; each field, when set, overrides what the source says.

    Args:
        num_heads: attention heads (required for timm, whose state dicts do not record it).
        image_size: (height, width) the position embeddings were learned at; default: a square grid.
        labels: class names in output order.
        mean: per-channel normalisation mean (one value is repeated for every channel).
        std: per-channel normalisation std (one value is repeated for every channel).
        name: model name recorded in the checkpoint; default: the source's file or directory name.
        version: model version recorded in the checkpoint.
        layer_norm_eps: LayerNorm epsilon; default: timm's 1e-6, or HF's config.json value.
    """

    num_heads: int | None = None
    image_size: tuple[int, int] | None = None
    labels: list[str] | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    name: str | None = None
    version: str = "1"
    layer_norm_eps: float | None = None


@dataclass
class SourceInfo:
    """What a source says beside its weights: HF's config.json says much, a timm state dict nothing."""

    num_heads: int | None = None
    layer_norm_eps: float = TIMM_LAYER_NORM_EPS
    image_size: tuple[int, int] | None = None
    labels: list[str] | None = None
    mean: list[float] | None = None
    std: list[float] | None = None
    dropped_keys: list[str] = field(default_factory=list)  # present in the source, unused by its classifier


# ---------------------------------------------------------------------------------------------
# Reading files


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors from a .safetensors file, or from a torch pickle loaded with weights_only=True.

    Args:
        path: the weights file.
    """
    try:
        if path.suffix == ".safetensors":
            return load_file(str(path))
        # weights_only: a downloaded pickle must not run code; plain tensors and dicts load fine.
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first_line = str(e).strip().splitlines()[0]
        raise CheckpointImportError(f"cannot read {path}: torch.load(weights_only=True) refused it "
                                    f"(only tensors are loaded, never arbitrary objects): {first_line}") from e
    except (OSError, RuntimeError, ValueError, SafetensorError) as e:
        raise CheckpointImportError(f"cannot read {path}: {e}") from e


def unwrap_state_dict(obj: object) -> dict[str, torch.Tensor]:
    """The parameter dict inside what torch.load returned.

    Args:
        obj: a state dict, or a training checkpoint holding one under 'state_dict' (timm's
            train.py) or 'model' (DeiT, MAE releases); 'module.' prefixes (DDP) are removed.
    """
    if isinstance(obj, dict):
        for key in ("state_dict", "model"):
            if isinstance(obj.get(key), dict):
                obj = obj[key]
                break
    if not isinstance(obj, dict) or not obj:
        raise CheckpointImportError(f"expected a state dict (parameter name -> tensor), got {type(obj).__name__}")
    not_tensors = [k for k, v in obj.items() if not isinstance(v, torch.Tensor)]
    if not_tensors:
        raise CheckpointImportError(f"expected a state dict of tensors; these entries are not tensors: "
                                    f"{_few(not_tensors)}")
    if all(k.startswith("module.") for k in obj):
        obj = {k[len("module."):]: v for k, v in obj.items()}
    return obj


def read_labels(path: str | Path) -> list[str]:
    """Class names from a file: a JSON list, or one name per line (blank lines skipped).

    Args:
        path: the labels file.
    """
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise CheckpointImportError(f"cannot read labels file {path}: {e}") from e
    if text.lstrip().startswith("["):
        try:
            labels = json.loads(text)
        except json.JSONDecodeError as e:
            raise CheckpointImportError(f"labels file {path} starts like JSON but is not: {e}") from e
        if not all(isinstance(label, str) for label in labels):
            raise CheckpointImportError(f"labels file {path}: the JSON list must hold strings")
        return labels
    return [line.strip() for line in text.splitlines() if line.strip()]


# ---------------------------------------------------------------------------------------------
# timm


# timm ViT features that our ViT does not implement: (pattern on a key, what the feature is).
_UNSUPPORTED_TIMM = [
    (r"\.ls[12]\.gamma$|\.gamma_[12]$", "layer scale (init_values; CaiT, DeiT III)"),
    (r"^reg_token$", "register tokens (reg_tokens)"),
    (r"^fc_norm\.", "fc_norm, a norm after average pooling (global_pool='avg')"),
    (r"^dist_token$|^head_dist\.", "a distillation token (distilled DeiT)"),
    (r"^norm_pre\.", "a norm before the encoder (pre_norm, CLIP)"),
    (r"\.[qk]_norm\.", "query/key normalisation (qk_norm)"),
    (r"^attn_pool\.", "attention pooling (global_pool='map')"),
    (r"\.attn\.norm\.|\.mlp\.norm\.", "norms inside attention or MLP (scale_attn_norm, scale_mlp_norm)"),
    (r"^patch_embed\.norm\.", "a norm after the patch embedding"),
    (r"\.mlp\.fc1_[gx]\.|\.mlp\.w(12|3)\.", "a gated (SwiGLU) MLP"),
    (r"^mask_token$", "a mask token (masked image modelling)"),
    (r"^head\.(norm|pre_logits)\.", "a normed MLP classifier head"),
    (r"^patch_embed\.backbone\..*(running_mean|running_var|num_batches_tracked)$",
     "a hybrid backbone with BatchNorm (timm's vit_*_resnet*d hybrids; vitserve's is ResNetV2 with GroupNorm)"),
]


def refuse_unsupported(keys: list[str]) -> None:
    """Raise CheckpointImportError naming every key that belongs to a feature we do not implement.

    Args:
        keys: parameter names in timm's spelling.
    """
    found: dict[str, list[str]] = {}
    for key in keys:
        for pattern, feature in _UNSUPPORTED_TIMM:
            if re.search(pattern, key):
                found.setdefault(feature, []).append(key)
    if "cls_token" not in keys and "pos_embed" in keys:
        found["no class token (class_token=False); our head reads the class token"] = ["cls_token (absent)"]
    if found:
        listed = "; ".join(f"{feature}: {_few(names)}" for feature, names in found.items())
        raise CheckpointImportError(f"the checkpoint uses features vitserve's ViT does not implement: {listed}")


def timm_to_vitserve(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our names are timm's; only refusals and the classifier's spelling remain to handle.

    Args:
        state: a timm VisionTransformer state dict (possibly wrapped, see unwrap_state_dict).
    """
    state = unwrap_state_dict(state)
    if any(k.startswith(("vit.embeddings.", "embeddings.patch_embeddings.")) for k in state):
        raise CheckpointImportError("these are Hugging Face ViT parameter names: use --format hf "
                                    "(with config.json beside the weights)")
    refuse_unsupported(list(state))
    # timm models built with a ClassifierHead name the final linear layer head.fc.
    return {re.sub(r"^head\.fc\.", "head.", k): v for k, v in state.items()}


# ---------------------------------------------------------------------------------------------
# Hugging Face

# HF ViT names (after an optional 'vit.' prefix) -> ours. The first spelling is what
# save_pretrained writes (transformers 4 and 5); the second is transformers 5's in-memory one.
_LAYER = r"(?:encoder\.layer|layers)\.(\d+)\."
_HF_RULES = [
    (r"embeddings\.cls_token$", "cls_token"),
    (r"embeddings\.position_embeddings$", "pos_embed"),
    (r"embeddings\.patch_embeddings\.projection\.", "patch_embed.proj."),
    (_LAYER + r"layernorm_before\.", r"blocks.\1.norm1."),
    (_LAYER + r"layernorm_after\.", r"blocks.\1.norm2."),
    (_LAYER + r"attention\.attention\.(query|key|value)\.", r"blocks.\1.attn.\2."),
    (_LAYER + r"attention\.q_proj\.", r"blocks.\1.attn.query."),
    (_LAYER + r"attention\.k_proj\.", r"blocks.\1.attn.key."),
    (_LAYER + r"attention\.v_proj\.", r"blocks.\1.attn.value."),
    (_LAYER + r"attention\.(?:output\.dense|o_proj)\.", r"blocks.\1.attn.proj."),
    (_LAYER + r"(?:intermediate\.dense|mlp\.fc1)\.", r"blocks.\1.mlp.fc1."),
    (_LAYER + r"(?:output\.dense|mlp\.fc2)\.", r"blocks.\1.mlp.fc2."),
    (r"layernorm\.", "norm."),
    (r"classifier\.", "head."),
]
# Present in some ViT checkpoints but unused by ViTForImageClassification's forward pass.
_HF_UNUSED = [r"pooler\.", r"embeddings\.mask_token$"]


def hf_to_vitserve(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Rename HF ViT keys to ours and fuse query/key/value; returns (state, dropped keys).

    Args:
        state: a ViTForImageClassification state dict as save_pretrained writes it.
    """
    renamed, dropped, unknown = {}, [], []
    for key, value in state.items():
        short = key.removeprefix("vit.")
        if any(re.match(p, short) for p in _HF_UNUSED):
            dropped.append(key)
            continue
        new = next((re.sub("^" + p, r, short) for p, r in _HF_RULES if re.match(p, short)), None)
        if new is None:
            unknown.append(key)
        else:
            renamed[new] = value
    if unknown:
        raise CheckpointImportError(f"keys that are not part of a HF ViTForImageClassification: {_few(unknown)}")
    return fuse_qkv(renamed), dropped


def fuse_qkv(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Concatenate blocks.N.attn.{query,key,value}.{weight,bias} into blocks.N.attn.qkv.

    Rows are stacked q, k, v: our Attention reshapes qkv's output to (3, heads, head_dim)
    in that order, and HF splits each projection into heads head-major as we do.

    Args:
        state: our names, with separate query/key/value projections.
    """
    fused = {k: v for k, v in state.items() if not re.search(r"\.attn\.(query|key|value)\.", k)}
    groups = {m.group(1, 3) for k in state if (m := re.fullmatch(r"(.*\.attn)\.(query|key|value)\.(\w+)", k))}
    for prefix, kind in sorted(groups):
        names = [f"{prefix}.{part}.{kind}" for part in ("query", "key", "value")]
        missing = [n for n in names if n not in state]
        if missing:
            raise CheckpointImportError(f"cannot fuse query/key/value: missing {_few(missing)}")
        fused[f"{prefix}.qkv.{kind}"] = torch.cat([state[n] for n in names], dim=0)  # (3 * D, ...)
    return fused


def hf_weight_files(source: Path) -> list[Path]:
    """The weight files of a HF checkpoint: one file, or the shards a *.index.json lists.

    Args:
        source: the checkpoint directory, or one weights file inside it.
    """
    if source.is_file() and source.name != "config.json":
        return [source]
    directory = source if source.is_dir() else source.parent
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return [directory / name]
        index = directory / f"{name}.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            return [directory / shard for shard in shards]
    raise CheckpointImportError(f"no weights in {directory}: expected model.safetensors or pytorch_model.bin "
                                "(or their sharded *.index.json)")


def read_hf_checkpoint(source: Path) -> tuple[dict[str, torch.Tensor], SourceInfo]:
    """Weights renamed to ours, plus what config.json (and preprocessor_config.json) say.

    Args:
        source: a save_pretrained directory, or a weights file with config.json beside it.
    """
    directory = source if source.is_dir() else source.parent
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise CheckpointImportError(f"{config_path} not found: a HF checkpoint needs its config.json")
    config = json.loads(config_path.read_text())
    check_hf_config(config)
    state: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(source):
        state.update(unwrap_state_dict(read_weights(path)))
    state, dropped = hf_to_vitserve(state)
    if "head.weight" not in state:
        raise CheckpointImportError("no classifier.weight: this is a ViTModel backbone or another head, "
                                    "not a ViTForImageClassification")
    info = SourceInfo(num_heads=config.get("num_attention_heads"), layer_norm_eps=config.get("layer_norm_eps", 1e-12),
                      image_size=_pair(config["image_size"]) if "image_size" in config else None,
                      labels=hf_labels(config), dropped_keys=dropped)
    info.mean, info.std = hf_normalization(directory / "preprocessor_config.json")
    return state, info


def check_hf_config(config: dict) -> None:
    """Refuse HF models whose computation differs from ours in ways the weights do not show.

    Args:
        config: the checkpoint's config.json.
    """
    model_type = config.get("model_type", "vit")
    if model_type != "vit":
        raise CheckpointImportError(f"config.json model_type is {model_type!r}; vitserve imports HF 'vit' models "
                                    "(ViTForImageClassification) only")
    act = config.get("hidden_act", "gelu")
    if act != "gelu":
        raise CheckpointImportError(f"config.json hidden_act is {act!r}; vitserve's MLP uses exact GELU ('gelu')")


def hf_labels(config: dict) -> list[str] | None:
    """Class names from config.json's id2label, in class-index order (None when absent).

    Args:
        config: the checkpoint's config.json.
    """
    id2label = config.get("id2label")
    if not id2label:
        return None
    by_index = {int(i): str(label) for i, label in id2label.items()}
    if sorted(by_index) != list(range(len(by_index))):
        raise CheckpointImportError(f"config.json id2label does not cover 0..{len(by_index) - 1}; pass --labels")
    return [by_index[i] for i in range(len(by_index))]


def hf_normalization(path: Path) -> tuple[list[float] | None, list[float] | None]:
    """(mean, std) from preprocessor_config.json when the checkpoint ships one, else (None, None).

    Args:
        path: the preprocessor_config.json path (may not exist).
    """
    if not path.is_file():
        return None, None
    pre = json.loads(path.read_text())
    if pre.get("do_normalize", True) is False:
        return [0.0], [1.0]
    mean, std = pre.get("image_mean"), pre.get("image_std")
    if mean is None or std is None:
        return None, None
    return [float(m) for m in mean], [float(s) for s in std]


# ---------------------------------------------------------------------------------------------
# Architecture, model, metadata


_REQUIRED = ["cls_token", "pos_embed", "patch_embed.proj.weight", "blocks.0.norm1.weight",
             "blocks.0.mlp.fc1.weight", "norm.weight", "head.weight"]


def infer_config(state: dict[str, torch.Tensor], num_heads: int | None, layer_norm_eps: float,
                 image_size: tuple[int, int] | None) -> ViTConfig:
    """Read the architecture from the tensors' shapes (our names).

    Args:
        state: weights in our names.
        num_heads: attention heads (shapes cannot tell).
        layer_norm_eps: LayerNorm epsilon (shapes cannot tell).
        image_size: (height, width) of the position-embedding grid; None for a square grid.
    """
    missing = [k for k in _REQUIRED if k not in state]
    if missing:
        raise CheckpointImportError(f"not a ViT classifier state dict: missing {_few(missing)}")
    embed_dim = state["cls_token"].shape[-1]
    if num_heads is None:
        usual = _USUAL_HEADS.get(embed_dim)
        hint = f" (width {embed_dim}: usually {usual})" if usual else ""
        raise CheckpointImportError(f"the number of attention heads is not in the source (a timm state dict "
                                    f"never records it): pass --num-heads N{hint}")
    proj = state["patch_embed.proj.weight"]  # (D, C, P, P)
    if proj.ndim != 4 or proj.shape[-1] != proj.shape[-2]:
        raise CheckpointImportError(f"patch_embed.proj.weight has shape {tuple(proj.shape)}; "
                                    "expected a square convolution (D, C, P, P)")
    patch, in_channels, backbone = proj.shape[-1], proj.shape[1], infer_backbone(state)
    if backbone:
        in_channels = backbone["in_channels"]
        patch *= backbone_stride(backbone["backbone_layers"])  # the pixels one token covers
        backbone = {k: v for k, v in backbone.items() if k != "in_channels"}
    pre_logits = state.get("pre_logits.fc.weight")
    try:
        return ViTConfig(
            image_size=grid_image_size(state["pos_embed"].shape[1] - 1, patch, image_size),
            patch_size=patch, in_channels=in_channels, num_classes=state["head.weight"].shape[0],
            embed_dim=embed_dim, depth=count_blocks(state), num_heads=num_heads,
            mlp_dim=state["blocks.0.mlp.fc1.weight"].shape[0], qkv_bias="blocks.0.attn.qkv.bias" in state,
            layer_norm_eps=layer_norm_eps, representation_size=None if pre_logits is None else pre_logits.shape[0],
            **backbone)
    except ValueError as e:
        raise CheckpointImportError(f"the weights do not describe a ViT we can build: {e}") from e


def infer_backbone(state: dict[str, torch.Tensor]) -> dict:
    """A hybrid's ResNetV2 from its tensors (timm's names): {backbone_layers, backbone_width, in_channels}, or {}
    for a plain ViT. The stem alone is `patch_embed.backbone.conv`; with stages, `...backbone.stem.conv`."""
    stem = state.get("patch_embed.backbone.conv.weight", state.get("patch_embed.backbone.stem.conv.weight"))
    if stem is None:
        if any(k.startswith("patch_embed.backbone.") for k in state):
            names = sorted(k for k in state if k.startswith("patch_embed.backbone."))
            raise CheckpointImportError(f"a hybrid whose backbone is not timm's ResNetV2 (no stem conv): {_few(names)}")
        return {}
    blocks: dict[int, set[int]] = {}
    for key in state:
        if m := re.match(r"patch_embed\.backbone\.stages\.(\d+)\.blocks\.(\d+)\.", key):
            blocks.setdefault(int(m.group(1)), set()).add(int(m.group(2)))
    if sorted(blocks) != list(range(len(blocks))) or any(b != set(range(len(b))) for b in blocks.values()):
        raise CheckpointImportError(f"the backbone's stages and blocks are not numbered 0..N-1: "
                                    f"{ {s: sorted(b) for s, b in sorted(blocks.items())} }")
    return {"backbone_layers": tuple(len(blocks[s]) for s in sorted(blocks)), "backbone_width": stem.shape[0],
            "in_channels": stem.shape[1]}


def grid_image_size(num_positions: int, patch_size: int, image_size: tuple[int, int] | None) -> tuple[int, int]:
    """The image size whose patch grid has `num_positions` cells.

    Args:
        num_positions: patch positions in pos_embed (its length less the class token's one).
        patch_size: patch side in pixels.
        image_size: (height, width) to check against; None assumes a square grid.
    """
    if image_size is None:
        side = math.isqrt(num_positions)
        if side * side != num_positions:
            raise CheckpointImportError(
                f"pos_embed holds {num_positions} patch positions (after the class token's), not a square grid: "
                "pass --image-size HxW; or it has no class-token position (timm's no_embed_class), "
                "which vitserve does not implement")
        return side * patch_size, side * patch_size
    h, w = image_size
    if h % patch_size or w % patch_size or (h // patch_size) * (w // patch_size) != num_positions:
        raise CheckpointImportError(f"image size {h}x{w} with {patch_size}-pixel patches does not give a grid of "
                                    f"{num_positions} patch positions, which is what pos_embed holds")
    return h, w


def count_blocks(state: dict[str, torch.Tensor]) -> int:
    """Encoder depth: the blocks.N indices, which must run 0..depth-1.

    Args:
        state: weights in our names.
    """
    indices = sorted({int(m.group(1)) for k in state if (m := re.match(r"blocks\.(\d+)\.", k))})
    if indices != list(range(len(indices))):
        raise CheckpointImportError(f"encoder blocks are not numbered 0..N-1: {indices}")
    return len(indices)


def build_model(state: dict[str, torch.Tensor], cfg: ViTConfig) -> VisionTransformer:
    """Our ViT with the converted weights, checked key for key and shape for shape.

    Args:
        state: weights in our names.
        cfg: the architecture inferred from them.
    """
    model = VisionTransformer(cfg)
    expected = model.state_dict()
    problems = []
    if unexpected := sorted(set(state) - set(expected)):
        problems.append(f"unrecognised keys (a feature vitserve does not implement?): {_few(unexpected)}")
    if missing := sorted(set(expected) - set(state)):
        problems.append(f"missing keys: {_few(missing)}")
    mismatched = [f"{k} {tuple(state[k].shape)} (expected {tuple(v.shape)})"
                  for k, v in expected.items() if k in state and state[k].shape != v.shape]
    if mismatched:
        problems.append(f"shape mismatches: {_few(mismatched)}")
    if problems:
        raise CheckpointImportError("the weights do not fit the architecture read from them: " + "; ".join(problems))
    model.load_state_dict(state)  # copies into float32 parameters: half-precision sources are upcast
    return model.eval()


def resolve_labels(num_classes: int, candidates: list[tuple[list[str] | None, str]]) -> list[str]:
    """The first candidate given, checked against the class count; else class_0..class_{K-1}.

    Args:
        num_classes: rows of the classifier.
        candidates: (labels or None, where they came from), most authoritative first.
    """
    for labels, origin in candidates:
        if labels is not None:
            if len(labels) != num_classes:
                raise CheckpointImportError(f"{origin} gives {len(labels)} labels; "
                                            f"the classifier has {num_classes} classes")
            return list(labels)
    return [f"class_{i}" for i in range(num_classes)]


def resolve_channels(values: list[float] | None, channels: int, what: str) -> list[float]:
    """Per-channel normalisation values: as given, one value repeated, or timm/HF's 0.5.

    Args:
        values: the values, or None for the default.
        channels: input channels.
        what: 'mean' or 'std', for messages.
    """
    if values is None:
        return [DEFAULT_MEAN_STD] * channels
    if len(values) == 1:
        return [float(values[0])] * channels
    if len(values) != channels:
        raise CheckpointImportError(f"{what} has {len(values)} values for {channels} input channels")
    return [float(v) for v in values]


# ---------------------------------------------------------------------------------------------
# The whole import


def convert(state: dict[str, torch.Tensor], info: SourceInfo,
            options: ImportOptions) -> tuple[VisionTransformer, CheckpointMeta]:
    """Our model and checkpoint metadata from weights in our names; options override the source.

    Args:
        state: weights in our names.
        info: what the source said beside its weights.
        options: what the user said.
    """
    if options.num_heads is not None and info.num_heads not in (None, options.num_heads):
        raise CheckpointImportError(f"--num-heads {options.num_heads} contradicts the source's {info.num_heads}")
    cfg = infer_config(state, options.num_heads or info.num_heads,
                       options.layer_norm_eps if options.layer_norm_eps is not None else info.layer_norm_eps,
                       options.image_size or info.image_size)
    model = build_model(state, cfg)
    labels = resolve_labels(cfg.num_classes, [(options.labels, "--labels"), (info.labels, "config.json id2label")])
    meta = CheckpointMeta(
        config=cfg, labels=labels, name=options.name or "vit", version=options.version,
        mean=resolve_channels(options.mean or info.mean, cfg.in_channels, "mean"),
        std=resolve_channels(options.std or info.std, cfg.in_channels, "std"))
    return model, meta


def import_checkpoint(source: str | Path, fmt: str, out: str | Path,
                      options: ImportOptions = ImportOptions()) -> tuple[Path, CheckpointMeta]:
    """Convert a timm or HF ViT into our checkpoint directory; returns (directory, metadata).

    Args:
        source: timm: a .pth/.pt/.bin or .safetensors state dict. hf: a save_pretrained
            directory, or its weights file with config.json beside it.
        fmt: 'timm' or 'hf'.
        out: the checkpoint directory to write (model.safetensors + config.json).
        options: what the weights cannot say, or overrides.
    """
    source = Path(source)
    if not source.exists():
        raise CheckpointImportError(f"{source} not found")
    if fmt == "timm":
        state, info = timm_to_vitserve(read_weights(source)), SourceInfo()
    elif fmt == "hf":
        state, info = read_hf_checkpoint(source)
    else:
        raise CheckpointImportError(f"unknown format {fmt!r}; expected one of {FORMATS}")
    source_dtype = str(state["cls_token"].dtype).removeprefix("torch.") if "cls_token" in state else None
    default_name = source.stem if source.is_file() else source.resolve().name
    model, meta = convert(state, info, replace(options, name=options.name or default_name))
    meta.training = {"imported_from": str(source.resolve()), "source_format": fmt,
                     "source_dtype": source_dtype, "dropped_keys": info.dropped_keys}
    return save_checkpoint(out, model, meta), meta


def _pair(value: int | list[int]) -> tuple[int, int]:
    return (int(value), int(value)) if isinstance(value, int) else (int(value[0]), int(value[1]))


def _few(names: list[str], limit: int = 6) -> str:
    """Up to `limit` names, then how many more: keeps messages readable for 24-layer models."""
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names) - limit} more)"


__all__ = ["CheckpointImportError", "ImportOptions", "import_checkpoint", "read_labels", "FORMATS"]
