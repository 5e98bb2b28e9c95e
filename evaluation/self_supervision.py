"""`python -m vitserve.evaluation.self_supervision`: does masked-patch pre-training help when labels are few?

Fashion-MNIST, the default model's architecture. One pre-training run on all training images without their
labels (`vitserve train --pretrain masked-patch`), then for each seed two fine-tunes on the same `--label-fraction`
of the labels (the seed picks the share and the initialisation): one from the pre-trained checkpoint
(`--init-from`), one from scratch, with the same schedule. Reported: each run's accuracy on the 10,000 test
images after its last epoch, and the mean difference. Runs go to --out (build/self-supervision); a finished run
is not run again (each one is resumable: --resume), so an interrupted experiment continues where it stopped.

    python -m vitserve.evaluation.self_supervision --seeds 0 1 2 --report docs/self-supervision.md
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import subprocess
import sys
from pathlib import Path


def run_train(out: Path, flags: list[str]) -> dict:
    """`vitserve train` into `out` (resumed if it was interrupted); its last evaluated row."""
    log = out / "log.csv"
    subprocess.run([sys.executable, "-m", "vitserve.cli", "train", "--out", str(out), "--resume", "--no-progress",
                    *flags], check=True)
    with open(log) as f:
        rows = list(csv.DictReader(f))
    return {k: float(v) for k, v in rows[-1].items()}


def measure(args) -> dict:
    pre = args.out / "pretrain"
    pretrained = run_train(pre, ["--pretrain", "masked-patch", "--epochs", str(args.pretrain_epochs),
                                 "--seed", "0"])
    runs = []
    for seed in args.seeds:
        common = ["--label-fraction", str(args.label_fraction), "--epochs", str(args.finetune_epochs),
                  "--seed", str(seed)]
        scratch = run_train(args.out / f"scratch-seed{seed}", common)
        fine = run_train(args.out / f"pretrained-seed{seed}", [*common, "--init-from", str(pre / "checkpoint")])
        runs.append({"seed": seed, "scratch": scratch["test_acc"], "pretrained": fine["test_acc"],
                     "scratch_s": scratch["elapsed_s"], "pretrained_s": fine["elapsed_s"]})
    gains = [r["pretrained"] - r["scratch"] for r in runs]
    return {"label_fraction": args.label_fraction, "pretrain_epochs": args.pretrain_epochs,
            "finetune_epochs": args.finetune_epochs, "pretrain_masked_patch_accuracy": pretrained["test_acc"],
            "pretrain_s": pretrained["elapsed_s"], "runs": runs, "mean_gain": statistics.mean(gains)}


def markdown(result: dict) -> str:
    lines = ["| seed | from scratch | from masked-patch pre-training | difference |", "|---|---|---|---|"]
    for r in result["runs"]:
        lines.append(f"| {r['seed']} | {100 * r['scratch']:.2f}% | {100 * r['pretrained']:.2f}% | "
                     f"{100 * (r['pretrained'] - r['scratch']):+.2f} points |")
    lines.append(f"| mean | {100 * statistics.mean(r['scratch'] for r in result['runs']):.2f}% | "
                 f"{100 * statistics.mean(r['pretrained'] for r in result['runs']):.2f}% | "
                 f"{100 * result['mean_gain']:+.2f} points |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vitserve.evaluation.self_supervision",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--label-fraction", type=float, default=0.1)
    p.add_argument("--pretrain-epochs", type=int, default=4)
    p.add_argument("--finetune-epochs", type=int, default=15)
    p.add_argument("--out", type=Path, default=Path("build/self-supervision"))
    p.add_argument("--report", type=Path, help="also write the table (markdown) and the numbers (.json) here")
    args = p.parse_args(argv)
    result = measure(args)
    table = markdown(result)
    print(table)
    if args.report:
        args.report.write_text(table + "\n")
        args.report.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
