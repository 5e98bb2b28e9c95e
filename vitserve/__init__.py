"""vitserve: train a Vision Transformer, export it to ONNX, serve it over HTTP.

The product's layers are imported as `vitserve.model`, `vitserve.export`, `vitserve.service` (and the tools beside
them as `vitserve.evaluation`, `vitserve.bench`). An installed wheel holds them inside this package (setup.py maps
the repository's top-level folders there). A source checkout keeps them beside this folder, and is often run with
only its root on PYTHONPATH (the benchmark's A/B of two checkouts, the peers' own venvs, the GPU kit): there the
finder below resolves `vitserve.<layer>` to `<checkout>/<layer>` and nothing else, so a checkout imports the same
names as an installed wheel without putting `model` or `service` on anyone's path.
"""
from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec, PathFinder
from pathlib import Path

__version__ = "0.1.0"

LAYERS = ("model", "export", "evaluation", "service", "bench")


class CheckoutLayers(MetaPathFinder):
    """Finds `vitserve.<layer>` in a source checkout's root; their submodules follow by the package's __path__."""

    def __init__(self, checkout: Path):
        self.checkout = str(checkout)

    def find_spec(self, fullname: str, path=None, target=None) -> ModuleSpec | None:
        parent, _, name = fullname.rpartition(".")
        if parent != __name__ or name not in LAYERS:
            return None
        return PathFinder.find_spec(fullname, [self.checkout])


def _checkout_root() -> Path | None:
    """The source checkout this package sits in, or None when installed (the layers are then inside it)."""
    here = Path(__file__).resolve().parent
    if any((here / layer).is_dir() for layer in LAYERS) or not (here.parent / "pyproject.toml").is_file():
        return None
    return here.parent


_checkout = _checkout_root()
if _checkout is not None and not any(isinstance(f, CheckoutLayers) for f in sys.meta_path):
    # First: an editable install's own finder (setuptools') maps the layers to the checkout it was installed from,
    # and a second checkout on PYTHONPATH (an A/B benchmark's) must import its own.
    sys.meta_path.insert(0, CheckoutLayers(_checkout))
