"""The `vitserve` command. Each package registers its own subcommands; heavy imports wait until one runs,
so `vitserve serve` never loads torch."""
from __future__ import annotations

import argparse
import importlib
import sys

from vitserve import __version__

# (package module, the functions that add its subcommands, the command they add to: None for `vitserve` itself)
_COMMANDS = [
    ("vitserve.model.cli", ["add_train_parser", "add_import_parser", "add_inspect_parser"], None),
    ("vitserve.export.cli", ["add_export_parser"], None),
    ("vitserve.evaluation.cli", ["add_accuracy_parser", "add_calibration_parser", "add_explanations_command"],
     "evaluate"),
    ("vitserve.service.cli", ["add_serve_parser", "add_tune_parser"], None),
    ("vitserve.service.client", ["add_predict_parser"], None),
    ("vitserve.bench.cli", ["add_bench_parser"], None),
    ("vitserve.bench.cli", ["add_evaluate_bench_parser", "add_relevance_cost_command"], "evaluate"),
]

# Commands whose subcommands come from several packages, made where a package first adds to them: `evaluate` holds
# the evaluation research (evaluation/) and the benchmarks that compare runtimes and paths (bench/).
_GROUPS = {"evaluate": "ONNX accuracy on Fashion-MNIST at several resolutions; ORT vs PyTorch speed; how faithful the "
                       "explanation maps are"}


# Modules that only the training and export install brings (`make serve`'s environment has none of them).
_TRAINING_TOOLS = {"torch", "onnx", "onnxscript", "onnx_ir", "safetensors", "tqdm", "matplotlib", "scipy", "skimage"}


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse prints its whole usage above a wrong flag (20 lines for `train`); every vitserve command reports an
    error in one line. Subcommands' parsers are of the same class (argparse makes them as their parent's)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the options)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(prog="vitserve", description=__doc__)
    parser.add_argument("--version", action="version", version=f"vitserve {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error (anywhere on the command line)")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    groups = {}  # command -> its subparsers, once a package has added to it
    for module_name, adders, group in _COMMANDS:
        module = _installed(module_name)
        if module is None:
            continue
        if group is not None and group not in groups:
            commands = subparsers.add_parser(group, help=_GROUPS[group])
            groups[group] = commands.add_subparsers(dest=f"{group}_command", required=True)
        for adder in adders:
            if hasattr(module, adder):
                getattr(module, adder)(subparsers if group is None else groups[group])
    return parser


def _installed(module_name: str):
    """The module, or None for a package left out of this install (the serving image has no model/, export/,
    evaluation/ or bench/: it offers no commands); a missing dependency inside a present package is a real error."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is None or not (module_name == e.name or module_name.startswith(e.name + ".")):
            raise
        return None


def main(argv: list[str] | None = None) -> int:
    """Run a command. An error is one line on stderr (exit 1) unless --debug asks for the traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    args = build_parser().parse_args([a for a in argv if a != "--debug"])
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"vitserve {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if debug:
            raise
        print(f"vitserve {args.command}: {error_line(e)}", file=sys.stderr)
        return 1


def error_line(error: Exception) -> str:
    """One line for an error a user can act on: what went wrong and, where there is one, the fix."""
    if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] in _TRAINING_TOOLS:
        return (f"needs {error.name}, part of the training and export tools, which this environment lacks: "
                f"`make setup-dev`, or `pip install -e '.[train,export]' -c constraints.txt`")
    message = " ".join(str(error).split()) or type(error).__name__
    return f"{message} (--debug shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
