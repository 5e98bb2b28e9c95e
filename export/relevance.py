"""Class-specific relevance by conservative propagation: what each patch added to the explained class's logit.

The rule (Ali et al., ICML 2022, "XAI for Transformers: Better Explanations through Conservative Propagation",
with AttnLRP's identity rule for the GELU, Achtibat et al., ICML 2024) holds three things constant at their values on
the image and takes gradient x input through what remains:

- the attention weights (softmax(QK^T)): relevance reaches a token through its value vector, never through the
  weights that chose it;
- each LayerNorm's standard deviation: the normalisation becomes an affine map;
- each GELU's gate Phi(z) in GELU(z) = z Phi(z): the MLP becomes linear in its input.

With those frozen, the network from the embedded tokens to the logit is affine, y = J x + c, and

    relevance[patch j] = sum_d (x_j - x0_j)_d J_(j, d)

where x0 are the tokens of the reference image (every normalised pixel 0: the dataset mean, the image deletion
tests start from) under the same frozen gates. The class token's share is 0 (its token is the same in both), so
the patches' relevance sums to y(x) - (J x0 + c): what the image's content, against the mean image, added to the
logit. It is signed: a negative patch lowered the class's score.

Measured (docs/explanations.md) it is far more faithful than gradient-weighted attention rollout (Chefer et al. 2021,
which this module computed before; the evaluation keeps it as a candidate) and needs less: one backward pass that
never enters the softmax, against a backward pass into every attention matrix and a rollout of them.

`explain` runs it in eager PyTorch; export traces the forward and backward (`make_fx`) into plain operations, so
the ONNX graph needs no autograd (export/relevance_graph.py).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from vitserve.export.rollout import attention_rollout

TOP1 = -1  # the target class that means "whatever the model predicts" (the graph computes the arg max)


@dataclass
class FrozenGates:
    """The values the rule holds constant, per block: attention weights (B, heads, N, N), the two LayerNorms'
    standard deviations (B, N, 1) and the GELU's gate (B, N, mlp); and the final LayerNorm's deviation."""

    attention: list[torch.Tensor] = field(default_factory=list)
    norm1: list[torch.Tensor] = field(default_factory=list)
    norm2: list[torch.Tensor] = field(default_factory=list)
    gelu: list[torch.Tensor] = field(default_factory=list)
    final_norm: torch.Tensor | None = None


def _layer_norm(x: torch.Tensor, norm, held: torch.Tensor | None, store: list | None) -> torch.Tensor:
    """LayerNorm with its standard deviation held: computed and detached (stored) or given (`held`)."""
    centred = x - x.mean(-1, keepdim=True)
    std = held if held is not None else (centred.pow(2).mean(-1, keepdim=True) + norm.eps).sqrt().detach()
    if store is not None:
        store.append(std)
    return centred / std * norm.weight + norm.bias


def _gelu_gate(z: torch.Tensor) -> torch.Tensor:
    """Phi(z) of the exact GELU, z Phi(z) (nn.GELU's default): the gate the rule holds."""
    return 0.5 * (1.0 + torch.erf(z * (1.0 / math.sqrt(2.0))))


def conservative_forward(vit, tokens: torch.Tensor, held: FrozenGates | None = None):
    """The model from embedded tokens (B, N, D) to logits, with the rule's gates detached (or, `held`, given).

    Returns logits (B, K), the class token after the final LayerNorm (B, D), and the gates it used. The values
    equal the model's own forward (within float rounding); only the gradients differ.
    """
    gates, x = FrozenGates(), tokens

    def take(name: str, index: int) -> torch.Tensor | None:
        return getattr(held, name)[index] if held else None

    for index, block in enumerate(vit.blocks):
        attn = block.attn
        h = _layer_norm(x, block.norm1, take("norm1", index), gates.norm1)
        batch, count, dim = h.shape
        qkv = attn.qkv(h).reshape(batch, count, 3, attn.num_heads, attn.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # each (B, heads, N, d)
        weights = take("attention", index)
        if weights is None:
            weights = ((q * attn.scale) @ k.transpose(-2, -1)).softmax(dim=-1).detach()  # (B, heads, N, N)
        gates.attention.append(weights)
        x = x + attn.proj((weights @ v).transpose(1, 2).reshape(batch, count, dim))
        z = block.mlp.fc1(_layer_norm(x, block.norm2, take("norm2", index), gates.norm2))  # (B, N, mlp)
        gate = take("gelu", index)
        if gate is None:
            gate = _gelu_gate(z).detach()
        gates.gelu.append(gate)
        x = x + block.mlp.fc2(z * gate)
    final: list[torch.Tensor] = []
    normed = _layer_norm(x, vit.norm, held.final_norm if held else None, final)
    gates.final_norm = final[0]
    return vit.forward_head(normed), normed[:, 0], gates


def class_token_maps(vit, tokens: torch.Tensor, reference: torch.Tensor, target: torch.Tensor):
    """From embedded tokens: logits, the class token's rollout and relevance over the patches (flat), and its
    embedding.

    Args:
        vit: a model.vit.VisionTransformer.
        tokens: (B, N, D) embedded tokens (`vit.embed`); gradients stop here.
        reference: (1, N, D) the reference image's tokens (`vit.embed` of zeros), what relevance is measured against.
        target: (B,) int64 class per image; `TOP1` (-1) explains the predicted class.
    Returns:
        logits (B, K), rollout (B, N - 1), relevance (B, N - 1) and the embedding (B, D) (the class token after the
        final LayerNorm, what the head reads), all detached.
    """
    with torch.enable_grad():
        # Gradients are taken w.r.t. the tokens, whatever the parameters' requires_grad (a frozen model too).
        x = tokens.detach().requires_grad_(True)
        logits, embedding, gates = conservative_forward(vit, x)
        chosen = torch.where(target < 0, logits.argmax(dim=-1), target)  # (B,)
        # Images are independent, so the gradient of the sum is each image's own gradient.
        score = logits.gather(1, chosen[:, None]).sum()
        (gradient,) = torch.autograd.grad(score, [x])
    relevance = ((x.detach() - reference.detach()) * gradient).sum(-1)[:, 1:]  # (B, N - 1)
    flat_grid = (1, tokens.shape[1] - 1)
    rollout = attention_rollout(gates.attention, flat_grid)[:, 0]  # (B, N - 1)
    return logits.detach(), rollout, relevance, embedding.detach()


def reference_tokens(vit, pixels: torch.Tensor) -> torch.Tensor:
    """(1, N, D): the tokens of the reference image (every normalised pixel 0) at `pixels`' size."""
    return vit.embed(torch.zeros_like(pixels[:1])).detach()


def explain(vit, pixels: torch.Tensor, target: torch.Tensor | None = None):
    """Eager PyTorch: logits (B, K), rollout and relevance maps (B, H/P, W/P) for pixels (B, C, H, W).

    `target` (B,) int64 names the class to explain per image (-1: the top-1); None explains every top-1.
    """
    if target is None:
        target = torch.full((pixels.shape[0],), TOP1, dtype=torch.long)
    patch = vit.cfg.patch_size
    grid = (pixels.shape[-2] // patch, pixels.shape[-1] // patch)
    with torch.no_grad():
        tokens, reference = vit.embed(pixels), reference_tokens(vit, pixels)
    logits, rollout, relevance, _ = class_token_maps(vit, tokens, reference, target)
    return logits, rollout.reshape(-1, *grid), relevance.reshape(-1, *grid)


def _repeated(gates: FrozenGates, count: int) -> FrozenGates:
    """One image's gates for `count` copies of it."""
    def spread(values: list[torch.Tensor]) -> list[torch.Tensor]:
        return [g.expand(count, *g.shape[1:]) for g in values]

    assert gates.final_norm is not None  # conservative_forward sets it
    return FrozenGates(spread(gates.attention), spread(gates.norm1), spread(gates.norm2), spread(gates.gelu),
                       gates.final_norm.expand(count, *gates.final_norm.shape[1:]))


def replacement_relevance(vit, pixels: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The same relevance without autograd, for checking: the frozen network is affine, so patch j's relevance is
    the logit minus the logit with token j replaced by the reference's (gates held at the image's values).

    (B, C, H, W) pixels -> (B, H/P, W/P); one forward pass per token and image, so for small inputs only.
    """
    patch = vit.cfg.patch_size
    grid = (pixels.shape[-2] // patch, pixels.shape[-1] // patch)
    with torch.no_grad():
        tokens, reference = vit.embed(pixels), reference_tokens(vit, pixels)
        rows = []
        for image in range(len(pixels)):
            x = tokens[image:image + 1]
            logits, _, gates = conservative_forward(vit, x)
            chosen = int(logits.argmax()) if int(target[image]) < 0 else int(target[image])
            count = x.shape[1] - 1
            replaced = x.repeat(count, 1, 1)  # (N - 1, N, D): row j has patch j swapped for the reference's
            index = torch.arange(count)
            replaced[index, index + 1] = reference[0, 1:]
            without, _, _ = conservative_forward(vit, replaced, _repeated(gates, count))
            rows.append(logits[0, chosen] - without[:, chosen])
    return torch.stack(rows).reshape(-1, *grid)
