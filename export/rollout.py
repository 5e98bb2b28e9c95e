"""Attention rollout (Abnar & Zuidema 2020) as a pure torch function that exports to ONNX.

Rollout multiplies the layers' head-averaged attention, each mixed with the identity for the
residual connection: R = Â_L ... Â_1 with Â = rownorm(0.5 * mean_heads(A) + 0.5 * I).
Only the class token's row of R is served, and e_0ᵀ R is a row vector times matrices, so it is
carried as a vector (starting from the last layer's class row, ending at the first layer's
matrix): O(layers x tokens²) instead of the O(layers x tokens³) of the full product.
"""
from __future__ import annotations

import torch


def residual_attention(attn: torch.Tensor) -> torch.Tensor:
    """(B, heads, N, N) attention probabilities -> (B, N, N) head mean mixed with the identity, rows summing to 1."""
    a = attn.mean(dim=1)  # (B, N, N)
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)  # symbolic N under torch.export
    a = 0.5 * a + 0.5 * eye
    return a / a.sum(dim=-1, keepdim=True)


def attention_rollout(attentions: list[torch.Tensor], grid: tuple) -> torch.Tensor:
    """The class token's rollout over the patches, on the patch grid, not rescaled.

    Args:
        attentions: per layer, first to last, (B, heads, N, N) softmax attention, token 0 the class token.
        grid: (gh, gw) with gh * gw = N - 1; sizes read from tensor shapes so they stay symbolic.
    Returns:
        (B, gh, gw)
    """
    row = residual_attention(attentions[-1])[:, :1]  # (B, 1, N): e_0ᵀ Â_L
    for attn in reversed(attentions[:-1]):
        row = row @ residual_attention(attn)  # (B, 1, N)
    return row[:, 0, 1:].reshape(row.shape[0], grid[0], grid[1])  # (B, gh, gw)
