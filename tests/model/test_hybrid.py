"""The hybrid ViT (paper, sec. 3.1) against timm's own hybrids: names, import, logits, export, rollout.

timm's `vision_transformer_hybrid` is the reference, built with random weights (no downloads) and imported
without torchvision (timm_reference.py). The three hybrids timm registers cover the three backbone shapes: the
stem alone (vit_tiny_r_s16_p8), R26 (four stages) and R50 (three stages).
"""
from __future__ import annotations

import sys
from functools import partial

import numpy as np
import onnxruntime as ort
import pytest
import torch

from vitserve.export.onnx_export import export_onnx
from vitserve.export.rollout_reference import numpy_attention_rollout
from vitserve.model.checkpoint import load_checkpoint
from vitserve.model.convert import CheckpointImportError, ImportOptions, import_checkpoint
from vitserve.model.hybrid import HybridEmbed, backbone_stride, same_padding
from vitserve.model.vit import ViTConfig, VisionTransformer, resample_pos_embed, vit_config
from timm_reference import timm_without_torchvision

TOL = 1e-4
HYBRID = "timm.models.vision_transformer_hybrid"
# timm variant -> (our name for it, its backbone layers, pixels per token at 224)
TIMM_HYBRIDS = {
    "vit_tiny_r_s16_p8_224": ("R+Ti/32", (), 32),
    "vit_small_r26_s32_224": ("R26+S/32", (2, 2, 2, 2), 32),
    "vit_base_r50_s16_224": ("R50+B/16", (3, 4, 9), 16),
}
SMALL = dict(embed_dim=32, depth=2, num_heads=4, num_classes=5)  # the transformer part made small
OURS_SMALL = dict(SMALL, mlp_dim=4 * SMALL["embed_dim"])  # timm's mlp_ratio 4


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)  # fresh inits give near-zero logits, against which a wrong mapping hides
    return model.eval()


def _timm_hybrid(variant: str, img_size: tuple[int, int]):
    with timm_without_torchvision(HYBRID) as hybrid:
        return _randomise(getattr(hybrid, variant)(pretrained=False, img_size=img_size, **SMALL))


SLIM_LAYERS = (1, 1, 1, 1)  # R26's four stages (stride 32), one block each


def _timm_slim_r26(img_size: tuple[int, int]):
    """timm's R26+S/32 with one bottleneck block per stage, built from timm's public classes the way its
    vit_small_r26_s32_224 builds itself: the export tests trace every backbone node through torch.export (about
    4 s a block here), and one block per stage still puts each stage's kind of block (a strided first one) in the
    graph."""
    with timm_without_torchvision(HYBRID) as hybrid:
        from timm.layers import StdConv2dSame

        backbone = hybrid.ResNetV2(layers=SLIM_LAYERS, num_classes=0, global_pool="", in_chans=3, preact=False,
                                   stem_type="same", conv_layer=partial(StdConv2dSame, eps=1e-8))
        return _randomise(hybrid.VisionTransformer(img_size=img_size, patch_size=1, **SMALL,
                                                   embed_layer=partial(hybrid.HybridEmbed, backbone=backbone)))


