"""`vitserve import`: timm and Hugging Face ViTs converted into our checkpoint give the same logits.

References are the real implementations, built from configs with random weights (no downloads):
HF's ViTForImageClassification, and timm's VisionTransformer, imported without torchvision
(tests/model/timm_reference.py).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vitserve.model.checkpoint import load_checkpoint
from vitserve.model.convert import CheckpointImportError, ImportOptions, import_checkpoint, read_labels
from vitserve.model.vit import VisionTransformer, vit_config
from vitserve.cli import main

from timm_reference import timm_without_torchvision

TOL = 1e-4
TIMM_ARCH = dict(patch_size=8, embed_dim=32, depth=2, num_heads=4)


def _randomise(model: torch.nn.Module, std: float = 0.3) -> torch.nn.Module:
    # Fresh inits leave zero heads, unit norms and tiny logits; random everything makes a wrong
    # mapping visible far above the tolerance.
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, std)
    return model.eval()


@pytest.fixture(scope="module")
def timm_reference():
    """State dicts and logits from timm's own VisionTransformer: name -> (state_dict, input, logits)."""
    variants = {
        "plain": dict(img_size=32, in_chans=3, num_classes=3),
        "nonsquare_gray_nobias": dict(img_size=(32, 48), in_chans=1, num_classes=5, qkv_bias=False),
        "layer_scale": dict(img_size=32, num_classes=3, init_values=1e-5),
        "registers": dict(img_size=32, num_classes=3, reg_tokens=2),
        "avg_pool": dict(img_size=32, num_classes=3, global_pool="avg"),
        "no_class_token": dict(img_size=32, num_classes=3, class_token=False, global_pool="avg"),
    }
    out = {}
    with timm_without_torchvision() as vision_transformer:
        for name, kwargs in variants.items():
            torch.manual_seed(0)
            model = _randomise(vision_transformer.VisionTransformer(**TIMM_ARCH, **kwargs))
            size = kwargs["img_size"] if isinstance(kwargs["img_size"], tuple) else (kwargs["img_size"],) * 2
            x = torch.randn(2, kwargs.get("in_chans", 3), *size)
            with torch.no_grad():
                out[name] = (model.state_dict(), x, model(x))
    assert "timm" not in sys.modules and "torchvision" not in sys.modules
    return out


def _logits(directory: Path, x: torch.Tensor) -> torch.Tensor:
    model, _ = load_checkpoint(directory)
    with torch.no_grad():
        return model(x)


# ---------------------------------------------------------------------------------------------
# timm


@pytest.mark.parametrize("suffix", [".pth", ".safetensors"])
def test_timm_import_matches_timm_logits(timm_reference, tmp_path, suffix):
    state, x, expected = timm_reference["plain"]
    source = tmp_path / f"vit{suffix}"
    torch.save(state, source) if suffix == ".pth" else save_file(state, str(source))
    out, meta = import_checkpoint(source, "timm", tmp_path / "ckpt", ImportOptions(num_heads=4))
    assert expected.abs().max() > 0.1  # logits big enough that the tolerance means something
    torch.testing.assert_close(_logits(out, x), expected, atol=TOL, rtol=0)
    cfg = meta.config
    assert (cfg.image_size, cfg.patch_size, cfg.in_channels, cfg.num_classes) == ((32, 32), 8, 3, 3)
    assert (cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim, cfg.qkv_bias) == (32, 2, 4, 128, True)
    assert cfg.layer_norm_eps == 1e-6
    assert meta.labels == ["class_0", "class_1", "class_2"] and meta.name == "vit" and meta.version == "1"
    assert meta.mean == [0.5] * 3 and meta.std == [0.5] * 3


def test_timm_nonsquare_grid_needs_image_size(timm_reference, tmp_path):
    state, x, expected = timm_reference["nonsquare_gray_nobias"]  # 4x6 grid: 24 positions, not a square
    torch.save(state, tmp_path / "vit.pth")
    with pytest.raises(CheckpointImportError, match=r"24 patch positions.*--image-size"):
        import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "a", ImportOptions(num_heads=4))
    with pytest.raises(CheckpointImportError, match="does not give a grid of 24"):
        import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "b", ImportOptions(num_heads=4, image_size=(48, 48)))
    out, meta = import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "c",
                                  ImportOptions(num_heads=4, image_size=(32, 48), mean=[0.2], std=[0.3]))
    assert (meta.config.image_size, meta.config.in_channels, meta.config.qkv_bias) == ((32, 48), 1, False)
    assert (meta.mean, meta.std) == ([0.2], [0.3])
    torch.testing.assert_close(_logits(out, x), expected, atol=TOL, rtol=0)


