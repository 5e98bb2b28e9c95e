"""`python -m vitserve.bench.precision`: float32 against int8 files of the same model, raw ONNX Runtime on the server's
session options, batch 1 and 8, alternating rounds (this machine's speed drifts: only ratios within a round count).

    python -m vitserve.bench.precision --pair models/vit-fmnist/model.onnx,models/vit-fmnist/model-int8.onnx \\
                              --pair vit-s16,vit-s16-int8

Each pair: both files loaded, then `rounds` rounds in which each runs every batch size for `seconds` (the order
reversed every other round). Reported per batch size: each file's median ms per call, and the fp32/int8 speed-up
(the median of the per-round ratios, with the smallest and largest). The fast path: logits and rollout.
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import numpy as np

from vitserve.bench.measure import alternating_rounds_ms
from vitserve.bench.presets import resolve_model
from vitserve.service.engine.onnx_runtime import OnnxModel
from vitserve.service.ground.settings import Settings


def load(path: Path, threads: int) -> OnnxModel:
    return OnnxModel.load(Settings(model_path=path, providers=["cpu"], intra_op_threads=threads))


def compare(fp32: OnnxModel, int8: OnnxModel, batches: list[int], rounds: int, seconds: float) -> list[dict]:
    height, width = fp32.info.image_size
    rows = []
    for batch in batches:
        pixels = np.random.default_rng(0).standard_normal((batch, fp32.info.channels, height, width), np.float32)
        calls = {"fp32": lambda pixels=pixels: fp32.run(pixels), "int8": lambda pixels=pixels: int8.run(pixels)}
        alternating_rounds_ms(calls, 1, 0.2)  # warm-up
        times = alternating_rounds_ms(calls, rounds, seconds)
        ratios = [a / b for a, b in zip(times["fp32"], times["int8"])]
        rows.append({"batch": batch, "fp32_ms": statistics.median(times["fp32"]),
                     "int8_ms": statistics.median(times["int8"]), "speedup": statistics.median(ratios),
                     "speedup_range": [min(ratios), max(ratios)]})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.bench.precision", description=__doc__.split("\n\n")[0])
    p.add_argument("--pair", action="append", required=True, help="FP32,INT8: files or bench presets")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--seconds", type=float, default=1.0)
    p.add_argument("--threads", type=int, default=0, help="intra-op threads (0: one per core)")
    p.add_argument("--cache-dir", type=Path, default=Path("build/bench/models"))
    p.add_argument("--out", type=Path, default=Path("build/bench/precision.md"))
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    lines = ["# float32 against int8, raw ONNX Runtime", "",
             f"`python -m vitserve.bench.precision {' '.join('--pair ' + x for x in args.pair)} "
             f"--batches {args.batches} "
             f"--rounds {args.rounds} --seconds {args.seconds} --threads {args.threads}`", "",
             "| model | batch | fp32 ms | int8 ms | speed-up (per-round range) |", "|---|---|---|---|---|"]
    results = {}
    for pair in args.pair:
        names = pair.split(",")
        if len(names) != 2:
            raise SystemExit(f"--pair {pair}: two files or presets, comma-separated")
        fp32, int8 = (load(resolve_model(n, args.cache_dir), args.threads) for n in names)
        if (fp32.info.precision, int8.info.precision) != ("fp32", "int8"):
            raise SystemExit(f"--pair {pair}: the files are {fp32.info.precision} and {int8.info.precision}")
        rows = results[pair] = compare(fp32, int8, batches, args.rounds, args.seconds)
        for r in rows:
            lines.append(f"| {names[0]} | {r['batch']} | {r['fp32_ms']:.2f} | {r['int8_ms']:.2f} | "
                         f"{r['speedup']:.2f}x ({r['speedup_range'][0]:.2f}-{r['speedup_range'][1]:.2f}) |")
    text = "\n".join(lines) + "\n"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
