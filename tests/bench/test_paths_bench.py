"""`python -m vitserve.bench.paths`: each HTTP path answers the same image, and the server's CPU per request is split between
its frontend and its engine processes."""
from __future__ import annotations

import json
import os
import shutil

import pytest


def test_the_engine_is_told_apart_from_the_frontend_by_its_runtime_library():
    from vitserve.bench.paths import server_processes

    frontend, engines = server_processes(os.getpid())  # this test process: no children running a runtime
    assert frontend[0] == os.getpid() and engines == []


@pytest.mark.skipif(shutil.which("wrk") is None, reason="needs Debian's wrk")
@pytest.mark.slow
def test_every_path_is_measured_with_its_cpu_per_request(tiny_onnx, tmp_path, monkeypatch):
    from vitserve.bench import paths

    monkeypatch.chdir(tmp_path)  # the wrk scripts go to build/bench/paths under the working directory
    out = tmp_path / "paths.md"
    paths.main(["--model", str(tiny_onnx), "--concurrency", "2", "--rounds", "1", "--duration", "1",
                "--out", str(out)])
    rows = json.loads(out.with_suffix(".json").read_text())
    assert {r["path"] for r in rows} == set(paths.PATHS)
    for row in rows:
        assert row["non_2xx"] == 0 and row["req_s"] > 0, row
        assert row["http_us"] > 0 and row["engine_us"] > 0, row  # both kinds of process were found and worked
    assert "| v2-image | 2 |" in out.read_text()
