"""The hybrid architecture (paper, sec. 3.1): the patch embedding applied to a CNN's feature map.

The CNN is the paper's ResNet (BiT's ResNetV2 with `preact=False`, as timm builds its hybrids): weight-standardised
convolutions, GroupNorm with 32 groups, a 7x7 stride-2 stem conv and a stride-2 max pool, then bottleneck stages
(stride 1 for the first stage, 2 after). "R50" is its first three stages, (3, 4, 9) blocks, stride 16; "R26" is
(2, 2, 2, 2), stride 32; the stem alone has stride 4. Module and parameter names are timm's
(`patch_embed.backbone.stem.conv`, `...stages.0.blocks.0.downsample.conv`; the stem alone is
`patch_embed.backbone.conv`), so its hybrid checkpoints load key for key.

Padding is TensorFlow's SAME, as the original JAX models and timm's `StdConv2dSame`. For an input whose sides are
multiples of the layer's stride, SAME pads `kernel - stride` in total, whatever the size, so it is a constant here:
the artifact takes sides that are multiples of the whole stride (its patch size), which makes every layer's input
a multiple of that layer's stride, and the exported graph has no shape-dependent padding.
"""
from __future__ import annotations

from collections import OrderedDict

import torch
import torch.nn.functional as F
from torch import nn

STEM_STRIDE = 4  # the stride-2 conv, then the stride-2 max pool
NORM_GROUPS = 32
# Bottleneck blocks per stage of the named backbones (timm's _resnetv2 layers)
BACKBONES = {"r": (), "r26": (2, 2, 2, 2), "r50": (3, 4, 9)}


def backbone_stride(layers: tuple[int, ...]) -> int:
    """The backbone's total stride: the stem's 4, doubled by every stage after the first."""
    return STEM_STRIDE * 2 ** max(len(layers) - 1, 0)


def backbone_channels(layers: tuple[int, ...], width: int) -> int:
    """Channels of the feature map the patches are cut from: the stem's width, or 4x width per stage, doubling."""
    return width if not layers else 4 * width * 2 ** (len(layers) - 1)


def same_padding(kernel: int, stride: int) -> tuple[int, int]:
    """SAME padding (before, after) of one side whose length is a multiple of `stride`."""
    total = max(kernel - stride, 0)
    return total // 2, total - total // 2


