"""Vision Transformer (Dosovitskiy et al. 2020, "An Image is Worth 16x16 Words").

One file of small modules, named like timm's so that its checkpoints map key for key:
PatchEmbed -> [class] token + position embeddings -> pre-LN Blocks -> LayerNorm -> head. As in timm, the patch
embedding is an argument (`embed_layer`): PatchEmbed, the hybrid's CNN then patches (model/hybrid.py), or another.
The position embeddings are learned for the training grid and resampled (bicubic) to
whatever grid the input produces; the grid is read from the patch embedding's output
tensor, never from Python ints, so that `torch.export` keeps height and width symbolic.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vitserve.model.hybrid import BACKBONES, HybridEmbed, backbone_stride


@dataclass(frozen=True)
class ViTConfig:
    """Architecture of one ViT. Everything here is recorded in checkpoints and ONNX metadata."""

    image_size: tuple[int, int] = (224, 224)  # (height, width) the position embeddings were learned at
    patch_size: int = 16
    in_channels: int = 3
    num_classes: int = 1000
    embed_dim: int = 768
    depth: int = 12
    num_heads: int = 12
    mlp_dim: int = 3072
    qkv_bias: bool = True
    layer_norm_eps: float = 1e-6
    representation_size: int | None = None  # hidden layer of the pre-training MLP head (paper, sec. 3.1)
    dropout: float = 0.0  # after every dense layer but qkv, and after adding position embeddings (paper, app. B.1)
    attention_dropout: float = 0.0
    # The hybrid (paper, sec. 3.1; model/hybrid.py). None: patches of pixels. (): a ResNet stem, then patches of its
    # feature map; (3, 4, 9): the stem and stages of that many bottleneck blocks. patch_size stays the pixels one
    # token covers: the CNN's stride times the patch cut from its feature map.
    backbone_layers: tuple[int, ...] | None = None
    backbone_width: int = 64  # the stem's channels; stage i has 4 * width * 2**i

    def __post_init__(self) -> None:
        object.__setattr__(self, "image_size", tuple(int(s) for s in self.image_size))
        if self.backbone_layers is not None:
            layers = tuple(int(n) for n in self.backbone_layers)
            object.__setattr__(self, "backbone_layers", layers)
            self._check_backbone(layers)
        if self.embed_dim % self.num_heads:
            raise ValueError(f"embed_dim {self.embed_dim} is not divisible by num_heads {self.num_heads}")
        for side in self.image_size:
            if side % self.patch_size:
                raise ValueError(f"image size {self.image_size} is not a multiple of patch size {self.patch_size}")
        if self.in_channels not in (1, 3):
            raise ValueError(f"in_channels must be 1 or 3, got {self.in_channels}")

    def _check_backbone(self, layers: tuple[int, ...]) -> None:
        stride = backbone_stride(layers)
        if len(layers) > 4 or any(n < 1 for n in layers):
            raise ValueError(f"backbone_layers {list(layers)}: at most 4 stages of at least 1 block each")
        if self.backbone_width < 32 or self.backbone_width % 32:
            raise ValueError(f"backbone_width {self.backbone_width} is not a multiple of 32 (GroupNorm's groups)")
        if self.patch_size % stride:
            raise ValueError(f"patch size {self.patch_size} is not a multiple of the backbone's stride {stride}")

    @property
    def is_hybrid(self) -> bool:
        return self.backbone_layers is not None

    @property
    def grid_size(self) -> tuple[int, int]:
        return (self.image_size[0] // self.patch_size, self.image_size[1] // self.patch_size)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        if self.backbone_layers is None:  # a plain ViT's config reads as it did before hybrids existed
            del d["backbone_layers"], d["backbone_width"]
        else:
            d["backbone_layers"] = list(self.backbone_layers)
        return d

    @classmethod
    def from_dict(cls, d: dict) -> ViTConfig:
        known = {f for f in cls.__dataclass_fields__}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown ViTConfig fields: {sorted(unknown)}")
        return cls(**d)


# (embed_dim, depth, num_heads, mlp_dim): Base/Large/Huge from the paper's Table 1,
# Tiny/Small as in DeiT (Touvron et al. 2021) and timm.
_WIDTHS = {
    "tiny": (192, 12, 3, 768),
    "small": (384, 12, 6, 1536),
    "base": (768, 12, 12, 3072),
    "large": (1024, 24, 16, 4096),
    "huge": (1280, 32, 16, 5120),
}
_SHORT = {"ti": "tiny", "s": "small", "b": "base", "l": "large", "h": "huge"}


def vit_config(name: str, **overrides) -> ViTConfig:
    """A named variant: 'B/16', 'L/32', 'vit_small_patch16_224', 'small', or 'fmnist'; a hybrid as the paper
    names them, 'R50+B/16', 'R26+S/32', 'R+Ti/32' (the stem alone), 'R+fmnist', or as timm does,
    'vit_small_r26_s32_224', 'vit_tiny_r_s16_p8_224'.

    Args:
        name: variant name; a '/P' suffix or 'patchP' sets the patch size (in pixels, for a hybrid too).
        **overrides: any ViTConfig field (image_size, num_classes, in_channels, backbone_width, ...).
    """
    key = name.lower().replace("vit_", "").replace("vit-", "")
    hybrid = _hybrid_name(key)
    if hybrid is not None:
        key, layers = hybrid
        return vit_config(key, **{"backbone_layers": layers, **overrides})
    if key == "fmnist":
        # Small enough to train on two CPU cores; 4x4 patches give a 7x7 grid on 28x28 images.
        base = dict(image_size=(28, 28), patch_size=4, in_channels=1, num_classes=10,
                    embed_dim=128, depth=6, num_heads=4, mlp_dim=256, dropout=0.0)
        return ViTConfig(**{**base, **overrides})
    patch = 16
    if "/" in key:
        key, p = key.split("/", 1)
        patch = int(p)
    elif "_patch" in key:
        key, rest = key.split("_patch", 1)
        patch = int(rest.split("_")[0])
    key = _SHORT.get(key, key)
    if key not in _WIDTHS:
        raise ValueError(unknown_variant_message(name))
    dim, depth, heads, mlp = _WIDTHS[key]
    fields = dict(patch_size=patch, embed_dim=dim, depth=depth, num_heads=heads, mlp_dim=mlp)
    return ViTConfig(**{**fields, **overrides})


def unknown_variant_message(name: str) -> str:
    """Every spelling vit_config accepts, and the likely one when `name` only lacks the '/' ('B16' for 'B/16')."""
    short = re.fullmatch(r"(ti|s|b|l|h)[-_ ]?(\d+)", name.strip().lower())
    hint = f" (did you mean '{short[1].capitalize()}/{short[2]}'?)" if short else ""
    return (f"unknown ViT variant {name!r}{hint}; accepted: a size with its patch in pixels, Ti/S/B/L/H "
            f"('B/16', 'L/32'; also {', '.join(_WIDTHS)}, or timm's 'vit_base_patch16_224'); 'fmnist'; or a hybrid, "
            f"a ResNet backbone ({', '.join(sorted(BACKBONES))}) before it ('R50+B/16', 'R26+S/32', 'R+Ti/32', "
            f"'R+fmnist', or timm's 'vit_small_r26_s32_224')")


def _hybrid_name(key: str) -> tuple[str, tuple[int, ...]] | None:
    """'r50+b/16' -> ('b/16', (3, 4, 9)); timm's 'small_r26_s32_224' -> ('small/32', (2, 2, 2, 2)); else None."""
    if "+" in key:
        prefix, rest = key.split("+", 1)
        if prefix not in BACKBONES:
            raise ValueError(f"unknown hybrid backbone {prefix!r} in {key!r}; known: {sorted(BACKBONES)}")
        return rest, BACKBONES[prefix]
    parts = key.split("_")  # timm: WIDTH_rDEPTH_sSTRIDE[_pPATCH]_SIZE
    if len(parts) >= 4 and parts[1] in BACKBONES and parts[2].startswith("s"):
        layers = BACKBONES[parts[1]]
        feature_patch = int(parts[3][1:]) if parts[3].startswith("p") else 1
        return f"{parts[0]}/{backbone_stride(layers) * feature_patch}", layers
    return None


