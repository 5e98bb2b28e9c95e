"""`vitserve evaluate accuracy`, `calibration` and `explanations`: argument parsing only; torch loads when a command
runs. vitserve/cli.py gathers them with the benchmarks' `evaluate` subcommands (bench/cli.py) under
`vitserve evaluate`."""
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


def add_calibration_parser(commands) -> None:
    """`vitserve evaluate calibration`, onto the subparsers of `vitserve evaluate`."""
    cal = commands.add_parser("calibration", formatter_class=DefaultsHelpFormatter,
                              help="how well an ONNX file's served probabilities are calibrated, before and after "
                                   "its temperature, with a reliability diagram")
    cal.add_argument("model", help="ONNX file from `vitserve export` (with --eval: it carries a temperature)")
    cal.add_argument("--eval", dest="eval_dir", default="/usr/share/datasets/fashion-mnist",
                     help="a labelled set: Fashion-MNIST's folder (its idx files) or DIR/<label>/<image>")
    cal.add_argument("--limit", type=int, help="only the first N images")
    cal.add_argument("--threads", type=int, default=0, help="ONNX Runtime intra-op threads (0: its default)")
    cal.add_argument("--out", help="write the Markdown here and the diagram beside it (.png)")
    cal.set_defaults(func=run_calibration)


def run_calibration(args) -> int:
    from vitserve.evaluation.calibration import run

    return run(args)


def run_accuracy(args) -> int:
    from vitserve.evaluation.accuracy import onnx_accuracy

    rows = onnx_accuracy(args.model, args.sizes, data_dir=args.data_dir, limit=args.limit, threads=args.threads)
    for row in rows:
        print(json.dumps(row))
    return 0
