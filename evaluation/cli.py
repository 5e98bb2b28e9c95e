"""`vitserve evaluate accuracy` and `explanations`: argument parsing only; torch loads when a command runs.
vitserve/cli.py gathers them with the benchmarks' `evaluate` subcommands (bench/cli.py) under `vitserve evaluate`."""
from __future__ import annotations

import json

from vitserve.evaluation.explanations import add_explanations_command  # noqa: F401 (vitserve/cli.py's _COMMANDS names it here)
from vitserve.help_format import DefaultsHelpFormatter


def _sizes(text: str) -> list[tuple[int, int]]:
    """'28,24,36x20' -> [(28, 28), (24, 24), (36, 20)]"""
    sizes = []
    for part in text.split(","):
        h, _, w = part.lower().partition("x")
        sizes.append((int(h), int(w or h)))
    return sizes


def add_accuracy_parser(commands) -> None:
    """`vitserve evaluate accuracy`, onto the subparsers of `vitserve evaluate`."""
    acc = commands.add_parser("accuracy", help="test accuracy of an ONNX model with ONNX Runtime (CPU)",
                              formatter_class=DefaultsHelpFormatter)
    acc.add_argument("model", help="ONNX file from `vitserve export` (1-channel, Fashion-MNIST classes)")
    acc.add_argument("--sizes", type=_sizes, default=_sizes("28,24,36,56"), help="resolutions H[xW], comma-separated")
    acc.add_argument("--data-dir", default="/usr/share/datasets/fashion-mnist")
    acc.add_argument("--limit", type=int, help="only the first N test images")
    acc.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    acc.set_defaults(func=run_accuracy)


def run_accuracy(args) -> int:
    from vitserve.evaluation.accuracy import onnx_accuracy

    rows = onnx_accuracy(args.model, args.sizes, data_dir=args.data_dir, limit=args.limit, threads=args.threads)
    for row in rows:
        print(json.dumps(row))
    return 0
