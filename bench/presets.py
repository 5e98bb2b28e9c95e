"""`--model` names the bench makes itself, with random weights (speed does not depend on the weights).

They are made by `python -m vitserve.export.presets NAME OUT.onnx` in a child process: export needs torch, and the
bench, like the server it measures, never imports it.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

PRESETS = ("vit-s16", "vit-b16", "vit-fmnist-random")
PRECISION_SUFFIXES = ("-int8", "-fp16")  # "vit-s16-int8": the preset exported at that precision


def resolve_model(model: str, cache_dir: Path) -> Path:
    """An ONNX path as given, or for a preset name the cached export, made on first use in a child process."""
    base, precision = model, "fp32"
    for suffix in PRECISION_SUFFIXES:
        if model.endswith(suffix) and model[:-len(suffix)] in PRESETS:
            base, precision = model[:-len(suffix)], suffix[1:]
    if base not in PRESETS:
        path = Path(model)
        if not path.is_file():
            raise SystemExit(f"vitserve bench: no model file {path} (or use a preset: {', '.join(PRESETS)}, each "
                             f"also with {' or '.join(PRECISION_SUFFIXES)})")
        return path
    path = cache_dir / f"{model}.onnx"
    if not path.is_file():
        print(f"exporting random-weight {model} to {path} (needs torch: pip install -e '.[export]') ...", flush=True)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial.onnx")  # a run cut short leaves no half-written model under the real name
        subprocess.run([sys.executable, "-m", "vitserve.export.presets", base, str(tmp), "--precision", precision],
                       check=True, timeout=1800)
        tmp.replace(path)
    return path
