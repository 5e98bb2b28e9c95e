"""Class-specific relevance: gradient-weighted attention rollout (Chefer, Gur, Wolf, ICCV 2021, "Generic
Attention-model Explainability for Interpreting Bi-Modal and Encoder-Decoder Transformers", eq. 5-6).

Attention rollout (export/rollout.py) never looks at the classifier head: it is one map for every class, and it
survives randomising the head and the top blocks (docs/explanations.md). This rule weights each layer's
attention by the gradient of the explained class's logit before propagating it:

    Ā_l = E_heads[(∇A_l ⊙ A_l)⁺]        R = (I + Ā_L) ... (I + Ā_1)        relevance = R[class token, patches]

(R starts as I and accumulates R ← R + Ā_l R from the first layer to the last.) As for rollout, only the class
token's row is served, so it is carried as a row vector: O(layers x tokens²).

`explain` runs the model forward and backward in eager PyTorch; export traces it (forward and backward) into
plain operations (`torch.fx.experimental.proxy_tensor.make_fx`) so the ONNX graph needs no autograd.
"""
from __future__ import annotations

import torch

from vitserve.export.rollout import attention_rollout

TOP1 = -1  # the target class that means "whatever the model predicts" (the graph computes the arg max)


def gradient_weighted_attention(attn: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, N) attention probabilities and the gradient of the target logit w.r.t. them -> (B, N, N)."""
    return (grad * attn).clamp(min=0).mean(dim=1)


def relevance_rollout(attentions: list[torch.Tensor], gradients: list[torch.Tensor]) -> torch.Tensor:
    """The class token's relevance over every token but itself: (B, N - 1).

    Args:
        attentions: per layer, first to last, (B, heads, N, N) softmax attention, token 0 the class token.
        gradients: the target logit's gradient w.r.t. each of `attentions`, same shapes.
    """
    cams = [gradient_weighted_attention(a, g) for a, g in zip(attentions, gradients)]
    # e0ᵀ R = e0ᵀ (I + Ā_L) ... (I + Ā_1). Carried without the e0 part (`row` = that product minus e0ᵀ):
    # each step adds Ā_l's class row (e0ᵀ Ā_l) and row Ā_l. e0 is zero on the patches, so the result is the same,
    # and no one-hot of the symbolic token count is built (its size would be frozen by tracing).
    row = cams[-1][:, :1]  # (B, 1, N)
    for cam in reversed(cams[:-1]):
        row = row + cam[:, :1] + row @ cam  # (B, 1, N)
    return row[:, 0, 1:]  # (B, N - 1)


def class_token_maps(vit, tokens: torch.Tensor, target: torch.Tensor):
    """From embedded tokens: logits, the class token's rollout and relevance over the patches (flat), and its
    embedding.

    Args:
        vit: a model.vit.VisionTransformer.
        tokens: (B, N, D) embedded tokens (`vit.embed`); gradients stop here, attention is all they reach.
        target: (B,) int64 class per image; `TOP1` (-1) explains the predicted class.
    Returns:
        logits (B, K), rollout (B, N - 1), relevance (B, N - 1) and the embedding (B, D) (the class token after the
        final LayerNorm, what the head reads), all detached.
    """
    with torch.enable_grad():
        # Gradients are taken w.r.t. the attention, whatever the parameters' requires_grad (a frozen model too).
        x, attentions = tokens.detach().requires_grad_(True), []
        for block in vit.blocks:
            x, attn = block(x, return_attention=True)
            attentions.append(attn)
        normed = vit.norm(x)  # (B, N, D)
        logits = vit.forward_head(normed)
        chosen = torch.where(target < 0, logits.argmax(dim=-1), target)  # (B,)
        # Images are independent, so the gradient of the sum is each image's own gradient.
        score = logits.gather(1, chosen[:, None]).sum()
        gradients = torch.autograd.grad(score, attentions)
    attentions = [a.detach() for a in attentions]
    flat_grid = (1, attentions[0].shape[-1] - 1)
    rollout = attention_rollout(attentions, flat_grid)[:, 0]  # (B, N - 1)
    relevance = relevance_rollout(attentions, [g.detach() for g in gradients])
    return logits.detach(), rollout, relevance, normed[:, 0].detach()


def explain(vit, pixels: torch.Tensor, target: torch.Tensor | None = None):
    """Eager PyTorch: logits (B, K), rollout and relevance maps (B, H/P, W/P) for pixels (B, C, H, W).

    `target` (B,) int64 names the class to explain per image (-1: the top-1); None explains every top-1.
    """
    if target is None:
        target = torch.full((pixels.shape[0],), TOP1, dtype=torch.long)
    patch = vit.cfg.patch_size
    grid = (pixels.shape[-2] // patch, pixels.shape[-1] // patch)
    logits, rollout, relevance, _ = class_token_maps(vit, vit.embed(pixels).detach(), target)
    return logits, rollout.reshape(-1, *grid), relevance.reshape(-1, *grid)
