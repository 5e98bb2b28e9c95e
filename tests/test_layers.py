"""The import rules that keep the layers apart, read from the source: every .py file is parsed with `ast`, so an
import inside a function counts as much as one at the top, and a relative import is resolved against its package.

- The product (model/, export/, service/, vitserve/) imports neither its benchmark (bench/) nor the evaluation
  research (evaluation/): tools stand beside the product, and may import it, never the other way.
- service/ never imports torch: the serving images have none.
- Below the transports (service/ground/, engine/, usecases/, schemas/) nothing imports a web or RPC framework
  (fastapi, starlette, uvicorn, grpc).
- The service's floors (docs/architecture.md): the ground (service/ground/: errors, deadlines, memory, metrics,
  settings, tracing, logs) imports nothing of the service above it; the repository's disk layout
  (service/repository/) only the ground; the engine (service/engine/, which owns the registry) only the ground
  and the repository's layout; the use cases (service/usecases/) and protocols (service/schemas/) those and each
  other, never a transport (service/http/, service/grpc/, the entry points).
- Every layer is imported under the one name `vitserve` (vitserve.model, vitserve.service, ...): no file imports
  `model`, `export`, `service`, `bench` or `evaluation` as a top-level package (those names in
  site-packages shadowed a user's own `model.py`), and an install puts only `vitserve` on the path.

vitserve/cli.py names bench.cli and evaluation.cli as strings in `_COMMANDS` and loads each only where it is
installed; the last test builds the command line with both absent, as in the serving images.
"""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PRODUCT = ("model", "export", "service", "vitserve")
TOOLS = ("bench", "evaluation")
LAYERS = ("model", "export", "service", "evaluation", "bench")  # installed as vitserve.<layer> (setup.py)
WEB_AND_RPC = ("fastapi", "starlette", "uvicorn", "grpc")

# (folder, the top-level packages that nothing under it may import)
RULES = [*((folder, TOOLS) for folder in PRODUCT), ("service", ("torch",)),
         *((f"service/{floor}", WEB_AND_RPC) for floor in ("ground", "engine", "usecases", "schemas"))]
# (folder, the parts of the service it may import): a floor imports only the floors below it
FLOORS = [("service/ground", ("ground",)), ("service/repository", ("ground", "repository")),
          ("service/engine", ("ground", "repository", "engine")),
          *((f"service/{floor}", ("ground", "repository", "engine", "usecases", "schemas"))
            for floor in ("usecases", "schemas"))]


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in the file at `path` (inside `root`)."""
    package = path.relative_to(root).parent.parts
    if package and package[0] in LAYERS:
        package = ("vitserve", *package)
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


def layer_of(module: str) -> str:
    """The layer or top-level package a module belongs to: 'bench' for vitserve.bench.x (and for a bare bench.x)."""
    parts = module.split(".")
    return parts[1] if parts[0] == "vitserve" and len(parts) > 1 and parts[1] in LAYERS else parts[0]


def violations(root: Path, folder: str, banned: tuple[str, ...]) -> list[str]:
    """'path:line imports module' for every import under root/folder of a package in `banned` or inside one."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in imported_modules(path, root):
            if layer_of(module) in banned:
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder, banned", RULES, ids=[f"{f}-imports-no-{'-'.join(b)}" for f, b in RULES])
def test_import_rule_holds(folder, banned):
    assert list((ROOT / folder).rglob("*.py")), f"{folder}/ has no Python files: the rule would hold vacuously"
    assert violations(ROOT, folder, banned) == []


def floor_violations(root: Path, folder: str, allowed: tuple[str, ...]) -> list[str]:
    """'path:line imports module' for every import under root/folder of a part of the service not in `allowed`."""
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        for line, module in imported_modules(path, root):
            parts = module.split(".")
            if parts[:2] == ["vitserve", "service"] and (len(parts) < 3 or parts[2] not in allowed):
                found.append(f"{path.relative_to(root)}:{line} imports {module}")
    return found


@pytest.mark.parametrize("folder, allowed", FLOORS, ids=[f for f, _ in FLOORS])
def test_each_floor_imports_only_the_floors_below(folder, allowed):
    assert list((ROOT / folder).rglob("*.py")), f"{folder}/ has no Python files: the rule would hold vacuously"
    assert floor_violations(ROOT, folder, allowed) == []


