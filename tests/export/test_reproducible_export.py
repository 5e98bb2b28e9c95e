"""The same checkpoint exported from two checkouts in different directories gives the same bytes, with no
path of the machine inside (torch.export's stack traces used to carry absolute source paths)."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # two checkouts, each exporting in a child process

REPO = Path(__file__).resolve().parents[2]
EXPORT = ("import sys, vitserve.export.onnx_export as e; assert e.__file__.startswith(sys.argv[3]), e.__file__; "
          "e.export_onnx(sys.argv[1], sys.argv[2], verify=False)")


def start_export(checkout: Path, checkpoint: Path, out: Path, hash_seed: int) -> subprocess.Popen:
    for package in ("model", "export", "vitserve"):
        shutil.copytree(REPO / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copyfile(REPO / "pyproject.toml", checkout / "pyproject.toml")  # marks a checkout (vitserve/__init__.py)
    # the checkout's own packages first, ahead of the editable install that points at this repository
    with out.with_suffix(".log").open("wb") as log:
        return subprocess.Popen([sys.executable, "-c", EXPORT, str(checkpoint), str(out), str(checkout)],
                                cwd=checkout, env={"PYTHONPATH": str(checkout), "PATH": "/usr/bin:/bin",
                                                   "OMP_NUM_THREADS": "1", "PYTHONHASHSEED": str(hash_seed)},
                                stdout=log, stderr=subprocess.STDOUT)


def test_two_checkouts_export_identical_bytes_without_paths(tiny_checkpoint, tmp_path):
    # Two hash seeds that order the exporter's sets differently (the range constraints once printed so); the two
    # exports run at once, one per core.
    outs = [tmp_path / "one.onnx", tmp_path / "two.onnx"]
    children = [start_export(tmp_path / "checkout-one", tiny_checkpoint, outs[0], hash_seed=1),
                start_export(tmp_path / "elsewhere" / "checkout-two", tiny_checkpoint, outs[1], hash_seed=3)]
    for child, out in zip(children, outs):
        assert child.wait(timeout=600) == 0, out.with_suffix(".log").read_text(errors="replace")[-3000:]
    first, second = (out.read_bytes() for out in outs)
    assert first == second
    for path in (tmp_path, REPO, Path(sys.prefix), Path.home()):
        assert str(path).encode() not in first
    assert b"site-packages" not in first and b".py\"" not in first and b".py, line" not in first
    # and this process's export, whose graphs the session's trace cache (tests/conftest.py) hands out, is the same
    from vitserve.export.onnx_export import export_onnx
    export_onnx(tiny_checkpoint, tmp_path / "here.onnx", verify=False)
    assert (tmp_path / "here.onnx").read_bytes() == first
