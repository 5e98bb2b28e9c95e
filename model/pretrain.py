"""Self-supervision by masked patch prediction (paper, sec. 4.6 and Appendix B.1.2).

Half of each image's patch embeddings are corrupted, BERT-style: 80% of those replaced by a learnable [mask]
embedding, 10% by another patch's embedding (any image of the batch), 10% kept as they are. The Transformer then
predicts, from each corrupted patch's output token, that patch's mean colour quantised to 3 bits per channel:
512 classes for RGB, as in the paper. For grey images, 8 classes: the same 3 bits of the one channel (finer
levels would ask for intensity detail that the paper's colour target does not).

`vitserve train --pretrain masked-patch` trains with this objective (the labels are not used); the checkpoint is
the ViT alone, which `vitserve train --init-from` fine-tunes on labels.
"""
from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from vitserve.model.vit import VisionTransformer

CORRUPTED_FRACTION = 0.5
MASK_SHARE, REPLACE_SHARE = 0.8, 0.1  # of the corrupted patches; the rest (0.1) are kept as they are
COLOUR_BITS = 3
MASK, REPLACE, KEEP = 0, 1, 2


def colour_classes(channels: int) -> int:
    return 2 ** (COLOUR_BITS * channels)


def mean_colour_targets(pixels: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, H, W) pixels in [0, 1] -> (B, N) each patch's mean colour as one class: per channel the mean's top
    3 bits, channels in order as the digits of a base-8 number (red * 64 + green * 8 + blue)."""
    levels = 2 ** COLOUR_BITS
    means = F.avg_pool2d(pixels.clamp(0, 1), patch_size)  # (B, C, gh, gw)
    digits = (means * levels).floor().clamp(max=levels - 1).long()
    code = torch.zeros_like(digits[:, 0])
    for channel in range(digits.shape[1]):
        code = code * levels + digits[:, channel]
    return code.flatten(1)  # (B, gh * gw)


def corruption_plan(batch: int, tokens: int, generator: torch.Generator | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """Which patches are corrupted, (B, N) bool, exactly half of each image's (rounded), and how, (B, N) int64:
    MASK, REPLACE or KEEP drawn 80/10/10 (only read where corrupted)."""
    count = max(1, round(tokens * CORRUPTED_FRACTION))
    order = torch.rand(batch, tokens, generator=generator).argsort(dim=1)
    chosen = torch.zeros(batch, tokens, dtype=torch.bool)
    chosen.scatter_(1, order[:, :count], True)
    draw = torch.rand(batch, tokens, generator=generator)
    how = torch.where(draw < MASK_SHARE, MASK, torch.where(draw < MASK_SHARE + REPLACE_SHARE, REPLACE, KEEP))
    return chosen, how


def corrupt(patches: torch.Tensor, chosen: torch.Tensor, how: torch.Tensor, mask_token: torch.Tensor,
            generator: torch.Generator | None = None) -> torch.Tensor:
    """(B, N, D) patch embeddings with the plan applied: [mask] embedding, another patch's, or unchanged."""
    b, n, d = patches.shape
    donors = torch.randint(0, b * n, (b, n), generator=generator).to(patches.device)
    others = patches.reshape(b * n, d)[donors]  # (B, N, D): a random patch of the batch for each position
    chosen, how = chosen.to(patches.device), how.to(patches.device)
    out = torch.where((chosen & (how == MASK))[..., None], mask_token.to(patches.dtype).expand(b, n, d), patches)
    return torch.where((chosen & (how == REPLACE))[..., None], others, out)


class MaskedPatchPrediction(nn.Module):
    """A ViT with a [mask] embedding and a head from each output patch token to its patch's mean colour."""

    def __init__(self, vit: VisionTransformer):
        super().__init__()
        self.vit = vit
        self.mask_token = nn.Parameter(torch.zeros(1, 1, vit.cfg.embed_dim))
        nn.init.trunc_normal_(self.mask_token, std=0.02)
        self.head = nn.Linear(vit.cfg.embed_dim, colour_classes(vit.cfg.in_channels))

    def forward(self, x: torch.Tensor, pixels: torch.Tensor, generator: torch.Generator | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the normalised input (B, C, H, W); pixels: the same images in [0, 1]. Returns the logits of the
        corrupted patches (M, classes) and their mean-colour classes (M,)."""
        grid = (x.shape[-2] // self.vit.cfg.patch_size, x.shape[-1] // self.vit.cfg.patch_size)
        chosen, how = corruption_plan(x.shape[0], grid[0] * grid[1], generator)
        plan = partial(corrupt, chosen=chosen, how=how, mask_token=self.mask_token, generator=generator)
        tokens, _ = self.vit.forward_features(x, corrupt=plan)  # (B, 1 + N, D)
        chosen = chosen.to(x.device)
        targets = mean_colour_targets(pixels, self.vit.cfg.patch_size)[chosen]  # (M,)
        return self.head(tokens[:, 1:][chosen]), targets


__all__ = ["MaskedPatchPrediction", "colour_classes", "corrupt", "corruption_plan", "mean_colour_targets"]
