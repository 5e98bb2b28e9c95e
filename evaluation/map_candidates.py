"""Maps the evaluation measures beside the two the model serves (export/relevance.py: rollout and conservative
relevance), each a function (vit, pixels (B, C, H, W), target (B,)) -> (B, gh, gw) in eager PyTorch:

- `chefer_relevance`: gradient-weighted attention rollout (Chefer, Gur & Wolf 2021, "Generic Attention-model
  Explainability", eq. 5-6): each layer's attention weighted by the logit's gradient w.r.t. it, positive part,
  head-averaged, rolled out as R <- R + A R. The model served it before conservative relevance.
- `gradient_input`: gradient x (tokens - reference tokens) through the model as it is, nothing held constant:
  what conservative relevance is without its rules.
- `occlusion`: the drop in the class's probability when one cell of the image is set to the reference (the mean
  image), one forward pass per cell: the model's own answer to "which region mattered", what deletion measures
  greedily, at a cost no server pays per request.

The class explained is the target (-1: the top-1 of the model on these pixels).
"""
from __future__ import annotations

import torch

from vitserve.export.relevance import reference_tokens


def gradient_weighted_attention(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, N) attention probabilities and the gradient of the target logit w.r.t. them -> (B, N, N)."""
    return (grad * attn).clamp(min=0).mean(dim=1)


def relevance_rollout(attentions: list[torch.Tensor], gradients: list[torch.Tensor]) -> torch.Tensor:
    """The class token's Chefer relevance over every token but itself: (B, N - 1).

    Args:
        attentions: per layer, first to last, (B, heads, N, N) softmax attention, token 0 the class token.
        gradients: the target logit's gradient w.r.t. each of `attentions`, same shapes.
    """
    cams = [gradient_weighted_attention(a, g) for a, g in zip(attentions, gradients)]
    # e0ᵀ R = e0ᵀ (I + Ā_L) ... (I + Ā_1), carried as a row without its e0 part
    row = cams[-1][:, :1]  # (B, 1, N)
    for cam in reversed(cams[:-1]):
        row = row + cam[:, :1] + row @ cam  # (B, 1, N)
    return row[:, 0, 1:]  # (B, N - 1)


def _chosen(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return torch.where(target < 0, logits.argmax(dim=-1), target)  # (B,)


def _grid(vit, pixels: torch.Tensor) -> tuple[int, int]:
    return pixels.shape[-2] // vit.cfg.patch_size, pixels.shape[-1] // vit.cfg.patch_size


def chefer_relevance(vit, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    with torch.enable_grad():
        logits, attentions = vit.forward_with_attention(pixels)
        score = logits.gather(1, _chosen(logits, target)[:, None]).sum()
        gradients = torch.autograd.grad(score, attentions)
    maps = relevance_rollout([a.detach() for a in attentions], list(gradients))
    return maps.reshape(-1, *_grid(vit, pixels))


def gradient_input(vit, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        tokens, reference = vit.embed(pixels), reference_tokens(vit, pixels)
    with torch.enable_grad():
        x = tokens.requires_grad_(True)
        logits = vit.forward_head(_features(vit, x))
        score = logits.gather(1, _chosen(logits, target)[:, None]).sum()
        (gradient,) = torch.autograd.grad(score, [x])
    return ((tokens.detach() - reference) * gradient).sum(-1)[:, 1:].reshape(-1, *_grid(vit, pixels))


def _features(vit, x: torch.Tensor) -> torch.Tensor:
    """Embedded tokens (B, N, D) -> the normalised tokens the head reads."""
    for block in vit.blocks:
        x, _ = block(x)
    return vit.norm(x)


def occlusion(vit, pixels: torch.Tensor, target: torch.Tensor, cells: tuple[int, int] | None = None,
              batch_size: int = 256) -> torch.Tensor:
    """(B, *cells) drop in the class's softmax probability per occluded cell (default: the input's patch grid).

    A cell is the image's height / cells[0] by width / cells[1] pixels (the sides must divide)."""
    cells = cells or _grid(vit, pixels)
    height, width = pixels.shape[-2] // cells[0], pixels.shape[-1] // cells[1]

    def logits_of(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([vit(x[s:s + batch_size]) for s in range(0, len(x), batch_size)])

    def probability(x: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        return logits_of(x).softmax(-1).gather(1, classes[:, None])[:, 0]

    with torch.no_grad():
        logits = logits_of(pixels)  # once: the classes explained and the unoccluded probability both come from it
        classes = _chosen(logits, target)
        whole = logits.softmax(-1).gather(1, classes[:, None])[:, 0]
        out = torch.empty(len(pixels), *cells)
        for row in range(cells[0]):
            for col in range(cells[1]):
                hidden = pixels.clone()
                hidden[..., row * height:(row + 1) * height, col * width:(col + 1) * width] = 0
                out[:, row, col] = whole - probability(hidden, classes)
    return out
