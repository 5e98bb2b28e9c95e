"""Data-parallel training with two CPU processes under torchrun (gloo)."""
from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from vitserve.model.checkpoint import load_checkpoint

pytestmark = pytest.mark.slow  # two training processes

# Each rank trains on synthetic data made in the script (the same on every rank), captures its own model,
# and saves that model's weights after training, so the test can compare the two ranks' final weights.
# 23 training images with 4 per rank per step: the ranks' shards hold 12 and 11 images, so a per-rank step
# count would give rank 0 three steps and rank 1 two, and the collectives would no longer pair up.
SCRIPT = textwrap.dedent('''
    import os, sys
    import torch
    import vitserve.model.train as train_module
    from vitserve.model.augment import AugmentConfig
    from vitserve.model.data import DataSplits, ImageDataset

    def synthetic(n, seed):
        g = torch.Generator().manual_seed(seed)
        labels = torch.arange(n) % 2
        images = torch.randint(0, 60, (n, 1, 16, 16), generator=g).to(torch.uint8)
        images[labels == 0, :, :8] += 150  # class 0: bright top half; class 1: bright bottom half
        images[labels == 1, :, 8:] += 150
        return ImageDataset(images, labels, ["top", "bottom"])

    train_module.load_data = lambda cfg, size: DataSplits(synthetic(23, 0), synthetic(9, 1), [0.3], [0.3])
    built = {}
    build_model = train_module.build_model

    def capture(cfg, splits):
        model, meta = build_model(cfg, splits)
        built["model"], built["initial"] = model, {k: v.clone() for k, v in model.state_dict().items()}
        return model, meta

    train_module.build_model = capture
    out = sys.argv[1]
    cfg = train_module.TrainConfig(
        data="synthetic", model="tiny", epochs=2, batch_size=8, warmup_epochs=0.5, out_dir=out, progress=False,
        model_overrides=dict(patch_size=4, embed_dim=16, depth=1, num_heads=2, mlp_dim=32),
        augment=AugmentConfig(crop="pad", erasing_prob=0.25))
    row = train_module.train(cfg)
    torch.save({"final": built["model"].state_dict(), "initial": built["initial"], "row": row},
               os.path.join(out, f"rank{os.environ['RANK']}.pt"))
''')


def test_two_process_ddp_training(tmp_path):
    script = tmp_path / "ddp_train.py"
    script.write_text(SCRIPT)
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(script), str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)  # ~20 s alone; more beside other jobs
    assert proc.returncode == 0, proc.stderr[-3000:]

    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in (0, 1)]
    # Different seeds per rank made different initial models; DDP broadcast rank 0's and kept them in step.
    assert not torch.equal(ranks[0]["initial"]["pos_embed"], ranks[1]["initial"]["pos_embed"])
    for name, value in ranks[0]["final"].items():
        assert torch.equal(value, ranks[1]["final"][name]), name
        assert torch.equal(value, load_file(str(out / "checkpoint" / "model.safetensors"))[name]), name
    assert not torch.equal(ranks[0]["final"]["head.weight"], ranks[0]["initial"]["head.weight"])

    # Both ranks report the same all-reduced metrics; 23 // 2 // 4 = 2 steps per epoch on each rank.
    for key in ("epoch", "step", "train_loss", "train_acc", "test_loss", "test_acc"):
        assert ranks[0]["row"][key] == ranks[1]["row"][key], key
    assert (ranks[0]["row"]["epoch"], ranks[0]["row"]["step"]) == (2, 4)

    model, meta = load_checkpoint(out / "checkpoint")
    assert meta.labels == ["top", "bottom"] and meta.metrics["epoch"] == 2
    assert "2 process(es)" in meta.training["machine"]
    assert meta.metrics["test_accuracy"] == ranks[0]["row"]["test_acc"]
    with open(out / "log.csv") as f:
        assert [int(float(r["step"])) for r in csv.DictReader(f)] == [2, 4]
    assert json.loads((out / "checkpoint" / "config.json").read_text())["training"]["epochs_done"] == 2
    assert not (out / "rank1").exists() and sorted(p.name for p in out.iterdir()) == [
        "checkpoint", "curves.png", "log.csv", "rank0.pt", "rank1.pt", "steps.csv", "train_state.pt"]