class StdConv2d(nn.Conv2d):
    """Convolution with weight standardisation (Qiao et al. 2019; BiT) and SAME padding, no bias.

    Each output filter is normalised to zero mean and unit variance (biased, eps 1e-8 as timm's hybrids) in the
    forward pass: the weights are stored as trained.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size: int, stride: int = 1, eps: float = 1e-8):
        super().__init__(in_channels, out_channels, kernel_size, stride=stride, padding=0, bias=False)
        self.eps = eps
        before, after = same_padding(kernel_size, stride)
        self.same_pad = (before, after, before, after)  # F.pad's order: left, right, top, bottom

    def standardized_weight(self) -> torch.Tensor:
        w = self.weight
        mean = w.mean(dim=(1, 2, 3), keepdim=True)
        var = w.var(dim=(1, 2, 3), unbiased=False, keepdim=True)
        return (w - mean) / torch.sqrt(var + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if any(self.same_pad):
            x = F.pad(x, self.same_pad)
        return F.conv2d(x, self.standardized_weight(), None, self.stride)


class GroupNormAct(nn.GroupNorm):
    """GroupNorm(32 groups, eps 1e-5), then ReLU unless `act` is False (timm's GroupNormAct)."""

    def __init__(self, channels: int, act: bool = True):
        super().__init__(NORM_GROUPS, channels, eps=1e-5)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return F.relu(x) if self.act else x


class MaxPoolSame(nn.Module):
    """3x3 stride-2 max pool with SAME padding (the padding never wins: it is -inf)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        before, after = same_padding(3, 2)
        x = F.pad(x, (before, after, before, after), value=float("-inf"))
        return F.max_pool2d(x, kernel_size=3, stride=2)


def resnet_stem(in_channels: int, width: int) -> nn.Sequential:
    """7x7/2 conv, GroupNorm + ReLU, 3x3/2 max pool: (B, C, H, W) -> (B, width, H/4, W/4)."""
    return nn.Sequential(OrderedDict(conv=StdConv2d(in_channels, width, 7, stride=2), norm=GroupNormAct(width),
                                     pool=MaxPoolSame()))


class DownsampleConv(nn.Module):
    """The shortcut of a stage's first block: 1x1 conv (strided) and GroupNorm without activation."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv = StdConv2d(in_channels, out_channels, 1, stride=stride)
        self.norm = GroupNormAct(out_channels, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.conv(x))


class Bottleneck(nn.Module):
    """1x1 (width/4) -> 3x3 (strided) -> 1x1 (width), each normalised; ReLU after the residual sum (v1.5)."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        mid = out_channels // 4
        self.downsample = None
        if stride != 1 or in_channels != out_channels:
            self.downsample = DownsampleConv(in_channels, out_channels, stride)
        self.conv1 = StdConv2d(in_channels, mid, 1)
        self.norm1 = GroupNormAct(mid)
        self.conv2 = StdConv2d(mid, mid, 3, stride=stride)
        self.norm2 = GroupNormAct(mid)
        self.conv3 = StdConv2d(mid, out_channels, 1)
        self.norm3 = GroupNormAct(out_channels, act=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = self.norm1(self.conv1(x))
        x = self.norm2(self.conv2(x))
        x = self.norm3(self.conv3(x))
        return F.relu(x + shortcut)


class ResNetStage(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, depth: int, stride: int):
        super().__init__()
        self.blocks = nn.Sequential(*[
            Bottleneck(in_channels if i == 0 else out_channels, out_channels, stride if i == 0 else 1)
            for i in range(depth)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


class ResNetBackbone(nn.Module):
    """The stem, then stages of bottleneck blocks: (B, C, H, W) -> (B, backbone_channels, H/s, W/s)."""

    def __init__(self, in_channels: int, layers: tuple[int, ...], width: int):
        super().__init__()
        self.stem = resnet_stem(in_channels, width)
        stages, channels = [], width
        for i, depth in enumerate(layers):
            out = 4 * width * 2 ** i
            stages.append(ResNetStage(channels, out, depth, stride=1 if i == 0 else 2))
            channels = out
        self.stages = nn.Sequential(*stages)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


class HybridEmbed(nn.Module):
    """The CNN, then `proj`: a conv of kernel and stride (patch size / CNN stride) from its channels to the
    token width. `proj` plays the plain ViT's patch embedding, on the feature map instead of the pixels.

    Called as PatchEmbed is, so that `partial(HybridEmbed, layers=..., width=...)` is an embed layer for
    VisionTransformer (timm's hybrids pass `partial(HybridEmbed, backbone=...)` the same way).

    Args:
        patch_size: the pixels one token covers: the CNN's stride times the patch cut from its feature map.
        in_channels: the image's channels.
        embed_dim: the token width.
        layers: bottleneck blocks per stage; () for the stem alone.
        width: the stem's channels; stage i has 4 * width * 2**i.
    """

    def __init__(self, patch_size: int, in_channels: int, embed_dim: int, *, layers: tuple[int, ...], width: int):
        super().__init__()
        stride = backbone_stride(layers)
        if patch_size % stride:
            raise ValueError(f"patch size {patch_size} is not a multiple of the backbone's stride {stride}")
        # The stem alone is the backbone itself, as in timm (keys patch_embed.backbone.conv, .norm)
        self.backbone: nn.Sequential | ResNetBackbone = \
            resnet_stem(in_channels, width) if not layers else ResNetBackbone(in_channels, layers, width)
        feature_patch = patch_size // stride
        self.proj = nn.Conv2d(backbone_channels(layers, width), embed_dim, kernel_size=feature_patch,
                              stride=feature_patch)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.backbone(x))  # (B, D, H/P, W/P)

    def init_weights(self) -> None:
        # proj as the plain ViT's patch embedding (xavier, as a linear layer over the flattened patch), then BiT's
        # He initialisation for the CNN's convolutions, GroupNorm at identity (PyTorch's default for norms).
        # The random draws come in this order so that a seeded run starts from the weights it always did.
        w = self.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        assert self.proj.bias is not None  # nn.Conv2d's default bias=True
        nn.init.zeros_(self.proj.bias)
        for m in self.backbone.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def stem_filters(self) -> torch.Tensor:
        """The first convolution's filters as it applies them to pixels (standardised): (width, C, 7, 7)."""
        stem = self.backbone if isinstance(self.backbone, nn.Sequential) else self.backbone.stem
        conv = stem.conv
        assert isinstance(conv, StdConv2d)  # resnet_stem's first layer
        return conv.standardized_weight().detach()


__all__ = ["BACKBONES", "HybridEmbed", "backbone_channels", "backbone_stride", "same_padding"]