def test_timm_head_fc_and_wrapped_ddp_checkpoint(timm_reference, tmp_path):
    state, x, expected = timm_reference["plain"]
    renamed = {k.replace("head.", "head.fc."): v for k, v in state.items()}  # ClassifierHead spelling
    wrapped = {"epoch": 3, "state_dict": {f"module.{k}": v for k, v in renamed.items()}}  # timm train.py + DDP
    torch.save(wrapped, tmp_path / "train.pth.tar")
    out, _ = import_checkpoint(tmp_path / "train.pth.tar", "timm", tmp_path / "ckpt", ImportOptions(num_heads=4))
    torch.testing.assert_close(_logits(out, x), expected, atol=TOL, rtol=0)


@pytest.mark.parametrize("variant, keys", [
    ("layer_scale", ["blocks.0.ls1.gamma", "blocks.0.ls2.gamma", "blocks.1.ls1.gamma"]),
    ("registers", ["reg_token"]),
    ("avg_pool", ["fc_norm.weight", "fc_norm.bias"]),
    ("no_class_token", ["cls_token (absent)"]),
])
def test_timm_unsupported_features_are_refused_by_key(timm_reference, tmp_path, variant, keys):
    state, _, _ = timm_reference[variant]
    torch.save(state, tmp_path / "vit.pth")
    with pytest.raises(CheckpointImportError, match="does not implement") as info:
        import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "ckpt", ImportOptions(num_heads=4))
    for key in keys:
        assert key in str(info.value)
    assert not (tmp_path / "ckpt").exists()


def test_added_layer_scale_and_distillation_keys_are_named(timm_reference, tmp_path):
    state, _, _ = timm_reference["plain"]
    state = {**state, "blocks.0.ls1.gamma": torch.ones(32), "dist_token": torch.zeros(1, 1, 32),
             "head_dist.weight": torch.zeros(3, 32)}
    torch.save(state, tmp_path / "vit.pth")
    with pytest.raises(CheckpointImportError) as info:
        import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "ckpt", ImportOptions(num_heads=4))
    message = str(info.value)
    assert "layer scale" in message and "blocks.0.ls1.gamma" in message
    assert "distillation" in message and "dist_token" in message and "head_dist.weight" in message


def test_unknown_key_and_wrong_shape_are_named(timm_reference, tmp_path):
    state, _, _ = timm_reference["plain"]
    torch.save({**state, "blocks.1.extra.weight": torch.ones(3)}, tmp_path / "extra.pth")
    with pytest.raises(CheckpointImportError, match=r"unrecognised keys.*blocks\.1\.extra\.weight"):
        import_checkpoint(tmp_path / "extra.pth", "timm", tmp_path / "a", ImportOptions(num_heads=4))
    torch.save({**state, "blocks.1.mlp.fc1.weight": torch.ones(64, 32)}, tmp_path / "shape.pth")
    with pytest.raises(CheckpointImportError, match=r"blocks\.1\.mlp\.fc1\.weight \(64, 32\) \(expected \(128, 32\)\)"):
        import_checkpoint(tmp_path / "shape.pth", "timm", tmp_path / "b", ImportOptions(num_heads=4))


def test_timm_without_num_heads_is_refused(timm_reference, tmp_path):
    torch.save(timm_reference["plain"][0], tmp_path / "vit.pth")
    with pytest.raises(CheckpointImportError, match="--num-heads"):
        import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "ckpt")


def test_pickled_objects_are_not_loaded(timm_reference, tmp_path):
    # timm's train.py saves its argparse Namespace beside the weights; weights_only refuses it.
    torch.save({"state_dict": timm_reference["plain"][0], "args": argparse.Namespace(lr=1)}, tmp_path / "t.pth")
    with pytest.raises(CheckpointImportError, match="weights_only=True"):
        import_checkpoint(tmp_path / "t.pth", "timm", tmp_path / "ckpt", ImportOptions(num_heads=4))


