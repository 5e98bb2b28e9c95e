"""Bench servers start the way `vitserve serve` does: one uvicorn options function, the settings under test."""
from __future__ import annotations

import os

import pytest

from vitserve.bench.config import BenchConfig
from vitserve.bench.servers import run_bare_server, server_settings


@pytest.fixture
def private_environ(monkeypatch):
    """`serve` writes its flags into os.environ (for uvicorn's workers); keep that inside the test."""
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("VITSERVE_")
                                        and k != "PROMETHEUS_MULTIPROC_DIR"})


def test_serve_and_the_bare_server_run_uvicorn_with_the_same_options(tiny_onnx, private_environ, monkeypatch):
    import uvicorn

    from vitserve.service.cli import DRAIN_MARGIN_S, uvicorn_options
    from vitserve.service.http.connection import HttpLimits, LimitedHttpToolsFactory
    from vitserve.service.ground.settings import Settings
    from vitserve.cli import main

    calls = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kwargs: calls.append((app, kwargs)))
    assert main(["serve", "--model", str(tiny_onnx), "--engine", "inline", "--port", "9123", "--limit-concurrency", "50",
                 "--drain-timeout-s", "5", "--log-level", "warning"]) == 0
    run_bare_server()  # reads the same VITSERVE_* variables that `serve` just wrote
    (serve_app, serve_kwargs), (bare_app, bare_kwargs) = calls
    assert (serve_app, bare_app) == ("vitserve.service.app:app_from_env", "vitserve.bench.servers:bare_app")
    assert serve_kwargs == bare_kwargs == {"factory": True, **uvicorn_options(Settings())}
    assert serve_kwargs == {"factory": True, "host": "127.0.0.1", "port": 9123, "workers": 1, "log_level": "warning",  # inline
                            "limit_concurrency": 50, "timeout_graceful_shutdown": 5 + DRAIN_MARGIN_S,
                            "http": LimitedHttpToolsFactory(HttpLimits.from_settings(Settings()))}


def test_server_settings_are_the_overrides_plus_batching_and_loopback():
    cfg = BenchConfig(max_batch_size=8, max_queue_delay_ms=2.0, concurrency=[1, 200], request_timeout_s=60.0)
    on = server_settings(cfg, {"intra_op_threads": "1", "log_level": "info"}, batching=True)
    assert on == {"VITSERVE_INTRA_OP_THREADS": "1", "VITSERVE_LOG_LEVEL": "info", "VITSERVE_MAX_BATCH_SIZE": "8",
                  "VITSERVE_MAX_QUEUE_DELAY_MS": "2.0", "VITSERVE_REQUEST_TIMEOUT_MS": "60000.0",
                  "VITSERVE_MAX_QUEUE_SIZE": "400", "VITSERVE_HOST": "127.0.0.1", "VITSERVE_GRPC_PORT": "0"}
    off = server_settings(BenchConfig(max_batch_size=8), {"max_queue_size": "9"}, batching=False)
    assert off == {"VITSERVE_MAX_QUEUE_SIZE": "9", "VITSERVE_MAX_BATCH_SIZE": "1",
                   "VITSERVE_REQUEST_TIMEOUT_MS": "120000.0", "VITSERVE_HOST": "127.0.0.1",
                   "VITSERVE_LOG_LEVEL": "warning", "VITSERVE_GRPC_PORT": "0"}


def test_a_server_counts_as_ready_once_every_worker_is(monkeypatch):
    """The first ready worker makes /v2/health/ready answer; a measurement waits for the rest (a peer without the
    gauges counts as ready)."""
    from vitserve.bench import servers

    server = servers.ServerProcess(["true"], 1)
    for scraped, ready in (({"vitserve_http_workers_ready": 6.0, "vitserve_http_workers": 14.0}, False),
                           ({"vitserve_http_workers_ready": 14.0, "vitserve_http_workers": 14.0}, True),
                           ({}, True)):
        monkeypatch.setattr(servers, "scrape_metrics", lambda port, names, scraped=scraped: scraped)
        assert server._every_worker_ready() is ready
