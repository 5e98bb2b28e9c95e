"""The peers' virtual environments: build/peers/venv-triton and build/peers/venv-litserve, made with pip and pinned
versions on first use, each holding the peer and what `bench/peers/image_classifier.py` imports (numpy, Pillow,
onnxruntime: never torch). Each peer pins its own world (pytriton needs numpy < 2), so neither lives in vitserve's.

A venv is remade when its requirements change (they are written into it as `requirements.txt`).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REQUIREMENTS = {
    # the wheel ships the real `tritonserver` binary and its Python backend
    "triton": ["nvidia-pytriton==0.7.0", "tritonclient==2.73.0", "pyzmq==27.3.0", "grpcio==1.85.1",
               "numpy==1.26.4", "pillow==13.0.0", "onnxruntime==1.32.0",
               # `--openvino-precision`: the fast graph taken apart with onnx, compiled by OpenVINO
               "onnx==1.23.2", "openvino==2026.4.1"],
    # python-multipart: Starlette's form parser, which LitServe's form handling needs
    "litserve": ["litserve==0.2.19", "fastapi==0.165.0", "starlette==1.10.0", "uvicorn==0.54.0", "pyzmq==27.3.0",
                 "python-multipart==0.0.34", "numpy==2.4.6", "pillow==13.0.0", "onnxruntime==1.32.0"],
}
# what each peer's report names; the FastAPI app has no venv of its own: it runs in vitserve's environment
VERSIONS_OF = {"triton": ["nvidia-pytriton", "tritonclient", "numpy", "onnxruntime", "openvino"],
               "litserve": ["litserve", "fastapi", "uvicorn", "numpy", "onnxruntime"],
               "fastapi": ["fastapi", "uvicorn", "numpy", "onnxruntime"]}


def base_python() -> str:
    """The interpreter this Python was made from (a venv's base), to make the peers' venvs with."""
    return getattr(sys, "_base_executable", None) or sys.executable


def venv_python(work_dir: Path, peer: str) -> Path:
    return work_dir / f"venv-{peer}" / "bin" / "python"


def ensure_venv(work_dir: Path, peer: str, python: str | None = None) -> Path:
    """The peer's venv python, the venv made (or remade) first when absent or pinned differently."""
    venv = work_dir / f"venv-{peer}"
    wanted = "\n".join(REQUIREMENTS[peer]) + "\n"
    stamp = venv / "requirements.txt"
    if stamp.is_file() and stamp.read_text() == wanted and venv_python(work_dir, peer).is_file():
        return venv_python(work_dir, peer)
    print(f"making {venv} ({', '.join(REQUIREMENTS[peer])}) ...", flush=True)
    subprocess.run([python or base_python(), "-m", "venv", "--clear", str(venv)], check=True)
    pip = [str(venv_python(work_dir, peer)), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, *REQUIREMENTS[peer]], check=True, timeout=1800)
    stamp.write_text(wanted)  # last: a venv cut short is remade next time
    return venv_python(work_dir, peer)


def _ask(python: Path, code: str) -> str:
    return subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True,
                          timeout=120).stdout.strip()


def library_dir(python: Path) -> str:
    """Where the venv's interpreter keeps libpython: Triton's Python backend stub links libpython3.X, found there
    through LD_LIBRARY_PATH when that Python is not the system's."""
    return _ask(python, "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')")


def package_versions(python: Path, names: list[str]) -> dict[str, str]:
    code = f"import importlib.metadata as m, json; print(json.dumps({{n: m.version(n) for n in {names!r}}}))"
    version = _ask(python, "import platform; print(platform.python_version())")
    return {"python": version, **json.loads(_ask(python, code))}
