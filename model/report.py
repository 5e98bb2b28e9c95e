"""A short Markdown training report from a run directory (checkpoint/config.json + log.csv).

`python -m vitserve.model.report RUN_DIR [--out REPORT.md]`; `make model` writes the default model's report.
"""
from __future__ import annotations

import argparse
import csv
import statistics
from pathlib import Path

from vitserve.model.checkpoint import load_meta


def read_log(run_dir: Path) -> list[dict]:
    with (run_dir / "log.csv").open() as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


def render_report(run_dir: Path) -> str:
    meta = load_meta(run_dir / "checkpoint")
    training, rows = meta.training, read_log(run_dir)
    last = rows[-1]
    done, planned = int(last["epoch"]), int(training.get("epochs", last["epoch"]))
    hours, rest = divmod(int(last["elapsed_s"]), 3600)
    status = ("finished" if done >= planned
              else f"in progress: {done} of {planned} epochs (resume with the same command)")
    lines = [
        f"# Training report: {meta.name} v{meta.version}", "",
        f"- **Test accuracy: {100 * last['test_acc']:.2f}%** on the {_test_size(meta)} held-out test images "
        f"(last epoch, no checkpoint selection on the test set); test loss {last['test_loss']:.4f}",
        f"- Status: {status}",
        f"- Epochs: {done}; {int(last['step'])} optimiser steps of batch {training.get('batch_size')}",
        f"- Wall time: {hours} h {rest // 60:02d} min (training and per-epoch evaluation)",
        f"- Throughput: median {statistics.median(r['images_per_s'] for r in rows):.0f} training images/s "
        f"(range {min(r['images_per_s'] for r in rows):.0f}-{max(r['images_per_s'] for r in rows):.0f})",
        # The machine the times above were measured on, as the run recorded it, never the one writing the report
        f"- Machine: {training.get('machine', '?')}; {training.get('cpu', 'CPU not recorded')}; "
        f"torch {training.get('torch', '?')}",
        f"- Model: {training.get('parameters', 0):,} parameters, `{meta.config.to_dict()}`",
        f"- Command: `{_command(training)}`", "",
        "| epoch | lr | train loss | train acc (augmented) | test loss | test acc | images/s |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if int(r["epoch"]) % 5 == 0 or r is rows[0] or r is last:
            lines.append(f"| {int(r['epoch'])} | {r['lr']:.2e} | {r['train_loss']:.4f} | {100 * r['train_acc']:.2f}% | "
                         f"{r['test_loss']:.4f} | {100 * r['test_acc']:.2f}% | {r['images_per_s']:.0f} |")
    lines += ["", "![training curves](curves.png)", ""]
    return "\n".join(lines)


def _test_size(meta) -> str:
    return "10,000 Fashion-MNIST" if meta.training.get("data") == "fashion-mnist" else "validation"


def _command(training: dict) -> str:
    command = training.get("command", "")
    return "vitserve " + command.split("vitserve ", 1)[1] if "vitserve " in command else command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, help="default: RUN_DIR/REPORT.md")
    args = parser.parse_args(argv)
    out = args.out or args.run_dir / "REPORT.md"
    out.write_text(render_report(args.run_dir))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