def test_the_floor_rule_finds_a_planted_import(tmp_path):
    planted = {"service/ground/errors.py": "from vitserve.service.http.errors import STATUS_CODES\n",
               "service/ground/metrics.py": "from . import settings\nfrom .. import app\n",
               "service/repository/layout.py": "from vitserve.service.engine import registry\n",
               "service/engine/registry.py": "from vitserve.service.repository.layout import x\n"
                                             "import vitserve.service.usecases.state\nfrom vitserve.service import engine\n",
               "service/usecases/inference.py": "from vitserve.service.engine import Engine\n"
                                            "from vitserve.service.http.errors import status_code\n",
               "service/schemas/binary_tensors.py": "from vitserve.service.usecases import state\n"
                                                     "from vitserve.service.grpc import messages\n"}
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert {folder: floor_violations(tmp_path, folder, allowed) for folder, allowed in FLOORS} == {
        "service/ground": ["service/ground/errors.py:1 imports vitserve.service.http.errors",
                           "service/ground/metrics.py:2 imports vitserve.service.app"],
        "service/repository": ["service/repository/layout.py:1 imports vitserve.service.engine"],
        # `from vitserve.service import engine` names no floor: it must be written from the floor's own package
        "service/engine": ["service/engine/registry.py:2 imports vitserve.service.usecases.state",
                           "service/engine/registry.py:3 imports vitserve.service"],
        "service/usecases": ["service/usecases/inference.py:2 imports vitserve.service.http.errors"],
        "service/schemas": ["service/schemas/binary_tensors.py:2 imports vitserve.service.grpc"]}


def test_each_rule_finds_a_planted_import(tmp_path):
    """The checker itself: one forbidden import of each kind planted in a copy of the layout is found, at its line,
    however it is written; look-alike names and the product's own modules are not."""
    planted = {
        "model/train.py": "import numpy\n\ndef run():\n    import vitserve.bench.measure\n",
        "export/int8.py": "from vitserve.evaluation.explanations import spearman\n",
        "vitserve/cli.py": "import json, bench\n",
        "service/engine/batcher.py": "from .. import errors\nfrom fastapi import Request\n",
        "service/engine/runtime.py": "from grpc import aio\n",
        "service/ground/tracing.py": "import uvicorn.config\n",
        "service/usecases/state.py": "from fastapi import Request\n",
        "service/schemas/v1.py": "import numpy\nimport starlette.responses\n",
        "service/http/app.py": "from starlette.requests import Request\nfrom torch import nn\n",
        "service/app.py": "import benchmarks\nimport evaluations.x\nfrom vitserve.service.engine import runtime\n",
    }
    for name, text in planted.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = {(folder, banned): violations(tmp_path, folder, banned) for folder, banned in RULES}
    assert found == {
        ("model", TOOLS): ["model/train.py:4 imports vitserve.bench.measure"],
        ("export", TOOLS): ["export/int8.py:1 imports vitserve.evaluation.explanations"],
        ("service", TOOLS): [],
        ("vitserve", TOOLS): ["vitserve/cli.py:1 imports bench"],
        ("service", ("torch",)): ["service/http/app.py:2 imports torch"],
        ("service/engine", WEB_AND_RPC): ["service/engine/batcher.py:2 imports fastapi",
                                          "service/engine/runtime.py:1 imports grpc"],
        ("service/ground", WEB_AND_RPC): ["service/ground/tracing.py:1 imports uvicorn.config"],
        ("service/usecases", WEB_AND_RPC): ["service/usecases/state.py:1 imports fastapi"],
        ("service/schemas", WEB_AND_RPC): ["service/schemas/v1.py:2 imports starlette.responses"],
    }
    assert imported_modules(tmp_path / "service/engine/batcher.py", tmp_path) == [
        (1, "vitserve.service.errors"), (2, "fastapi")]


def bare_layer_imports(root: Path, folders: tuple[str, ...]) -> list[str]:
    """'path:line imports module' for every import of a layer by its bare top-level name (`model.vit`)."""
    return [f"{path.relative_to(root)}:{line} imports {module}"
            for folder in folders for path in sorted((root / folder).rglob("*.py"))
            for line, module in imported_modules(path, root) if module.split(".")[0] in LAYERS]


@pytest.mark.slow
def test_every_layer_is_imported_under_vitserve(tmp_path):
    assert bare_layer_imports(ROOT, (*LAYERS, "vitserve", "tests")) == []
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests/test_x.py").write_text("import os\nfrom model.vit import VisionTransformer\n"
                                              "from vitserve.model import vit\nimport service\n")
    assert bare_layer_imports(tmp_path, ("tests",)) == ["tests/test_x.py:2 imports model.vit",
                                                        "tests/test_x.py:4 imports service"]