def test_pre_logits_layout_round_trips(tmp_path):
    # timm < 0.6 saved the paper's pre-training head as pre_logits.fc; timm 1.x cannot build it,
    # so the reference here is our own model, whose names are that layout's.
    torch.manual_seed(0)
    cfg = vit_config("tiny", image_size=(16, 16), patch_size=8, embed_dim=32, depth=1, num_heads=2,
                     mlp_dim=48, num_classes=4, representation_size=24)
    model = _randomise(VisionTransformer(cfg))
    torch.save(model.state_dict(), tmp_path / "vit.pth")
    out, meta = import_checkpoint(tmp_path / "vit.pth", "timm", tmp_path / "ckpt", ImportOptions(num_heads=2))
    assert meta.config == cfg
    x = torch.randn(2, 3, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(_logits(out, x), model(x), atol=1e-6, rtol=0)


# ---------------------------------------------------------------------------------------------
# Hugging Face


def _hf_model(layer_norm_eps: float = 1e-12, num_labels: int = 3):
    from transformers import ViTConfig, ViTForImageClassification

    torch.manual_seed(0)
    config = ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                       image_size=32, patch_size=8, num_channels=3, layer_norm_eps=layer_norm_eps,
                       id2label={i: f"thing{i}" for i in range(num_labels)})
    return _randomise(ViTForImageClassification(config))


