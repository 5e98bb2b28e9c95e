"""timm's own model code as a reference, imported without torchvision (which this environment lacks).

timm's package __init__ imports torchvision (for its data pipeline and a frozen batch norm), so
`timm_without_torchvision` loads one timm model module with timm.data/timm.models' package __init__s skipped and
torchvision.ops.misc.FrozenBatchNorm2d stubbed by a placeholder that a ViT never uses; sys.modules is restored
afterwards so nothing else sees the stub.
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def timm_without_torchvision(module_name: str = "timm.models.vision_transformer"):
    """Import a timm model module without timm's torchvision-dependent package __init__s."""
    root = Path(importlib.util.find_spec("timm").origin).parent
    before = set(sys.modules)

    def package(name: str, path: Path) -> types.ModuleType:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]  # a package whose __init__ is not run; submodules import normally
        sys.modules[name] = module
        return module

    try:
        misc = types.ModuleType("torchvision.ops.misc")
        misc.FrozenBatchNorm2d = type("FrozenBatchNorm2d", (), {})  # only batch-norm CNNs use it
        package("torchvision", root / "_absent"), package("torchvision.ops", root / "_absent")
        sys.modules["torchvision.ops.misc"] = misc
        timm = package("timm", root)
        timm.__version__ = importlib.import_module("timm.version").__version__
        package("timm.models", root / "models")
        data = package("timm.data", root / "data")
        constants = importlib.import_module("timm.data.constants")
        data.__dict__.update({k: v for k, v in vars(constants).items() if k.isupper()})
        yield importlib.import_module(module_name)
    finally:
        # Only timm and the stub go: torch submodules timm pulled in must stay (re-importing them
        # would register their operators twice).
        for name in set(sys.modules) - before:
            if name.split(".")[0] in ("timm", "torchvision"):
                del sys.modules[name]
