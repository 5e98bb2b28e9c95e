"""Checkpoints: save/load round trip, config.json contents, and the errors a bad directory gives."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from vitserve.model.checkpoint import (CheckpointError, CheckpointMeta, load_checkpoint, load_meta, save_checkpoint,
                              strict_json, weights_sha256)
from vitserve.model.vit import VisionTransformer, vit_config
from training_fixtures import read_strict_json

TINY_LABELS = ["cat", "dog", "bird"]  # as in tests/conftest.py's tiny_checkpoint
REPO = Path(__file__).resolve().parents[2]

# Logits of two committed checkpoints for torch.randn(2, 1, 28, 28) drawn from a generator seeded 0, as
# model/vit.py gave them before its embed layer became an argument: a plain ViT and a hybrid.
COMMITTED_LOGITS = {
    "models/vit-fmnist/checkpoint": [
        [-0.104454935, -1.6472564, 1.0139041, -1.1675293, -0.44392812,
         -1.2944518, 1.7634616, -1.4841595, -0.52135724, -1.4593203],
        [-0.53747845, -1.4858551, 0.5257212, -0.7503639, -0.45583045,
         -0.68759257, 1.3976163, -1.0842936, -0.34524378, -1.1535599]],
    "training/vit-fmnist-hybrid/checkpoint": [
        [-0.8113165, -0.5096254, -1.0387199, -0.71184736, 0.5708942,
         1.8593174, -0.05954279, -0.34321523, 3.2856896, 0.4059015],
        [-1.3085309, -0.8759199, 0.84466046, -0.51017326, -0.53071994,
         1.4236685, 1.3977089, -1.3505898, -0.47907057, -0.69976974]],
}


def test_round_trip_gives_identical_logits(tiny_checkpoint, tmp_path):
    model, meta = load_checkpoint(tiny_checkpoint)
    assert not model.training
    x = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        logits = model(x)
    assert logits.shape == (4, 3) and not torch.allclose(logits[0], logits[1])
    again, meta_again = load_checkpoint(save_checkpoint(tmp_path / "copy", model, meta))
    with torch.no_grad():
        assert torch.equal(again(x), logits)
        assert again(torch.randn(1, 3, 48, 16)).shape == (1, 3)  # another grid: resampled, still 3 logits
    assert meta_again.to_dict() == meta.to_dict()
    assert weights_sha256(again.state_dict()) == weights_sha256(model.state_dict())


@pytest.mark.parametrize("directory", sorted(COMMITTED_LOGITS))
def test_committed_checkpoints_still_give_their_logits(directory):
    model, meta = load_checkpoint(REPO / directory)
    x = torch.randn(2, 1, *meta.config.image_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(x)
    # Bit for bit with one intra-op thread (tests/conftest.py) on the CPU that wrote them; other thread counts and
    # CPUs split the convolutions' sums differently and may round the last bits otherwise
    torch.testing.assert_close(logits, torch.tensor(COMMITTED_LOGITS[directory]), rtol=0, atol=1e-5)


def test_saved_files_follow_the_umask_like_any_other_file(tiny_checkpoint, tmp_path):
    """safetensors writes 0600; a checkpoint is shared and copied like the config beside it."""
    import os
    model, meta = load_checkpoint(tiny_checkpoint)
    previous = os.umask(0o022)
    try:
        saved = save_checkpoint(tmp_path / "shared", model, meta)
    finally:
        os.umask(previous)
    assert {p.name: p.stat().st_mode & 0o777 for p in saved.iterdir()} == {"model.safetensors": 0o644,
                                                                            "config.json": 0o644}


def test_round_trip_of_a_fresh_model(tmp_path):
    torch.manual_seed(3)
    cfg = vit_config("fmnist", depth=1, embed_dim=16, num_heads=2, mlp_dim=32, representation_size=8, num_classes=4)
    model = VisionTransformer(cfg).eval()
    with torch.no_grad():
        model.head.weight.normal_()
    meta = CheckpointMeta(cfg, ["a", "b", "c", "d"], [0.3], [0.4], name="n", version="2",
                          metrics={"test_accuracy": 0.75}, training={"epochs": 1})
    loaded, loaded_meta = load_checkpoint(save_checkpoint(tmp_path / "ckpt", model, meta))
    assert loaded.cfg == cfg and loaded_meta.config == cfg
    x = torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        assert torch.equal(loaded(x), model(x))
    for name, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], value), name


def test_config_json_layout(tiny_checkpoint):
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["format"] == "vitserve-checkpoint" and config["format_version"] == 1
    assert (config["name"], config["version"]) == ("tiny-vit", "7")
    assert config["labels"] == TINY_LABELS
    assert config["normalization"] == {"mean": [0.5, 0.5, 0.5], "std": [0.25, 0.25, 0.25]}
    assert config["metrics"] == {"test_accuracy": 0.5} and config["training"] == {}
    assert config["architecture"] == {
        "image_size": [32, 32], "patch_size": 8, "in_channels": 3, "num_classes": 3, "embed_dim": 32,
        "depth": 2, "num_heads": 2, "mlp_dim": 64, "qkv_bias": True, "layer_norm_eps": 1e-6,
        "representation_size": None, "dropout": 0.0, "attention_dropout": 0.0}
    assert load_meta(tiny_checkpoint).config.grid_size == (4, 4)


def test_weight_names_follow_timm(tiny_checkpoint):
    names = set(load_file(str(tiny_checkpoint / "model.safetensors")))
    expected = {"cls_token", "pos_embed", "patch_embed.proj.weight", "patch_embed.proj.bias", "norm.weight",
                "norm.bias", "head.weight", "head.bias"}
    for i in range(2):
        for layer in ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2"):
            expected |= {f"blocks.{i}.{layer}.weight", f"blocks.{i}.{layer}.bias"}
    assert names == expected


def test_weights_sha256_depends_on_values_not_order(tiny_checkpoint):
    state = load_file(str(tiny_checkpoint / "model.safetensors"))
    digest = weights_sha256(state)
    assert len(digest) == 64 and digest == weights_sha256(dict(reversed(list(state.items()))))
    changed = dict(state)
    changed["head.bias"] = state["head.bias"] + 1e-3
    assert weights_sha256(changed) != digest


def copy_of(tiny_checkpoint, tmp_path):
    return shutil.copytree(tiny_checkpoint, tmp_path / "ckpt")


def test_missing_directory_or_files(tiny_checkpoint, tmp_path):
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="config.json not found"):
        load_checkpoint(tmp_path / "empty")
    directory = copy_of(tiny_checkpoint, tmp_path)
    (directory / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors not found"):
        load_checkpoint(directory)


def test_wrong_format(tiny_checkpoint, tmp_path):
    directory = copy_of(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "format": "something-else"}))
    with pytest.raises(CheckpointError, match="not a vitserve-checkpoint config"):
        load_checkpoint(directory)


def test_labels_and_normalisation_must_fit_the_architecture():
    cfg = vit_config("fmnist")
    with pytest.raises(CheckpointError, match="3 labels for 10 classes"):
        CheckpointMeta(cfg, ["a", "b", "c"], [0.5], [0.5])
    with pytest.raises(CheckpointError, match="mean/std need 1 values"):
        CheckpointMeta(cfg, list("abcdefghij"), [0.5, 0.5, 0.5], [0.5, 0.5, 0.5])


def test_weights_that_do_not_match_the_config(tiny_checkpoint, tmp_path):
    directory = copy_of(tiny_checkpoint, tmp_path)
    state = load_file(str(directory / "model.safetensors"))
    save_file({k: v for k, v in state.items() if not k.startswith("blocks.1.")}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="weights do not match config: missing .*blocks.1.attn.qkv.weight"):
        load_checkpoint(directory)
    save_file({**state, "fc_norm.weight": torch.ones(32)}, str(directory / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected .*fc_norm.weight"):
        load_checkpoint(directory)


def test_weights_of_the_wrong_shape(tiny_checkpoint, tmp_path):
    directory = copy_of(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architecture"]["image_size"] = [64, 64]  # a grid the stored position embeddings were not made for
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="pos_embed"):
        load_checkpoint(directory)


def test_invalid_architecture_or_json(tiny_checkpoint, tmp_path):
    directory = copy_of(tiny_checkpoint, tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["architecture"]["num_heads"] = 5
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="not divisible by num_heads"):
        load_checkpoint(directory)
    (directory / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="config.json"):
        load_checkpoint(directory)


def test_config_json_is_strict_json(tiny_checkpoint, tmp_path):
    """A NaN or an infinity (an accuracy over an empty split) is written as null: Python's bare NaN is not JSON."""
    model, meta = load_checkpoint(tiny_checkpoint)
    meta.metrics = {"test_accuracy": float("nan"), "test_loss": float("inf"), "epoch": 1}
    meta.training = {"losses": [1.5, float("-inf")], "nested": {"x": (float("nan"), 2)}}
    save_checkpoint(tmp_path / "ckpt", model, meta)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["config.json", "model.safetensors"]
    saved = read_strict_json(tmp_path / "ckpt" / "config.json")
    assert saved["metrics"] == {"test_accuracy": None, "test_loss": None, "epoch": 1}
    assert saved["training"] == {"losses": [1.5, None], "nested": {"x": [None, 2]}}
    assert load_meta(tmp_path / "ckpt").metrics["test_accuracy"] is None
    assert strict_json({"a": [float("nan"), 0.5, "NaN", 3]}) == {"a": [None, 0.5, "NaN", 3]}
