"""The same checkpoint exported from two checkouts in different directories gives the same bytes, with no
path of the machine inside (torch.export's stack traces used to carry absolute source paths)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
EXPORT = ("import sys, export.onnx_export as e; assert e.__file__.startswith(sys.argv[3]), e.__file__; "
          "e.export_onnx(sys.argv[1], sys.argv[2], verify=False)")


def export_from_checkout(checkout: Path, checkpoint: Path, out: Path, hash_seed: int) -> bytes:
    for package in ("model", "export", "vitserve"):
        shutil.copytree(REPO / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    # the checkout's own packages first, ahead of the editable install that points at this repository
    subprocess.run([sys.executable, "-c", EXPORT, str(checkpoint), str(out), str(checkout)], cwd=checkout,
                   env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1",
                        "PYTHONHASHSEED": str(hash_seed)},
                   check=True, capture_output=True, timeout=600)
    return out.read_bytes()


def test_two_checkouts_export_identical_bytes_without_paths(tiny_checkpoint, tmp_path):
    # Two hash seeds that order the exporter's sets differently (the range constraints once printed so).
    first = export_from_checkout(tmp_path / "checkout-one", tiny_checkpoint, tmp_path / "one.onnx", hash_seed=1)
    second = export_from_checkout(tmp_path / "elsewhere" / "checkout-two", tiny_checkpoint, tmp_path / "two.onnx",
                                  hash_seed=3)
    assert first == second
    for path in (tmp_path, REPO, Path(sys.prefix), Path.home()):
        assert str(path).encode() not in first
    assert b"site-packages" not in first and b".py\"" not in first and b".py, line" not in first
