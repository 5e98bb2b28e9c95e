"""NumPy attention rollout and gradient-weighted relevance to check the graph's against: full matrix products in
float64.

Written apart from `export.rollout` on purpose (whole N x N products, first layer to last, no
vector trick; relevance as Chefer et al.'s R <- R + Ā R), so a shared mistake in the two is unlikely. The
rollout is used by verification; Chefer's rule checks the evaluation's candidate of that name
(evaluation/map_candidates.py) in tests.
"""
from __future__ import annotations

import numpy as np


def numpy_attention_rollout(attentions: list[np.ndarray], grid: tuple[int, int]) -> np.ndarray:
    """Per layer (B, heads, N, N) attention probabilities -> (B, gh, gw) class-token rollout over the patches."""
    batch, _, n, _ = attentions[0].shape
    result = np.broadcast_to(np.eye(n), (batch, n, n)).copy()  # (B, N, N)
    for attn in attentions:
        mixed = 0.5 * np.asarray(attn, dtype=np.float64).mean(axis=1) + 0.5 * np.eye(n)
        mixed /= mixed.sum(axis=-1, keepdims=True)
        result = mixed @ result  # R_l = Â_l R_(l-1)
    return result[:, 0, 1:].reshape(batch, grid[0], grid[1])


def numpy_relevance(attentions: list[np.ndarray], gradients: list[np.ndarray], grid: tuple[int, int]) -> np.ndarray:
    """Per layer (B, heads, N, N) attention and the target logit's gradient w.r.t. it -> (B, gh, gw) relevance:
    R = I, then R <- R + E_h[(grad * attn)+] R for each layer, first to last; the class token's row."""
    batch, _, n, _ = attentions[0].shape
    result = np.broadcast_to(np.eye(n), (batch, n, n)).copy()  # (B, N, N)
    for attn, grad in zip(attentions, gradients):
        weighted = np.maximum(np.asarray(grad, np.float64) * np.asarray(attn, np.float64), 0).mean(axis=1)
        result = result + weighted @ result
    return result[:, 0, 1:].reshape(batch, grid[0], grid[1])