@pytest.mark.parametrize("variant", sorted(TIMM_HYBRIDS))
@pytest.mark.slow
def test_names_give_timms_architecture(variant):
    ours, layers, patch = TIMM_HYBRIDS[variant]
    for name in (ours, variant):
        cfg = vit_config(name)
        assert (cfg.backbone_layers, cfg.backbone_width, cfg.patch_size, cfg.grid_size) == \
            (layers, 64, patch, (224 // patch,) * 2)
    reference = _timm_hybrid(variant, (224, 224))
    assert reference.patch_embed.grid_size == vit_config(ours).grid_size
    mine = VisionTransformer(vit_config(ours, **OURS_SMALL)).state_dict()
    assert {k: tuple(v.shape) for k, v in mine.items()} == \
        {k: tuple(v.shape) for k, v in reference.state_dict().items()}


def test_backbone_arithmetic_and_config_checks():
    assert [backbone_stride(layers) for layers in [(), (1,), (2, 2), (3, 4, 9), (2, 2, 2, 2)]] == [4, 4, 8, 16, 32]
    # TensorFlow's SAME on a side that is a multiple of the stride: kernel - stride in total, the extra one after
    assert [same_padding(k, s) for k, s in [(7, 2), (3, 2), (3, 1), (1, 2), (1, 1)]] == \
        [(2, 3), (0, 1), (1, 1), (0, 0), (0, 0)]
    with pytest.raises(ValueError, match="not a multiple of the backbone's stride 16"):
        vit_config("R50+B/8")
    with pytest.raises(ValueError, match="patch size 6 is not a multiple of the backbone's stride 4"):
        HybridEmbed(6, 1, 32, layers=(), width=32)  # an embed layer is checked without a config too
    with pytest.raises(ValueError, match="multiple of 32"):
        vit_config("R+fmnist", backbone_width=48)
    with pytest.raises(ValueError, match="at least 1 block"):
        vit_config("R+fmnist", backbone_layers=(2, 0))
    with pytest.raises(ValueError, match="unknown hybrid backbone 'r34'"):
        vit_config("R34+S/16")
    cfg = vit_config("R+fmnist", backbone_layers=[2])
    assert cfg.backbone_layers == (2,) and ViTConfig.from_dict(cfg.to_dict()) == cfg
    assert cfg.to_dict()["backbone_layers"] == [2]  # JSON-ready


@pytest.fixture(scope="module")
def imported_hybrids(tmp_path_factory):
    """Each timm hybrid at 64x64 (and the slim R26, "slim_r26"), saved as a state dict and imported: variant ->
    (timm model, our checkpoint)."""
    out = {}
    for variant in [*TIMM_HYBRIDS, "slim_r26"]:
        reference = _timm_slim_r26((64, 64)) if variant == "slim_r26" else _timm_hybrid(variant, (64, 64))
        directory = tmp_path_factory.mktemp(variant)
        torch.save(reference.state_dict(), directory / "hybrid.pth")
        checkpoint, _ = import_checkpoint(directory / "hybrid.pth", "timm", directory / "checkpoint",
                                          ImportOptions(num_heads=SMALL["num_heads"]))
        out[variant] = (reference, checkpoint)
    assert "timm" not in sys.modules and "torchvision" not in sys.modules
    return out


@pytest.mark.parametrize("variant", sorted(TIMM_HYBRIDS))
def test_imported_hybrid_gives_timms_logits(imported_hybrids, variant):
    reference, checkpoint = imported_hybrids[variant]
    model, meta = load_checkpoint(checkpoint)
    assert model.cfg.backbone_layers == TIMM_HYBRIDS[variant][1] and model.cfg.image_size == (64, 64)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = reference(x)
        assert expected.abs().max() > 0.5
        torch.testing.assert_close(model(x), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant", ["vit_small_r26_s32_224", "vit_tiny_r_s16_p8_224"])
@pytest.mark.slow
def test_other_sizes_match_timm_with_plainly_interpolated_position_embeddings(imported_hybrids, variant):
    reference, checkpoint = imported_hybrids[variant]
    model, _ = load_checkpoint(checkpoint)
    size = (128, 96)  # a 4x3 grid of 32-pixel tokens, from the 2x2 it learned
    state = dict(reference.state_dict())
    grid = (size[0] // 32, size[1] // 32)
    state["pos_embed"] = resample_pos_embed(state["pos_embed"], (2, 2), grid)
    at_size = _timm_hybrid(variant, size)
    at_size.load_state_dict(state)
    x = torch.randn(2, 3, *size)
    with torch.no_grad():
        torch.testing.assert_close(model(x), at_size(x), atol=TOL, rtol=0)


def test_non_resnetv2_backbones_are_refused_with_their_keys(imported_hybrids, tmp_path):
    reference, _ = imported_hybrids["vit_small_r26_s32_224"]
    state = dict(reference.state_dict())
    state["patch_embed.backbone.stages.0.blocks.0.bn1.running_mean"] = torch.zeros(64)
    torch.save(state, tmp_path / "bn.pth")
    with pytest.raises(CheckpointImportError, match=r"BatchNorm.*stages\.0\.blocks\.0\.bn1\.running_mean"):
        import_checkpoint(tmp_path / "bn.pth", "timm", tmp_path / "a", ImportOptions(num_heads=4))
    renamed = {k.replace("backbone.stem.conv", "backbone.conv1"): v for k, v in reference.state_dict().items()}
    torch.save(renamed, tmp_path / "resnetd.pth")
    with pytest.raises(CheckpointImportError, match=r"not timm's ResNetV2 .*patch_embed\.backbone\.conv1\.weight"):
        import_checkpoint(tmp_path / "resnetd.pth", "timm", tmp_path / "b", ImportOptions(num_heads=4))
    gap = {k.replace("stages.1.blocks.1.", "stages.1.blocks.2."): v for k, v in reference.state_dict().items()}
    torch.save(gap, tmp_path / "gap.pth")
    with pytest.raises(CheckpointImportError, match=r"not numbered 0..N-1"):
        import_checkpoint(tmp_path / "gap.pth", "timm", tmp_path / "c", ImportOptions(num_heads=4))


def _timm_attention(model, x: torch.Tensor) -> list[np.ndarray]:
    """Each block's attention probabilities from timm's unfused attention (what its attn_drop receives)."""
    seen = []
    hooks = []
    for block in model.blocks:
        block.attn.fused_attn = False
        hooks.append(block.attn.attn_drop.register_forward_hook(lambda m, i, o: seen.append(o.detach().numpy())))
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return seen


@pytest.mark.slow
def test_exported_hybrid_gives_timms_logits_and_a_rollout_of_timms_attention(imported_hybrids, tmp_path):
    reference, checkpoint = imported_hybrids["slim_r26"]
    report = export_onnx(checkpoint, tmp_path / "hybrid.onnx")  # verified against PyTorch at several sizes
    assert len({(c.height, c.width) for c in report.verification.cases}) >= 3
    assert report.verification.tolerance_used <= 1
    session = ort.InferenceSession(str(tmp_path / "hybrid.onnx"), providers=["CPUExecutionProvider"])
    x = torch.randn(3, 3, 64, 96)  # not the trained 64x64: a 2x3 grid
    logits, rollout = session.run(["logits", "rollout"], {"pixel_values": x.numpy()})
    state = dict(reference.state_dict())
    state["pos_embed"] = resample_pos_embed(state["pos_embed"], (2, 2), (2, 3))
    at_size = _timm_slim_r26((64, 96))
    at_size.load_state_dict(state)
    with torch.no_grad():
        np.testing.assert_allclose(logits, at_size(x).numpy(), atol=TOL * 10, rtol=0)
    expected = numpy_attention_rollout(_timm_attention(at_size, x), (2, 3))
    assert rollout.shape == (3, 2, 3)
    np.testing.assert_allclose(rollout, expected, atol=1e-5, rtol=0)


@pytest.mark.slow
def test_inspecting_a_hybrid_shows_the_stem_filters_that_see_pixels(tmp_path):
    from vitserve.model.inspection import inspect
    from vitserve.model.inspection_report import write

    torch.manual_seed(0)
    model = VisionTransformer(vit_config("R+fmnist", depth=2, backbone_width=32)).eval()
    result = inspect(model, torch.randn(6, 1, 28, 28))
    assert result.components.shape[1:] == (1, 7, 7)  # the stem's filters, on the grey pixels
    assert len(result.components) == 28 and "stem convolution" in result.filters
    assert "1x1 convolution over the CNN's 32-channel feature map" in result.filters
    assert result.distances.shape == (2, 4) and result.grid == (7, 7)
    write(result, tmp_path, "hybrid")
    assert "7x7 hybrid's stem convolution filters" in (tmp_path / "REPORT.md").read_text()


def test_train_flags_make_a_hybrid_and_say_so(tmp_path):
    from vitserve.model.cli import command_line, train_config
    from vitserve.cli import build_parser

    args = build_parser().parse_args(["train", "--model", "R+fmnist", "--backbone-layers", "2,1",
                                      "--backbone-width", "32"])
    cfg = train_config(args)
    assert cfg.model_overrides == {"backbone_layers": (2, 1), "backbone_width": 32}
    assert "--backbone-layers 2,1 --backbone-width 32" in command_line(cfg)
    stem = train_config(build_parser().parse_args(["train", "--model", "R26+S/32", "--backbone-layers", "0"]))
    assert stem.model_overrides == {"backbone_layers": ()} and "--backbone-layers 0" in command_line(stem)


@pytest.mark.slow
def test_a_hybrid_exports_to_float16_and_passes_the_checker_and_its_comparison(imported_hybrids, tmp_path):
    # The hybrid's feature-map grid reaches the position-embedding Resize through the backbone; inside the relevance
    # `If` the ONNX checker could not follow it and refused the float16 file (export/fp16.py says why). The hybrid
    # the float32 test exports: tests/conftest.py's cache then traces it once for both.
    _, checkpoint = imported_hybrids["slim_r26"]
    report = export_onnx(checkpoint, tmp_path / "hybrid-fp16.onnx", precision="fp16", inspection_images=0)
    assert report.precision == "fp16" and report.fp16.top1_agreement >= 0.9
    assert report.fp16.logits_max_abs_diff <= report.fp16.logits_tolerance
    assert report.relevance is not None  # the relevance path, float32 inside the float16 file, verified too
