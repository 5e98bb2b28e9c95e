"""The ViT: variants, shapes at many resolutions, position-embedding resampling, the two attention paths."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from torch import nn

from vitserve.model.vit import (Block, PatchEmbed, ViTConfig, VisionTransformer, count_parameters, embed_layer_for,
                       resample_pos_embed, vit_config)

# (embed_dim, depth, num_heads, mlp_dim), written out here rather than read from the module under test.
PAPER_WIDTHS = {
    "tiny": (192, 12, 3, 768),
    "small": (384, 12, 6, 1536),
    "base": (768, 12, 12, 3072),  # paper, Table 1
    "large": (1024, 24, 16, 4096),
    "huge": (1280, 32, 16, 5120),
}
VARIANT_NAMES = [(name, patch) for name in PAPER_WIDTHS for patch in (16, 32)]


def expected_parameters(cfg: ViTConfig) -> int:
    """Parameter count of the paper's ViT, counted layer by layer."""
    d, m, c, p, k = cfg.embed_dim, cfg.mlp_dim, cfg.in_channels, cfg.patch_size, cfg.num_classes
    n = cfg.grid_size[0] * cfg.grid_size[1]
    block = 2 * 2 * d + (d * 3 * d + 3 * d) + (d * d + d) + (d * m + m) + (m * d + d)
    head_in = cfg.representation_size or d
    pre_logits = (d * head_in + head_in) if cfg.representation_size else 0
    return (c * p * p * d + d) + d + (1 + n) * d + cfg.depth * block + 2 * d + pre_logits + head_in * k + k


def tiny_model(seed: int = 0, **overrides) -> VisionTransformer:
    """A 2-layer ViT with a random (not zero) head, so logits differ between inputs and paths."""
    torch.manual_seed(seed)
    fields = dict(image_size=(32, 32), patch_size=8, embed_dim=32, depth=2, num_heads=4, mlp_dim=64, num_classes=5)
    model = VisionTransformer(vit_config("tiny", **{**fields, **overrides}))
    with torch.no_grad():
        model.head.weight.normal_(0, 1.0)
        model.pos_embed.normal_(0, 1.0)
    return model.eval()


def reference_resample(pos_embed: torch.Tensor, old_grid, new_grid) -> torch.Tensor:
    """Direct reference: the patch rows as a (1, D, h, w) image, bicubic-resized, class row untouched."""
    dim = pos_embed.shape[-1]
    patches = pos_embed[0, 1:].t().reshape(1, dim, old_grid[0], old_grid[1])
    resized = F.interpolate(patches, size=tuple(new_grid), mode="bicubic", align_corners=False)
    return torch.cat([pos_embed[:, :1], resized.reshape(dim, -1).t().unsqueeze(0)], dim=1)


# ---- variants and configs ----

@pytest.mark.parametrize("name,patch", VARIANT_NAMES)
def test_named_variant_config(name, patch):
    cfg = vit_config(f"{name}/{patch}")
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == PAPER_WIDTHS[name]
    assert cfg.patch_size == patch
    assert cfg.image_size == (224, 224) and cfg.grid_size == (224 // patch, 224 // patch)
    assert (cfg.in_channels, cfg.num_classes, cfg.representation_size) == (3, 1000, None)


@pytest.mark.parametrize("alias,expected", [
    ("B/16", ("base", 16)), ("L/32", ("large", 32)), ("H/14", ("huge", 14)), ("Ti/16", ("tiny", 16)),
    ("S/32", ("small", 32)), ("vit_small_patch16_224", ("small", 16)), ("vit-base_patch32", ("base", 32)),
    ("large", ("large", 16)), ("HUGE", ("huge", 16)),
])
def test_variant_aliases(alias, expected):
    cfg = vit_config(alias)
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == PAPER_WIDTHS[expected[0]]
    assert cfg.patch_size == expected[1]


def test_fmnist_variant_and_overrides():
    cfg = vit_config("fmnist")
    assert (cfg.image_size, cfg.patch_size, cfg.in_channels, cfg.num_classes) == ((28, 28), 4, 1, 10)
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim, cfg.grid_size) == (128, 6, 4, 256, (7, 7))
    assert vit_config("fmnist", depth=2, image_size=[56, 28]).image_size == (56, 28)
    assert vit_config("B/16", patch_size=8, num_classes=3).patch_size == 8


