"""Where the processes of one `vitserve serve` keep their Prometheus values (prometheus-client's multiprocess
mode). Standard library only: the variable must be set before prometheus-client is first imported in a
process, because the client reads it then; `vitserve serve` calls `prepare_multiprocess_dir` before it
imports anything that imports the client.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir() -> tuple[Path, bool]:
    """Workers share metrics through files: use (and empty) PROMETHEUS_MULTIPROC_DIR, or make one; returns the
    directory and whether it was made here (then the caller removes it when the server exits)."""
    directory, made = multiprocess_dir(), False
    if directory:
        for stale in Path(directory).glob("*.db"):  # a previous run's values would be summed in
            stale.unlink()
    else:
        directory, made = tempfile.mkdtemp(prefix="vitserve-metrics-"), True
        os.environ[MULTIPROC_ENV] = directory
    Path(directory).mkdir(parents=True, exist_ok=True)
    return Path(directory), made
