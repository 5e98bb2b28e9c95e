"""`python -m vitserve.bench.fast_path_choice default vit-s16`: does a request that wants no map gain from a graph that
computes none?

For each model (`default`: the bundled checkpoint; or a random-weight preset of export/presets.py), the same
weights as five graphs, each run on ONNX Runtime's CPU provider with its default (all) graph optimizations:
- `rollout (today)`: the artifact's fast path, logits and rollout;
- `logits only`: the encoder and head alone (no attention probabilities kept for the rollout);
- `logits only, fused`: the same after ONNX Runtime's transformer optimizer (`model_type="vit"`: SkipLayerNorm,
  BiasGelu, Attention where its pattern matches);
- `int8 rollout` and `int8 logits only`: the first two through export/int8.py.
Batch 1 and 8 at the trained size, 7 alternating rounds; the median ms per call and its speed-up over today's.
Measured here: none of the maps-free graphs is faster (docs/int8.md), so the server has no separate branch.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
from torch import nn

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES
from vitserve.bench.measure import alternating_rounds_ms
from vitserve.export.int8 import quantize_int8
from vitserve.export.onnx_export import ViTWithRollout, example_input, to_onnx
from vitserve.export.verify import cpu_session


class LogitsOnly(nn.Module):
    def __init__(self, vit):
        super().__init__()
        self.vit = vit

    def forward(self, pixel_values):
        return self.vit(pixel_values)


def graphs(vit) -> dict[str, tuple[onnx.ModelProto, list[str]]]:
    from onnxruntime.transformers.optimizer import optimize_model

    cfg, example = vit.cfg, example_input(vit)
    full = to_onnx(ViTWithRollout(vit), cfg.patch_size, example, OUTPUT_NAMES)
    logits = to_onnx(LogitsOnly(vit), cfg.patch_size, example, ("logits",))
    with tempfile.TemporaryDirectory() as directory:  # the optimizer reads a file (it keeps external data apart)
        path = Path(directory) / "logits.onnx"
        onnx.save(logits, str(path))
        fused = optimize_model(str(path), model_type="vit", num_heads=cfg.num_heads, hidden_size=cfg.embed_dim,
                               opt_level=0).model
    calibration = example.numpy()  # a research comparison of speed: any images calibrate it
    return {"rollout (today)": (full, list(OUTPUT_NAMES)), "logits only": (logits, ["logits"]),
            "logits only, fused": (fused, ["logits"]),
            "int8 rollout": (quantize_int8(full, calibration), list(OUTPUT_NAMES)),
            "int8 logits only": (quantize_int8(logits, calibration), ["logits"])}


def compare(vit, batches=(1, 8), rounds: int = 7, seconds: float = 0.7) -> dict:
    cfg = vit.cfg
    sessions = {name: (cpu_session(proto), outputs) for name, (proto, outputs) in graphs(vit).items()}
    results = {}
    for batch in batches:
        x = np.random.default_rng(0).standard_normal((batch, cfg.in_channels, *cfg.image_size)).astype(np.float32)
        reference = sessions["rollout (today)"][0].run(["logits"], {INPUT_NAME: x})[0]
        for name, (session, _) in sessions.items():  # the float32 graphs compute the same logits
            logits = session.run(["logits"], {INPUT_NAME: x})[0]
            if "int8" not in name and np.abs(logits - reference).max() > 1e-3 * max(1.0, np.abs(reference).max()):
                raise AssertionError(f"{name} computes other logits than the artifact's fast path")
        times = alternating_rounds_ms({name: lambda s=session, o=outputs, x=x: s.run(o, {INPUT_NAME: x})
                                       for name, (session, outputs) in sessions.items()}, rounds, seconds)
        base = float(np.median(times["rollout (today)"]))
        results[batch] = {name: {"ms": float(np.median(t)), "speedup": base / float(np.median(t))}
                          for name, t in times.items()}
    return results


def main(argv: list[str] | None = None) -> int:
    from vitserve.export.presets import PRESETS, random_checkpoint
    from vitserve.model.checkpoint import load_checkpoint

    for name in (argv if argv is not None else sys.argv[1:]) or ["default"]:
        with tempfile.TemporaryDirectory() as directory:
            checkpoint = "models/vit-fmnist/checkpoint" if name == "default" else \
                random_checkpoint(PRESETS[name], Path(directory) / "checkpoint")
            vit, _ = load_checkpoint(checkpoint)
            for batch, row in compare(vit).items():
                print(f"| {name} | {batch} | " + " | ".join(f"{r['ms']:.2f} ms ({r['speedup']:.2f}x)"
                                                            for r in row.values()) + " |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