@pytest.mark.parametrize("name,params", [
    # Published totals (timm's vit_*_224 models with 1000 classes).
    ("Ti/16", 5_717_416), ("S/16", 22_050_664), ("B/16", 86_567_656), ("B/32", 88_224_232),
    ("L/16", 304_326_632), ("H/14", 632_045_800),
])
def test_published_parameter_counts(name, params):
    with torch.device("meta"):
        model = VisionTransformer(vit_config(name))
    assert count_parameters(model) == params == expected_parameters(model.cfg)


# Each variant once (patch 16 with 3 channels, patch 32 with 1), fmnist with both.
@pytest.mark.parametrize("name,patch,channels", [(n, p, 3 if p == 16 else 1) for n, p in VARIANT_NAMES]
                         + [("fmnist", 4, 1), ("fmnist", 4, 3)])
@pytest.mark.slow
def test_variant_output_shapes_on_meta(name, patch, channels):
    """Every variant, built without memory on the meta device, maps (B, C, H, W) to (B, K) at any grid."""
    variant = "fmnist" if name == "fmnist" else f"{name}/{patch}"
    with torch.device("meta"):
        model = VisionTransformer(vit_config(variant, in_channels=channels, num_classes=7))
    assert count_parameters(model) == expected_parameters(model.cfg)
    for size in [(224, 224), (160, 288), (model.cfg.image_size[0], 2 * patch)]:
        with torch.device("meta"):
            x = torch.empty(2, channels, *size)
            tokens, _ = model.forward_features(x)
            logits = model(x)
        grid = (size[0] // patch, size[1] // patch)
        assert tokens.shape == (2, 1 + grid[0] * grid[1], model.cfg.embed_dim)
        assert logits.shape == (2, 7)


@pytest.mark.parametrize("variant,size", [("tiny", (224, 224)), ("small", (96, 160)), ("S/32", (64, 64))])
def test_small_variants_run_for_real(variant, size):
    torch.manual_seed(0)
    model = VisionTransformer(vit_config(variant, num_classes=4)).eval()
    with torch.no_grad():
        logits, attentions = model.forward_with_attention(torch.randn(2, 3, *size))
    n = 1 + (size[0] // model.cfg.patch_size) * (size[1] // model.cfg.patch_size)
    assert logits.shape == (2, 4)
    assert torch.equal(logits, torch.zeros(2, 4))  # the head starts at zero: uniform predictions
    assert len(attentions) == 12
    assert all(a.shape == (2, model.cfg.num_heads, n, n) for a in attentions)


@pytest.mark.parametrize("size", [(28, 28), (56, 56), (28, 84), (12, 20)])
def test_fmnist_one_channel_resolutions(size):
    torch.manual_seed(0)
    model = VisionTransformer(vit_config("fmnist")).eval()
    with torch.no_grad():
        tokens, _ = model.forward_features(torch.randn(3, 1, *size))
        logits = model(torch.randn(3, 1, *size))
    assert tokens.shape == (3, 1 + (size[0] // 4) * (size[1] // 4), 128)
    assert logits.shape == (3, 10)


@pytest.mark.parametrize("channels", [1, 3])
def test_channels(channels):
    model = tiny_model(in_channels=channels)
    assert model.patch_embed.proj.weight.shape == (32, channels, 8, 8)
    with torch.no_grad():
        assert model(torch.randn(2, channels, 32, 32)).shape == (2, 5)
    with pytest.raises(RuntimeError):
        model(torch.randn(2, 4 - channels, 32, 32))


@pytest.mark.parametrize("kwargs,message", [
    (dict(embed_dim=30, num_heads=4), "not divisible by num_heads"),
    (dict(image_size=(30, 32), patch_size=8), "not a multiple of patch size"),
    (dict(image_size=(32, 36), patch_size=8), "not a multiple of patch size"),
    (dict(in_channels=2), "in_channels must be 1 or 3"),
    (dict(in_channels=4), "in_channels must be 1 or 3"),
])
def test_config_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ViTConfig(**{"image_size": (32, 32), "patch_size": 8, "embed_dim": 32, "num_heads": 4, **kwargs})


def test_unknown_variant_and_fields():
    with pytest.raises(ValueError, match="unknown ViT variant 'G/14'; accepted: ") as refused:
        vit_config("G/14")
    for spelling in ["'B/16'", "'fmnist'", "'R50+B/16'", "'R26+S/32'", "'R+Ti/32'", "'vit_small_r26_s32_224'"]:
        assert spelling in str(refused.value)
        vit_config(spelling.strip("'"))  # each spelling the message offers is accepted
    with pytest.raises(ValueError, match=r"unknown ViT variant 'B16' \(did you mean 'B/16'\?\)"):
        vit_config("B16")
    with pytest.raises(ValueError, match=r"'ti_16' \(did you mean 'Ti/16'\?\)"):
        vit_config("ti_16")
    with pytest.raises(ValueError, match=r"unknown ViTConfig fields: \['colour'\]"):
        ViTConfig.from_dict({**ViTConfig().to_dict(), "colour": "red"})
    with pytest.raises(TypeError):
        vit_config("B/16", heads=3)


def test_config_dict_round_trip():
    cfg = vit_config("fmnist", image_size=(28, 56), representation_size=64)
    d = cfg.to_dict()
    assert d["image_size"] == [28, 56] and d["representation_size"] == 64
    assert ViTConfig.from_dict(d) == cfg
    assert ViTConfig(image_size=[64, 32], patch_size=16).image_size == (64, 32)


# ---- position embeddings ----

@pytest.mark.parametrize("grid", [(4, 4), (3, 5), (7, 2)])
def test_resample_is_identity_at_trained_grid(grid):
    torch.manual_seed(0)
    pos = torch.randn(1, 1 + grid[0] * grid[1], 8)
    assert torch.equal(resample_pos_embed(pos, grid, grid), pos)


@pytest.mark.parametrize("old,new", [((4, 4), (6, 6)), ((4, 4), (2, 2)), ((4, 4), (3, 7)), ((3, 5), (5, 3)),
                                     ((7, 7), (14, 14)), ((2, 6), (2, 9))])
def test_resample_matches_direct_interpolation(old, new):
    torch.manual_seed(1)
    pos = torch.randn(1, 1 + old[0] * old[1], 12)
    out = resample_pos_embed(pos, old, new)
    assert out.shape == (1, 1 + new[0] * new[1], 12)
    assert torch.equal(out[:, :1], pos[:, :1])  # the class token's embedding is kept as is
    torch.testing.assert_close(out, reference_resample(pos, old, new), rtol=0, atol=1e-6)


def test_resample_keeps_a_constant_grid_and_its_layout():
    """Bicubic weights sum to one: a constant grid stays constant; a row-only pattern stays row-only."""
    pos = torch.full((1, 1 + 4 * 4, 3), 0.75)
    pos[0, 0] = -2.0
    out = resample_pos_embed(pos, (4, 4), (6, 10))
    assert torch.equal(out[0, 0], torch.full((3,), -2.0))
    torch.testing.assert_close(out[0, 1:], torch.full((60, 3), 0.75), rtol=0, atol=1e-6)
    # Values that depend only on the row index: after resampling, every row of the new grid is flat.
    rows = torch.arange(4.0).repeat_interleave(4)  # (16,) row index of each patch, row-major
    pos = torch.cat([torch.zeros(1, 1, 1), rows.view(1, 16, 1)], dim=1)
    grid = resample_pos_embed(pos, (4, 4), (6, 10))[0, 1:, 0].view(6, 10)
    torch.testing.assert_close(grid, grid[:, :1].expand(6, 10), rtol=0, atol=1e-5)
    assert torch.all(grid[1:, 0] > grid[:-1, 0])


def test_forward_resamples_position_embeddings_for_another_grid():
    """The model at 48x24 equals a model built for 48x24 whose embeddings were resampled once, by hand."""
    model = tiny_model()
    resized = VisionTransformer(vit_config("tiny", image_size=(48, 24), patch_size=8, embed_dim=32, depth=2,
                                           num_heads=4, mlp_dim=64, num_classes=5)).eval()
    state = model.state_dict()
    state["pos_embed"] = reference_resample(state["pos_embed"], (4, 4), (6, 3))
    resized.load_state_dict(state)
    x = torch.randn(2, 3, 48, 24)
    with torch.no_grad():
        torch.testing.assert_close(model(x), resized(x), rtol=0, atol=1e-5)
        assert not torch.allclose(model(x), tiny_model(seed=1)(x))


def test_grid_follows_the_input_not_the_config():
    model = tiny_model()
    with torch.no_grad():
        a = model.embed(torch.randn(1, 3, 32, 32))
        b = model.embed(torch.randn(1, 3, 16, 64))
    assert a.shape == (1, 17, 32) and b.shape == (1, 1 + 2 * 8, 32)


# ---- the embed layer, passed in ----

class PooledEmbed(nn.Module):
    """A stand-in embed layer: each patch's mean pixel times a learned vector, and a count of its calls."""

    def __init__(self, patch_size: int, in_channels: int, embed_dim: int):
        super().__init__()
        self.made_with = (patch_size, in_channels, embed_dim)
        self.direction = nn.Parameter(torch.linspace(-1, 1, embed_dim).reshape(embed_dim, 1, 1))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.avg_pool2d(x.mean(1, keepdim=True), self.made_with[0]) * self.direction  # (B, D, H/P, W/P)


def test_the_embed_layer_passed_in_makes_the_tokens():
    torch.manual_seed(0)
    model = VisionTransformer(vit_config("tiny", image_size=(32, 32), patch_size=8, embed_dim=32, depth=2,
                                         num_heads=4, mlp_dim=64, num_classes=5), embed_layer=PooledEmbed).eval()
    embed = model.patch_embed
    assert isinstance(embed, PooledEmbed) and embed.made_with == (8, 3, 32)
    assert {k for k in model.state_dict() if k.startswith("patch_embed.")} == {"patch_embed.direction"}
    assert torch.equal(embed.direction, torch.linspace(-1, 1, 32).reshape(32, 1, 1))  # no init_weights: left as made
    x = torch.randn(2, 3, 48, 16)  # another grid than the config's: read from the stand-in's output
    with torch.no_grad():
        tokens = model.embed(x)
        expected = embed(x).flatten(2).transpose(1, 2)  # (2, 6 * 2, 32)
        torch.testing.assert_close(tokens[:, 1:] - resample_pos_embed(model.pos_embed, (4, 4), (6, 2))[:, 1:],
                                   expected, rtol=0, atol=1e-6)
        model.head.weight.normal_()  # it starts at zero, which would hide any change below
        calls = embed.calls
        before = model(x)
        assert embed.calls == calls + 1
        embed.direction.mul_(-2)
        assert not torch.allclose(model(x), before)


def test_without_an_embed_layer_the_config_chooses_one():
    assert embed_layer_for(vit_config("fmnist")) is PatchEmbed
    plain = VisionTransformer(vit_config("fmnist", depth=1))
    hybrid = VisionTransformer(vit_config("R+fmnist", depth=1, backbone_width=32))
    assert type(plain.patch_embed) is PatchEmbed
    assert {k for k in hybrid.state_dict() if k.startswith("patch_embed.")} == {
        "patch_embed.backbone.conv.weight", "patch_embed.backbone.norm.weight", "patch_embed.backbone.norm.bias",
        "patch_embed.proj.weight", "patch_embed.proj.bias"}
    assert hybrid.patch_embed.proj.kernel_size == (1, 1)  # 4-pixel tokens: the stem's stride 4, 1x1 patches of it


def test_block_takes_its_widths_not_a_config():
    block = Block(dim=16, num_heads=2, mlp_dim=24, qkv_bias=False, layer_norm_eps=1e-5, dropout=0.25,
                  attention_dropout=0.5)
    assert (block.attn.num_heads, block.attn.head_dim, block.attn.qkv.bias) == (2, 8, None)
    assert (block.mlp.fc1.out_features, block.mlp.fc2.out_features) == (24, 16)
    assert block.norm1.eps == block.norm2.eps == 1e-5
    assert (block.attn.proj_drop.p, block.mlp.drop1.p, block.attn.attn_drop.p) == (0.25, 0.25, 0.5)
    out, attn = block.eval()(torch.randn(3, 5, 16), return_attention=True)
    assert out.shape == (3, 5, 16) and attn.shape == (3, 2, 5, 5)


# ---- attention ----

def test_fused_and_explicit_attention_agree():
    model = tiny_model()
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        fused = model(x)
        logits, attentions = model.forward_with_attention(x)
    assert fused.shape == logits.shape == (4, 5)
    assert fused.abs().max() > 0.1 and not torch.allclose(fused[0], fused[1])  # not trivially equal
    torch.testing.assert_close(logits, fused, rtol=0, atol=1e-5)
    assert len(attentions) == 2
    for attn in attentions:
        assert attn.shape == (4, 4, 17, 17)
        assert (attn >= 0).all()
        torch.testing.assert_close(attn.sum(-1), torch.ones(4, 4, 17), rtol=0, atol=1e-5)


@pytest.mark.parametrize("size", [(32, 32), (24, 40)])
def test_attention_module_paths_agree_and_match_a_reference(size):
    """One Attention layer: SDPA output == explicit output == softmax(QK^T / sqrt(d)) V written here."""
    torch.manual_seed(0)
    attn_layer = tiny_model().blocks[0].attn
    n = 1 + (size[0] // 8) * (size[1] // 8)
    x = torch.randn(2, n, 32) * 3
    with torch.no_grad():
        fused, none = attn_layer(x)
        explicit, probs = attn_layer(x, return_attention=True)
        q, k, v = attn_layer.qkv(x).view(2, n, 3, 4, 8).permute(2, 0, 3, 1, 4)
        ref_probs = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
        ref = attn_layer.proj((ref_probs @ v).transpose(1, 2).reshape(2, n, 32))
    assert none is None and probs.shape == (2, 4, n, n)
    torch.testing.assert_close(fused, explicit, rtol=0, atol=1e-5)
    torch.testing.assert_close(probs, ref_probs, rtol=0, atol=1e-6)
    torch.testing.assert_close(explicit, ref, rtol=0, atol=1e-5)


def test_train_mode_dropout_only_when_configured():
    model = tiny_model(dropout=0.5, attention_dropout=0.5).train()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert not torch.equal(model(x), model(x))
        model.eval()
        assert torch.equal(model(x), model(x))


# ---- heads ----

def test_representation_size_mlp_head():
    model = tiny_model(representation_size=16)
    assert model.pre_logits.fc.weight.shape == (16, 32)
    assert model.head.weight.shape == (5, 16)
    x = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        tokens, _ = model.forward_features(x)
        expected = model.head(torch.tanh(tokens[:, 0] @ model.pre_logits.fc.weight.t() + model.pre_logits.fc.bias))
        logits = model(x)
    assert logits.shape == (3, 5)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-6)
    assert count_parameters(model) == expected_parameters(model.cfg)
    assert isinstance(tiny_model().pre_logits, torch.nn.Identity)


def test_linear_head_reads_only_the_class_token():
    model = tiny_model()
    tokens = torch.randn(2, 17, 32)
    changed = tokens.clone()
    changed[:, 1:] = torch.randn(2, 16, 32)
    with torch.no_grad():
        assert torch.equal(model.forward_head(tokens), model.forward_head(changed))
        torch.testing.assert_close(model.forward_head(tokens), model.head(tokens[:, 0]), rtol=0, atol=0)


def test_initialisation():
    torch.manual_seed(0)
    model = VisionTransformer(vit_config("fmnist"))
    assert torch.equal(model.head.weight, torch.zeros(10, 128)) and torch.equal(model.head.bias, torch.zeros(10))
    assert model.pos_embed.shape == (1, 50, 128) and model.cls_token.shape == (1, 1, 128)
    assert 0.018 < model.pos_embed.std().item() < 0.022
    assert 0 < model.cls_token.abs().max().item() < 1e-5
    assert torch.equal(model.patch_embed.proj.bias, torch.zeros(128))
    bound = math.sqrt(6 / (128 + 3 * 128))  # xavier-uniform on the fused qkv
    assert model.blocks[0].attn.qkv.weight.abs().max().item() <= bound