def resample_pos_embed(pos_embed: torch.Tensor, old_grid: tuple[int, int],
                       new_grid: tuple[int, int]) -> torch.Tensor:
    """Resize the patch part of position embeddings to a new grid; keep the class token's.

    Bicubic, align_corners=False, no antialias. At the same grid this is exactly the identity
    (the cubic kernel's weights at offset 0 are 0, 1, 0, 0), so callers need no size branch.

    Args:
        pos_embed: (1, 1 + old_h * old_w, D) class-token embedding first.
        old_grid: (old_h, old_w) grid the embeddings were learned for.
        new_grid: (new_h, new_w); may be symbolic sizes taken from a tensor's shape.
    Returns:
        (1, 1 + new_h * new_w, D)
    """
    cls_pos, patch_pos = pos_embed[:, :1], pos_embed[:, 1:]
    dim = pos_embed.shape[-1]
    grid = patch_pos.reshape(1, old_grid[0], old_grid[1], dim).permute(0, 3, 1, 2)  # (1, D, h, w)
    grid = F.interpolate(grid.float(), size=(new_grid[0], new_grid[1]), mode="bicubic",
                         align_corners=False, antialias=False).to(pos_embed.dtype)
    patch_pos = grid.permute(0, 2, 3, 1).flatten(1, 2)  # (1, new_h * new_w, D)
    return torch.cat([cls_pos, patch_pos], dim=1)


