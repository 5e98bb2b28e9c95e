"""A real `vitserve serve` process: HTTP over TCP, SIGTERM drains admitted requests, a corrupt model
stops startup with a clear message, and the service package imports without torch."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import threading

import httpx
import onnx
import pytest

from service_fixtures import REPO, image_bytes, scrape, uvicorn_server, value, wait_until

# With dispatch_when_idle off, a lone image waits this long for company: long enough for the test's own
# steps (a client giving up after 0.3 s, four requests arriving) to fit in however loaded the machine.
QUEUE_DELAY_MS = "3000"


@pytest.mark.slow
def test_serves_over_tcp_and_drops_requests_whose_client_left(tiny_onnx):
    lone_waits = ("--max-queue-delay-ms", QUEUE_DELAY_MS, "--dispatch-when-idle", "false")
    with uvicorn_server(tiny_onnx, *lone_waits) as (url, _):
        upload = {"file": ("a.jpg", image_bytes("JPEG"), "image/jpeg")}
        response = httpx.post(f"{url}/v1/classify?top_k=2", files=upload, timeout=30)
        card = httpx.get(f"{url}/v1/model").json()
        live = httpx.get(f"{url}/v2/health/live").json()
        with pytest.raises(httpx.ReadTimeout):  # the client gives up while its image waits for a batch
            httpx.post(f"{url}/v1/classify", content=image_bytes("PNG"), headers={"content-type": "image/png"},
                       timeout=0.3)
        wait_until(lambda: value(scrape(url), "vitserve_requests_rejected_total", reason="client_disconnected") == 1,
                   "the server noticing that the client left")
        # Had the abandoned image stayed queued, it would run before (or with) this one: same shape, queued earlier.
        sentinel = httpx.post(f"{url}/v1/classify", content=image_bytes("PNG"), headers={"content-type": "image/png"},
                              timeout=30)
        text = httpx.get(f"{url}/metrics").text
    assert response.status_code == 200 and len(response.json()["predictions"]) == 2
    assert card["provider"] == "CPUExecutionProvider" and live == {"live": True}
    assert sentinel.status_code == 200
    assert "vitserve_ready 1.0" in text
    served = '{model="tiny-vit",version="7"}'
    assert f"vitserve_images_total{served} 2.0" in text  # the first request and the sentinel; never the abandoned one
    assert 'vitserve_requests_rejected_total{reason="client_disconnected"} 1.0' in text
    assert f"vitserve_queue_depth{served} 0.0" in text


@pytest.mark.slow
def test_sigterm_finishes_admitted_requests_then_exits(tiny_onnx):
    results: list[int] = []

    def send():
        response = httpx.post(url + "/v1/classify", content=image_bytes("PNG"), headers={"content-type": "image/png"},
                              timeout=30)
        results.append(response.status_code)

    queue_for_a_while = ("--max-queue-delay-ms", QUEUE_DELAY_MS, "--max-batch-size", "16", "--dispatch-when-idle",
                         "false")
    with uvicorn_server(tiny_onnx, *queue_for_a_while) as (url, process):
        senders = [threading.Thread(target=send) for _ in range(4)]
        for sender in senders:
            sender.start()
        _wait_until_queued(url, 4)  # admitted: read, decoded and waiting for their batch
        process.send_signal(signal.SIGTERM)
        for sender in senders:
            sender.join(30)
        assert process.wait(30) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal once it has drained
        output = process.stdout.read().decode()
    assert results == [200] * 4, output
    with pytest.raises(httpx.TransportError):
        httpx.get(url + "/v2/health/live", timeout=2)


def _wait_until_queued(url: str, count: int) -> None:
    def queued() -> bool:
        metrics = scrape(url)
        assert value(metrics, "vitserve_images_total") == 0, f"the queue delay ran out before {count} were queued"
        return value(metrics, "vitserve_queue_depth") == count

    wait_until(queued, f"{count} requests queued")


@pytest.mark.slow
def test_a_corrupt_model_stops_startup_with_a_clear_message(tiny_onnx, tmp_path):
    broken = onnx.load(str(tiny_onnx))
    broken.graph.node[0].op_type = "NoSuchOperator"  # metadata intact, graph unloadable
    path = tmp_path / "broken.onnx"
    onnx.save(broken, str(path))
    with pytest.raises(RuntimeError) as info:
        with uvicorn_server(path, ready_timeout_s=60):
            pass
    assert "cannot load ONNX model" in str(info.value)


BLOCK_TORCH = textwrap.dedent("""
    import importlib, importlib.abc, json, pkgutil, sys

    class Blocker(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "torchvision", "safetensors", "onnxscript"):
                raise ImportError(f"{name} is blocked: the serving world has no {name}")
            return None

    sys.meta_path.insert(0, Blocker())
    import vitserve.service
    modules = [m.name for m in pkgutil.walk_packages(vitserve.service.__path__, "vitserve.service.")]
    for name in modules:
        importlib.import_module(name)
    from vitserve.service.app import create_app
    from vitserve.service.ground.settings import Settings
    create_app(Settings(model_path="unused.onnx")).openapi()
    from vitserve.cli import build_parser
    build_parser().parse_args(["serve", "--model", "m.onnx"])
    print(json.dumps({"modules": modules, "torch": "torch" in sys.modules, "onnx": "onnx" in sys.modules}))
""")


def test_service_imports_without_torch():
    """The serving world: no torch (nor the exporter's onnxscript); onnx is in it (protobuf work only)."""
    result = subprocess.run([sys.executable, "-c", BLOCK_TORCH], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert {f"vitserve.service.{name}" for name in ("app", "engine.batcher", "engine.runtime", "cli",
                                                    "http.routes.classify")} <= set(report["modules"])
    # onnx is a serving dependency since the server takes the artifact's If apart at load (graph_paths.py)
    assert report["torch"] is False and report["onnx"] is True