@pytest.mark.slow
def test_the_install_puts_only_vitserve_on_the_path(tmp_path):
    """From a directory outside the checkout, the installed project (editable here, as `make setup-dev` makes it)
    gives every layer as vitserve.<layer>, from this checkout, and none of them by its bare name."""
    probe = ("import importlib.util, sys\n"
             "import vitserve.service.app, vitserve.model.vit, vitserve.export.cli, vitserve.bench.cli\n"
             "print(vitserve.service.app.__file__)\n"
             "print(sorted(n for n in ('model', 'export', 'service', 'bench', 'evaluation')"
             " if importlib.util.find_spec(n) is not None))\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert done.returncode == 0, done.stderr[-2000:]
    app_file, bare = done.stdout.splitlines()
    # the import path is the file path (vitserve/service is a link to service/): static tools follow it
    assert Path(app_file) == ROOT / "vitserve" / "service" / "app.py" and bare == "[]"
    assert Path(app_file).resolve() == ROOT / "service" / "app.py"


def test_a_second_checkout_on_pythonpath_imports_its_own_layers(tmp_path):
    """The A/B benchmarks run another checkout with its root on PYTHONPATH, beside the editable install of this
    one: `vitserve.service` must then come from that checkout, not from the one the install points at."""
    other = tmp_path / "other"
    for folder in ("vitserve", "service"):
        shutil.copytree(ROOT / folder, other / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(ROOT / "pyproject.toml", other / "pyproject.toml")
    done = subprocess.run([sys.executable, "-c", "import vitserve.service.ground.settings as s; print(s.__file__)"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(other)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert Path(done.stdout.strip()).resolve() == other / "service" / "ground" / "settings.py"


@pytest.mark.slow
def test_the_wheel_holds_one_top_level_name(tmp_path):
    """`pip install .` installs what setup.py packs: every layer of the product inside vitserve/, with the web
    page's files; the benchmark stays in the checkout."""
    # from a copy: setuptools stages a build in the tree's build/lib and would pack what an earlier build left there
    source = tmp_path / "source"
    for name in ("vitserve", *LAYERS):
        shutil.copytree(ROOT / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copyfile(ROOT / name, source / name)
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                           "--wheel-dir", str(tmp_path), str(source)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    names = zipfile.ZipFile(next(tmp_path.glob("vitserve-*.whl"))).namelist()
    assert {name.split("/")[0] for name in names} == {"vitserve", "vitserve-0.1.0.dist-info"}
    assert {f"vitserve/{layer}/__init__.py" for layer in LAYERS if layer != "bench"} <= set(names)
    assert not any(name.startswith("vitserve/bench/") for name in names)
    assert {"vitserve/service/web/index.html", "vitserve/service/grpc/generated/grpc_service.proto"} <= set(names)


def test_the_command_line_builds_without_the_tools(monkeypatch, capsys):
    """As in the serving images: bench/ and evaluation/ absent, `vitserve` still builds its commands and offers
    none of theirs (a product module importing either while the parser is built fails here)."""
    from vitserve.cli import build_parser

    for name in [*(f"vitserve.{tool}" for tool in TOOLS), *(m for m in sys.modules if layer_of(m) in TOOLS)]:
        monkeypatch.setitem(sys.modules, name, None)  # `import vitserve.bench...` now raises ModuleNotFoundError
    parser = build_parser()
    assert parser.parse_args(["export", "ckpt", "--out", "m.onnx"]).command == "export"
    for argv in (["bench"], ["evaluate", "accuracy", "m.onnx"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
        assert f"invalid choice: '{argv[0]}'" in capsys.readouterr().err


def test_every_vitserve_import_of_the_product_is_a_file_path():
    """Static tools (the type checker, an IDE, an import-graph tool) resolve `vitserve.a.b` to vitserve/a/b.py or
    vitserve/a/b/__init__.py with no import hook: the layers are links in vitserve/. Every module the product's
    files name in `import X` or `from X import ...` is such a file (a folder of modules, for a namespace)."""
    def is_module(module: str) -> bool:
        base = ROOT.joinpath(*module.split("."))
        return base.with_suffix(".py").is_file() or base.is_dir() and any(base.glob("*.py"))

    for layer in LAYERS:
        assert (ROOT / "vitserve" / layer).is_symlink() and (ROOT / "vitserve" / layer).resolve() == ROOT / layer
    named, unresolved = set(), []
    for folder in PRODUCT:
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
                modules = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                for module in (m for m in modules if m.startswith("vitserve.")):
                    named.add(module)
                    if not is_module(module):
                        unresolved.append(f"{path.relative_to(ROOT)}:{node.lineno} imports {module}")
    assert len(named) > 80 and unresolved == []
