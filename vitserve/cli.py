"""The `vitserve` command. Each package registers its own subcommands; heavy imports wait until one runs,
so `vitserve serve` never loads torch."""
from __future__ import annotations

import argparse
import importlib
import sys

from vitserve import __version__

# package module -> the functions that add its subcommands
_COMMANDS = [
    ("model.cli", ["add_train_parser", "add_import_parser"]),
    ("export.cli", ["add_export_parser", "add_evaluate_parser"]),
    ("service.cli", ["add_serve_parser"]),
    ("service.client", ["add_predict_parser"]),
    ("bench.cli", ["add_bench_parser"]),
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vitserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module_name, adders in _COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # A package left out of this install (the serving image has no model/, export/ or bench/) offers no
            # commands; a missing dependency inside a present package is a real error.
            if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
                raise
            continue
        for adder in adders:
            if hasattr(module, adder):
                getattr(module, adder)(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