def _hf_logits(model, x: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(pixel_values=x, **kwargs).logits


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("hf") / "vit-tiny-hf"
    model = _hf_model()
    model.save_pretrained(directory)
    return directory, model


def test_hf_import_matches_hf_logits(hf_checkpoint, tmp_path):
    directory, hf = hf_checkpoint
    out, meta = import_checkpoint(directory, "hf", tmp_path / "ckpt")
    x = torch.randn(2, 3, 32, 32)
    expected = _hf_logits(hf, x)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(_logits(out, x), expected, atol=TOL, rtol=0)
    cfg = meta.config
    assert (cfg.image_size, cfg.patch_size, cfg.embed_dim, cfg.depth, cfg.num_heads, cfg.mlp_dim) == \
        ((32, 32), 8, 32, 2, 4, 64)
    assert cfg.layer_norm_eps == 1e-12  # HF's default, kept rather than ours
    assert meta.labels == ["thing0", "thing1", "thing2"] and meta.name == "vit-tiny-hf"
    assert meta.mean == [0.5] * 3 and meta.training["source_format"] == "hf"


def test_hf_matches_interpolated_position_embeddings(hf_checkpoint, tmp_path):
    # HF resizes with the same bicubic, align_corners=False, no-antialias call as resample_pos_embed.
    directory, hf = hf_checkpoint
    out, _ = import_checkpoint(directory / "model.safetensors", "hf", tmp_path / "ckpt")  # the weights file works too
    x = torch.randn(1, 3, 48, 40)
    torch.testing.assert_close(_logits(out, x), _hf_logits(hf, x, interpolate_pos_encoding=True), atol=TOL, rtol=0)


def test_hf_layer_norm_eps_is_kept(tmp_path):
    hf = _hf_model(layer_norm_eps=0.5)  # large enough that using another epsilon changes the logits
    hf.save_pretrained(tmp_path / "hf")
    out, meta = import_checkpoint(tmp_path / "hf", "hf", tmp_path / "ckpt")
    assert meta.config.layer_norm_eps == 0.5
    x = torch.randn(2, 3, 32, 32)
    expected = _hf_logits(hf, x)
    torch.testing.assert_close(_logits(out, x), expected, atol=TOL, rtol=0)
    out_wrong, _ = import_checkpoint(tmp_path / "hf", "hf", tmp_path / "wrong", ImportOptions(layer_norm_eps=1e-6))
    assert (_logits(out_wrong, x) - expected).abs().max() > 10 * TOL  # so the test above can fail


def test_hf_in_memory_names_and_preprocessor_config(hf_checkpoint, tmp_path):
    # torch.save(model.state_dict()) in transformers 5 uses its in-memory names (q_proj, mlp.fc1, ...).
    directory, hf = hf_checkpoint
    source = tmp_path / "hf"
    source.mkdir()
    (source / "config.json").write_text((directory / "config.json").read_text())
    (source / "preprocessor_config.json").write_text(json.dumps({"image_mean": [0.485, 0.456, 0.406],
                                                                 "image_std": [0.229, 0.224, 0.225]}))
    torch.save(hf.state_dict(), source / "pytorch_model.bin")
    assert any(".q_proj." in k for k in hf.state_dict())
    out, meta = import_checkpoint(source, "hf", tmp_path / "ckpt", ImportOptions(name="mine", version="3"))
    x = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(_logits(out, x), _hf_logits(hf, x), atol=TOL, rtol=0)
    assert meta.mean == [0.485, 0.456, 0.406] and meta.std == [0.229, 0.224, 0.225]
    assert (meta.name, meta.version) == ("mine", "3")


def test_hf_refusals(hf_checkpoint, tmp_path):
    directory, hf = hf_checkpoint
    config = json.loads((directory / "config.json").read_text())
    with pytest.raises(CheckpointImportError, match="--num-heads 2 contradicts the source's 4"):
        import_checkpoint(directory, "hf", tmp_path / "a", ImportOptions(num_heads=2))
    source = tmp_path / "gelu_new"
    source.mkdir()
    (source / "config.json").write_text(json.dumps({**config, "hidden_act": "gelu_new"}))
    with pytest.raises(CheckpointImportError, match="hidden_act is 'gelu_new'"):
        import_checkpoint(source, "hf", tmp_path / "b")
    (source / "config.json").write_text(json.dumps(config))
    save_file({"vit.encoder.layer.0.attention.attention.query.weight": torch.ones(32, 32),
               "vit.encoder.layer.0.attention.attention.lambda_q": torch.ones(4)}, str(source / "model.safetensors"))
    with pytest.raises(CheckpointImportError, match=r"not part of a HF ViTForImageClassification: .*lambda_q"):
        import_checkpoint(source, "hf", tmp_path / "c")
    with pytest.raises(CheckpointImportError, match="Hugging Face ViT parameter names: use --format hf"):
        import_checkpoint(directory / "model.safetensors", "timm", tmp_path / "d", ImportOptions(num_heads=4))


# ---------------------------------------------------------------------------------------------
# Labels and the command line


def test_read_labels_lines_and_json(tmp_path):
    (tmp_path / "labels.txt").write_text("cat\n\ndog \nbird\n")
    (tmp_path / "labels.json").write_text('["T-shirt/top", "Trouser"]')
    assert read_labels(tmp_path / "labels.txt") == ["cat", "dog", "bird"]
    assert read_labels(tmp_path / "labels.json") == ["T-shirt/top", "Trouser"]


def test_cli_import_end_to_end(timm_reference, tmp_path, capsys):
    state, x, expected = timm_reference["plain"]
    torch.save(state, tmp_path / "vit.pth")
    (tmp_path / "labels.txt").write_text("cat\ndog\nbird\n")
    out = tmp_path / "ckpt"
    rc = main(["import", str(tmp_path / "vit.pth"), "--format", "timm", "--out", str(out), "--num-heads", "4",
               "--labels", str(tmp_path / "labels.txt"), "--mean", "0.1", "0.2", "0.3", "--std", "0.4",
               "--name", "vit-tiny-timm", "--version", "2"])
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["checkpoint"] == str(out)
    model, meta = load_checkpoint(out)
    assert meta.labels == ["cat", "dog", "bird"] and (meta.name, meta.version) == ("vit-tiny-timm", "2")
    assert meta.mean == [0.1, 0.2, 0.3] and meta.std == [0.4] * 3
    with torch.no_grad():
        torch.testing.assert_close(model(x), expected, atol=TOL, rtol=0)


def test_cli_refusals_are_one_clean_line(timm_reference, tmp_path, capsys):
    state, _, _ = timm_reference["plain"]
    torch.save(state, tmp_path / "vit.pth")
    base = ["import", str(tmp_path / "vit.pth"), "--format", "timm", "--out", str(tmp_path / "ckpt")]
    assert main(base) == 1
    err = capsys.readouterr().err
    assert err.startswith("vitserve import: error: ") and "--num-heads" in err and "Traceback" not in err
    (tmp_path / "labels.txt").write_text("cat\ndog\n")
    assert main(base + ["--num-heads", "4", "--labels", str(tmp_path / "labels.txt")]) == 1
    assert "--labels gives 2 labels; the classifier has 3 classes" in capsys.readouterr().err
    torch.save({**state, "blocks.0.ls1.gamma": torch.ones(32)}, tmp_path / "vit.pth")
    assert main(base + ["--num-heads", "4"]) == 1
    assert "blocks.0.ls1.gamma" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()