class PatchEmbed(nn.Module):
    """Non-overlapping PxP patches linearly embedded, as one stride-P convolution."""

    def __init__(self, patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)  # (B, D, H/P, W/P)

    def init_weights(self) -> None:
        # As the linear layer over a flattened patch that it is (paper, eq. 1)
        w = self.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        assert self.proj.bias is not None  # nn.Conv2d's default bias=True
        nn.init.zeros_(self.proj.bias)


# Builds a patch embedding from keywords patch_size (pixels per token), in_channels and embed_dim: a module taking
# pixels (B, C, H, W) to a grid of tokens (B, D, H/P, W/P). timm's `embed_layer`, with our argument names.
EmbedLayer = Callable[..., nn.Module]


def embed_layer_for(cfg: ViTConfig) -> EmbedLayer:
    """The embed layer a config describes: patches of pixels, or (hybrid) patches of a ResNet's feature map.
    Checkpoints store the config, not the layer, so this is how they rebuild it."""
    if cfg.backbone_layers is None:
        return PatchEmbed
    return partial(HybridEmbed, layers=cfg.backbone_layers, width=cfg.backbone_width)


class Attention(nn.Module):
    """Multi-head self-attention with fused qkv.

    The fused path (scaled_dot_product_attention) never materialises the attention matrix;
    `return_attention=True` computes softmax(QK^T/sqrt(d)) explicitly so rollout can use it.
    """

    def __init__(self, dim: int, num_heads: int, qkv_bias: bool, attention_dropout: float, dropout: float):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scale = self.head_dim ** -0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.attn_drop = nn.Dropout(attention_dropout)
        self.proj = nn.Linear(dim, dim)
        self.proj_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, H, N, d)
        if return_attention:
            attn = (q * self.scale) @ k.transpose(-2, -1)  # (B, H, N, N)
            attn = attn.softmax(dim=-1)
            out = self.attn_drop(attn) @ v
        else:
            attn = None
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0)
        out = out.transpose(1, 2).reshape(B, N, C)  # (B, N, D)
        return self.proj_drop(self.proj(out)), attn


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, dropout: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU()
        self.drop1 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(hidden_dim, dim)
        self.drop2 = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.fc2(self.drop1(self.act(self.fc1(x)))))


class Block(nn.Module):
    """Pre-LayerNorm encoder block: x + MSA(LN(x)), then x + MLP(LN(x)) (paper, eqs. 2-3).

    Args:
        dim: token width.
        num_heads: attention heads; must divide dim.
        mlp_dim: the MLP's hidden width.
        qkv_bias: whether the fused qkv projection has a bias.
        layer_norm_eps: both LayerNorms' epsilon.
        dropout: after the attention's output projection and after each MLP layer.
        attention_dropout: on the attention weights.
    """

    def __init__(self, dim: int, num_heads: int, mlp_dim: int, qkv_bias: bool = True, layer_norm_eps: float = 1e-6,
                 dropout: float = 0.0, attention_dropout: float = 0.0):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=layer_norm_eps)
        self.attn = Attention(dim, num_heads, qkv_bias, attention_dropout, dropout)
        self.norm2 = nn.LayerNorm(dim, eps=layer_norm_eps)
        self.mlp = Mlp(dim, mlp_dim, dropout)

    def forward(self, x: torch.Tensor, return_attention: bool = False):
        y, attn = self.attn(self.norm1(x), return_attention)
        x = x + y
        x = x + self.mlp(self.norm2(x))
        return x, attn


