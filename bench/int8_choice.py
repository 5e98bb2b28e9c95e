"""`python -m vitserve.bench.int8_choice CHECKPOINT --eval DIR`: which int8 quantization to ship, measured.

Candidates from the same float32 graph (the fast path: logits and rollout), against it, on a labelled set:
- `static QDQ (shipped)`: export/int8.py's quantize_int8, weights and activations int8 per channel, activation
  scales calibrated on `--calibration-images` images of the set (the first ones; the accuracy is measured on all);
- `dynamic`: ONNX Runtime's quantize_dynamic (every Linear layer's weights int8 per channel, activations quantized
  per call from the batch's own range), which makes an image's answer depend on its batch-mates;
- `dynamic, head float`: the same with the classifier head kept in float32.
For each: accuracy, top-1 agreement with float32, the rollout's Spearman correlation with float32's (mean and
min over 200 images), **batch invariance** (the first `--invariance-images` images run alone and in batches of 16
with random neighbours: the largest logit difference and how many change their top-1), and ms per call at batch 1
and 8 (alternating rounds, the median).
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import onnx

from vitserve.artifact import INPUT_NAME, OUTPUT_NAMES, normalize_pixels
from vitserve.bench.measure import alternating_rounds_ms
from vitserve.export.accuracy_gate import EvalSetError, load_labelled_set, spearman
from vitserve.export.int8 import LINEAR_OP_TYPES, linear_nodes, quantize_int8
from vitserve.export.verify import cpu_session


def dynamic_int8(fp32: onnx.ModelProto, keep_float: list[str] | tuple[str, ...] = ()) -> onnx.ModelProto:
    """ONNX Runtime's dynamic quantization of the Linear layers (per-channel int8 weights, activations per call)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    nodes = [name for name in linear_nodes(fp32) if name not in set(keep_float)]
    with tempfile.TemporaryDirectory() as directory:
        out = Path(directory) / "dynamic.onnx"
        quantize_dynamic(fp32, out, op_types_to_quantize=LINEAR_OP_TYPES, nodes_to_quantize=nodes, per_channel=True,
                         weight_type=QuantType.QInt8, extra_options={"MatMulConstBOnly": True})
        return onnx.load(str(out))


def batch_invariance(session, pixels: np.ndarray, batch: int = 16, seed: int = 0) -> dict:
    """Each image alone, then inside a batch of `batch` with random neighbours from `pixels`: the largest logit
    difference and the number whose top-1 class changes."""
    rng = np.random.default_rng(seed)
    alone = np.concatenate([session.run(["logits"], {INPUT_NAME: pixels[i:i + 1]})[0] for i in range(len(pixels))])
    mixed = np.empty_like(alone)
    for i in range(len(pixels)):
        neighbours = rng.choice(len(pixels), batch - 1)
        position = int(rng.integers(batch))
        order = np.insert(neighbours, position, i)
        mixed[i] = session.run(["logits"], {INPUT_NAME: pixels[order]})[0][position]
    return {"max_logit_diff": float(np.abs(alone - mixed).max()),
            "top1_changes": int((alone.argmax(1) != mixed.argmax(1)).sum()), "images": len(pixels)}


def compare(checkpoint: str, eval_dir: str, calibration_images: int, rounds: int,
            invariance_images: int = 2000) -> dict:
    from vitserve.export.onnx_export import ViTWithRollout, example_input, to_onnx
    from vitserve.model.checkpoint import load_checkpoint

    vit, meta = load_checkpoint(checkpoint)
    cfg = vit.cfg
    labelled = load_labelled_set(eval_dir, list(meta.labels), cfg.in_channels, cfg.image_size)
    pixels = normalize_pixels(labelled.images, meta.mean, meta.std, channel_axis=1)
    fp32 = to_onnx(ViTWithRollout(vit), cfg.patch_size, example_input(vit), OUTPUT_NAMES)
    candidates = {"fp32": fp32, "static QDQ (shipped)": quantize_int8(fp32, pixels[:calibration_images]),
                  "dynamic": dynamic_int8(fp32), "dynamic, head float": dynamic_int8(fp32, [linear_nodes(fp32)[-1]])}
    sessions = {name: cpu_session(proto) for name, proto in candidates.items()}
    outputs = {}
    for name, session in sessions.items():
        runs = [session.run(list(OUTPUT_NAMES), {INPUT_NAME: pixels[i:i + 500]}) for i in range(0, len(pixels), 500)]
        outputs[name] = tuple(np.concatenate([r[k] for r in runs]) for k in (0, 1))
    ref_logits, ref_rollout = outputs["fp32"]
    sample = slice(0, len(pixels), max(1, len(pixels) // 200))
    results: dict[str, dict[str, Any]] = {}
    for name, (logits, rollout) in outputs.items():
        rho = spearman(rollout[sample], ref_rollout[sample])
        results[name] = {"accuracy": float((logits.argmax(1) == labelled.labels).mean()),
                         "top1_agreement": float((logits.argmax(1) == ref_logits.argmax(1)).mean()),
                         "rollout_spearman_mean": float(rho.mean()), "rollout_spearman_min": float(rho.min())}
        results[name]["invariance"] = batch_invariance(sessions[name], pixels[:invariance_images])
    for batch in (1, 8):
        x = pixels[:batch]
        times = alternating_rounds_ms({name: lambda s=session, x=x: s.run(list(OUTPUT_NAMES), {INPUT_NAME: x})
                                       for name, session in sessions.items()}, rounds, 0.5)
        for name in sessions:
            results[name][f"batch{batch}_ms"] = float(np.median(times[name]))
    return {"checkpoint": checkpoint, "eval": labelled.source, "images": len(pixels),
            "calibration_images": calibration_images, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.int8_choice", description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--eval", required=True, dest="eval_dir")
    p.add_argument("--calibration-images", type=int, default=512)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--invariance-images", type=int, default=2000)
    args = p.parse_args(argv)
    try:
        report = compare(args.checkpoint, args.eval_dir, args.calibration_images, args.rounds, args.invariance_images)
    except EvalSetError as e:
        p.exit(2, f"{p.prog}: {e}\n")
    print("| quantization | accuracy | top-1 agreement | rollout Spearman mean (min) | alone vs batched: max logit "
          "diff, top-1 changes | batch 1 ms | batch 8 ms |")
    print("|---|---|---|---|---|---|---|")
    for name, r in report["results"].items():
        inv = r["invariance"]
        print(f"| {name} | {100 * r['accuracy']:.2f}% | {100 * r['top1_agreement']:.2f}% | "
              f"{r['rollout_spearman_mean']:.4f} ({r['rollout_spearman_min']:.4f}) | {inv['max_logit_diff']:.3g}, "
              f"{inv['top1_changes']} of {inv['images']} | {r['batch1_ms']:.2f} | {r['batch8_ms']:.2f} |")
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
