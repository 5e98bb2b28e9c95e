"""The import rules that keep the layers apart, read from the source: every .py file is parsed with `ast`, so an
import inside a function counts as much as one at the top, and a relative import is resolved against its package.

- The product (model/, export/, service/, vitserve/) imports neither its benchmark (bench/) nor the evaluation
  research (evaluation/): tools stand beside the product, and may import it, never the other way.
- service/ never imports torch: the serving images have none.
- service/engine/ imports no web or RPC framework (fastapi, starlette, uvicorn, grpc).

vitserve/cli.py names bench.cli and evaluation.cli as strings in `_COMMANDS` and loads each only where it is
installed; the last test builds the command line with both absent, as in the serving images.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("model", "export", "service", "vitserve")
TOOLS = ("bench", "evaluation")
WEB_AND_RPC = ("fastapi", "starlette", "uvicorn", "grpc")

# (folder, the top-level packages that nothing under it may import)
RULES = [*((folder, TOOLS) for folder in PRODUCT), ("service", ("torch",)), ("service/engine", WEB_AND_RPC)]


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` (inside `root`)."""
    package = path.relative_to(root).parent.parts
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[:len(package) - node.level + 1]) if node.level else ""
            if node.module is None:  # `from . import name`: each name may be a module
                found += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
            else:
                found.append((node.lineno, f"{base}.{node.module}" if base else node.module))
    return found


def violations(root: Path, folder: str, banned: tuple[str, ...]) -> list[str]:
    """'path:line imports module' for every import under root/folder of a package in `banned` or inside one."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in imported_modules(path, root):
            if module.split(".")[0] in banned:
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder, banned", RULES, ids=[f"{f}-imports-no-{'-'.join(b)}" for f, b in RULES])
def test_import_rule_holds(folder, banned):
    assert list((ROOT / folder).rglob("*.py")), f"{folder}/ has no Python files: the rule would hold vacuously"
    assert violations(ROOT, folder, banned) == []


def test_each_rule_finds_a_planted_import(tmp_path):
    """The checker itself: one forbidden import of each kind planted in a copy of the layout is found, at its line,
    however it is written; look-alike names and the product's own modules are not."""
    planted = {
        "model/train.py": "import numpy\n\ndef run():\n    import bench.measure\n",
        "export/int8.py": "from evaluation.explanations import spearman\n",
        "vitserve/cli.py": "import json, bench\n",
        "service/engine/batcher.py": "from .. import errors\nfrom fastapi import Request\n",
        "service/engine/runtime.py": "from grpc import aio\n",
        "service/http/app.py": "from starlette.requests import Request\nfrom torch import nn\n",
        "service/app.py": "import benchmarks\nimport evaluations.x\nfrom service.engine import runtime\n",
    }
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = {(folder, banned): violations(tmp_path, folder, banned) for folder, banned in RULES}
    assert found == {
        ("model", TOOLS): ["model/train.py:4 imports bench.measure"],
        ("export", TOOLS): ["export/int8.py:1 imports evaluation.explanations"],
        ("service", TOOLS): [],
        ("vitserve", TOOLS): ["vitserve/cli.py:1 imports bench"],
        ("service", ("torch",)): ["service/http/app.py:2 imports torch"],
        ("service/engine", WEB_AND_RPC): ["service/engine/batcher.py:2 imports fastapi",
                                          "service/engine/runtime.py:1 imports grpc"],
    }
    assert imported_modules(tmp_path / "service/engine/batcher.py", tmp_path) == [(1, "service.errors"),
                                                                                  (2, "fastapi")]


def test_the_command_line_builds_without_the_tools(monkeypatch, capsys):
    """As in the serving images: bench/ and evaluation/ absent, `vitserve` still builds its commands and offers
    none of theirs (a product module importing either while the parser is built fails here)."""
    from vitserve.cli import build_parser

    for name in [*TOOLS, *(m for m in sys.modules if m.split(".")[0] in TOOLS)]:
        monkeypatch.setitem(sys.modules, name, None)  # `import bench...` now raises ModuleNotFoundError
    parser = build_parser()
    assert parser.parse_args(["export", "ckpt", "--out", "m.onnx"]).command == "export"
    for argv in (["bench"], ["evaluate", "accuracy", "m.onnx"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert f"invalid choice: '{argv[0]}'" in capsys.readouterr().err