class PreLogits(nn.Module):
    """The pre-training head's hidden layer (Linear + tanh); fine-tuning drops it."""

    def __init__(self, dim: int, representation_size: int):
        super().__init__()
        self.fc = nn.Linear(dim, representation_size)
        self.act = nn.Tanh()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.fc(x))


class VisionTransformer(nn.Module):
    """Args:
        cfg: the architecture; it is what checkpoints and ONNX metadata record.
        embed_layer: builds the patch embedding (see EmbedLayer). None: the one cfg describes (embed_layer_for).
            A layer that cfg does not describe gives a model that a checkpoint of it cannot rebuild.
    """

    def __init__(self, cfg: ViTConfig, embed_layer: EmbedLayer | None = None):
        super().__init__()
        self.cfg = cfg
        num_patches = cfg.grid_size[0] * cfg.grid_size[1]
        embed_layer = embed_layer_for(cfg) if embed_layer is None else embed_layer
        self.patch_embed = embed_layer(patch_size=cfg.patch_size, in_channels=cfg.in_channels,
                                       embed_dim=cfg.embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, cfg.embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, 1 + num_patches, cfg.embed_dim))
        self.pos_drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([
            Block(cfg.embed_dim, cfg.num_heads, cfg.mlp_dim, qkv_bias=cfg.qkv_bias, layer_norm_eps=cfg.layer_norm_eps,
                  dropout=cfg.dropout, attention_dropout=cfg.attention_dropout)
            for _ in range(cfg.depth)])
        self.norm = nn.LayerNorm(cfg.embed_dim, eps=cfg.layer_norm_eps)
        head_in = cfg.embed_dim
        self.pre_logits: nn.Module = nn.Identity()
        if cfg.representation_size:
            self.pre_logits = PreLogits(cfg.embed_dim, cfg.representation_size)
            head_in = cfg.representation_size
        self.head = nn.Linear(head_in, cfg.num_classes)
        self.init_weights()

    def init_weights(self) -> None:
        # timm/JAX-style: truncated-normal position embeddings, small class token, xavier linears,
        # zero head so the untrained model predicts uniformly.
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        for name, m in self.named_modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                if m.bias is not None:
                    nn.init.normal_(m.bias, std=1e-6) if "mlp" in name else nn.init.zeros_(m.bias)
        init_embed = getattr(self.patch_embed, "init_weights", None)
        if init_embed is not None:  # an embed layer without its own scheme keeps PyTorch's default
            init_embed()
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def embed(self, x: torch.Tensor, corrupt: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
        """Pixels (B, C, H, W) to tokens (B, 1 + H/P * W/P, D) with position embeddings added. `corrupt`, given,
        changes the patch embeddings (B, N, D) before anything is added (masked-patch pre-training)."""
        x = self.patch_embed(x)  # (B, D, gh, gw), from pixels or from the hybrid's feature map
        grid = x.shape[-2:]  # symbolic under torch.export: keeps H and W dynamic
        x = x.flatten(2).transpose(1, 2)  # (B, gh*gw, D)
        if corrupt is not None:
            x = corrupt(x)
        cls = self.cls_token.expand(x.shape[0], -1, -1)
        x = torch.cat([cls, x], dim=1)
        x = x + resample_pos_embed(self.pos_embed, self.cfg.grid_size, (grid[0], grid[1]))
        return self.pos_drop(x)

    def forward_features(self, x: torch.Tensor, return_attention: bool = False,
                         corrupt: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """Returns normalised tokens (B, N, D) and, if asked, each layer's attention (B, heads, N, N)."""
        x = self.embed(x, corrupt)
        attentions = []
        for block in self.blocks:
            x, attn = block(x, return_attention)
            attentions.append(attn)
        return self.norm(x), (attentions if return_attention else None)

    def forward_head(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.pre_logits(tokens[:, 0]))  # class token -> (B, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens, _ = self.forward_features(x)
        return self.forward_head(tokens)

    def forward_with_attention(self, x: torch.Tensor):
        """(logits (B, K), [attention (B, heads, N, N)] * depth): what export and rollout need."""
        tokens, attentions = self.forward_features(x, return_attention=True)
        return self.forward_head(tokens), attentions


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


__all__ = ["ViTConfig", "vit_config", "resample_pos_embed", "PatchEmbed", "EmbedLayer", "embed_layer_for", "Block",
           "VisionTransformer", "count_parameters"]
