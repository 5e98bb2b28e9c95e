"""A load or unload answers only once every HTTP worker routes as it says, and a version loaded again starts its
statistics and metric series from zero: a real `vitserve serve` with two HTTP workers and an engine process,
driven by tritonclient (HTTP and gRPC), unmodified. Every check after a load or unload goes out on a new
connection, which either worker may accept: the worker that did not answer the load is the one that could lag.

Also here: the log line of a load names the repository's model and version, and an unknown model's error lists
the loaded ones (bounded)."""
from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.http as triton

from vitserve.service.ground.errors import ModelNotFound
from vitserve.service.engine.routing import RoutingTable, VersionView
from service_fixtures import (PATIENCE_S, RawConnection, free_port, samples, serving, settings_for, uvicorn_server,
                              value)

ADMIN = {"Authorization": "Bearer admin-key"}
ADMIN_GRPC = {"authorization": "Bearer admin-key"}  # gRPC metadata keys are lower case
MODEL = "m"
CYCLES = 20  # each an unload (the engine's half-second retire grace) and a load of a new version


def add_version(root: Path, model_file: Path, version: int, name: str = MODEL) -> None:
    folder = root / name / str(version)
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model_file, folder / "model.onnx")


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory, tiny_onnx):
    """(HTTP url, gRPC address, repository root, the next version number to add)."""
    root = tmp_path_factory.mktemp("workers") / "repo"
    add_version(root, tiny_onnx, 1)
    (root / MODEL / "config.json").write_text(json.dumps({"version_policy": {"latest": {"num_versions": 1}}}))
    grpc_port = free_port()
    with uvicorn_server(tiny_onnx, "--model-repository", str(root), "--model-control-mode", "explicit",
                        "--load-model", MODEL, "--grpc-port", str(grpc_port), "--engine", "process", workers=2,
                        env={"VITSERVE_ADMIN_KEY": "admin-key"}) as (url, _):
        yield url, f"127.0.0.1:{grpc_port}", root, [2]


def pixels_input(module=triton):
    tensor = module.InferInput("pixel_values", [1, 3, 32, 32], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float32))
    return tensor


def fresh_http(url: str):
    """A tritonclient of its own: its own connection, accepted by whichever worker takes it."""
    return triton.InferenceServerClient(url.removeprefix("http://"), network_timeout=PATIENCE_S)


READY = f"GET /v2/models/{MODEL}/ready HTTP/1.1\r\nHost: t\r\n\r\n".encode()
_TENSOR = json.dumps({"inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32",
                                  "data": [0.0] * 3 * 32 * 32}]}).encode()
INFER = (f"POST /v2/models/{MODEL}/infer HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
         f"Content-Length: {len(_TENSOR)}\r\n\r\n").encode() + _TENSOR


def open_connections(url: str, count: int = 4) -> list[RawConnection]:
    """`count` kept-alive connections, each accepted (and answered once) by whichever worker took it: the
    requests sent on them after a load reach the workers at once, with no connection to set up first."""
    connections = [RawConnection(int(url.rsplit(":", 1)[1])) for _ in range(count)]
    for connection in connections:
        connection.send(b"GET /v2/health/live HTTP/1.1\r\nHost: t\r\n\r\n")
    for connection in connections:
        assert connection.response().status == 200
    return connections


def views(connections: list[RawConnection]) -> list[tuple[int, int, str]]:
    """Each connection's (ready status, infer status, the version that answered): every request sent before any
    answer is read, so each reaches its worker right after the load or unload answered."""
    for connection in connections:
        connection.send(READY + INFER)
    seen = []
    for connection in connections:
        ready, infer = connection.response(), connection.response()
        seen.append((ready.status, infer.status, json.loads(infer.body).get("model_version", "")))
    return seen


@pytest.mark.slow
def test_every_worker_routes_as_a_load_or_unload_said_when_it_answers(two_workers, tiny_onnx):
    url, _, root, versions = two_workers
    admin = fresh_http(url)
    early_loads, late_unloads, checks = [], [], 0
    try:
        for _ in range(CYCLES):
            connections = open_connections(url)
            admin.unload_model(MODEL, headers=ADMIN)
            late_unloads += [seen for seen in views(connections) if 200 in seen[:2]]
            version = str(versions[0])
            versions[0] += 1
            add_version(root, tiny_onnx, int(version))
            admin.load_model(MODEL, headers=ADMIN)
            early_loads += [seen for seen in views(connections) if seen != (200, 200, version)]
            checks += len(connections)
            for connection in connections:
                connection.sock.close()
    finally:
        admin.close()
    assert late_unloads == [], f"{len(late_unloads)} of {checks} checks after an unload still served it"
    assert early_loads == [], f"{len(early_loads)} of {checks} checks after a load did not see it: {early_loads[:5]}"


@pytest.mark.slow
def test_grpc_model_ready_right_after_each_load_and_unload(two_workers, tiny_onnx):
    _, address, root, versions = two_workers
    wrong, checks = [], 0
    with triton_grpc.InferenceServerClient(address) as admin:
        for _ in range(CYCLES // 2):
            clients = [triton_grpc.InferenceServerClient(address) for _ in range(4)]  # a channel each: either worker
            try:
                assert all(client.is_server_live() for client in clients)  # connected before the change
                admin.unload_model(MODEL, headers=ADMIN_GRPC)
                wrong += ["ready after unload" for client in clients if client.is_model_ready(MODEL)]
                version = str(versions[0])
                versions[0] += 1
                add_version(root, tiny_onnx, int(version))
                admin.load_model(MODEL, headers=ADMIN_GRPC)
                wrong += [f"version {version} not ready after its load" for client in clients
                          if not client.is_model_ready(MODEL)]
                answered = {c.infer(MODEL, [pixels_input(triton_grpc)]).get_response().model_version for c in clients}
                wrong += [f"answered by {answered} after {version} loaded"] if answered != {version} else []
                checks += 2 * len(clients)
            finally:
                for client in clients:
                    client.close()
    assert wrong == [], f"{len(wrong)} of {checks} gRPC checks wrong: {wrong[:5]}"


@pytest.mark.slow
def test_a_version_loaded_again_starts_its_statistics_and_series_from_zero(two_workers, tiny_onnx):
    url, _, root, versions = two_workers
    client = fresh_http(url)
    try:
        version = str(versions[0])
        versions[0] += 1
        add_version(root, tiny_onnx, int(version))
        client.load_model(MODEL, headers=ADMIN)  # a version never loaded before: counts from zero
        for _ in range(3):
            client.infer(MODEL, [pixels_input()])
        assert _statistics(url, version)["inference_count"] == 3
        series = _series(url, version)
        assert value(series, "vitserve_images_total") == 3
        client.unload_model(MODEL, headers=ADMIN)
        assert _series(url, version) == {}  # an unloaded version exports nothing
        client.load_model(MODEL, headers=ADMIN)
        stats = _statistics(url, version)
    finally:
        client.close()
    assert (stats["inference_count"], stats["execution_count"], stats["last_inference"]) == (0, 0, 0)
    assert stats["inference_stats"]["success"] == {"count": 0, "ns": 0} and stats["batch_stats"] == []
    series = _series(url, version)
    counted = {k: v for k, v in series.items() if v and not k[0].startswith(("vitserve_model_ready",
                                                                              "vitserve_model_info"))}
    assert series and counted == {}, counted  # exported again, every count from zero


def _statistics(url: str, version: str) -> dict:
    answer = httpx.get(f"{url}/v2/models/{MODEL}/versions/{version}/stats", timeout=PATIENCE_S)
    assert answer.status_code == 200, answer.text
    return answer.json()["model_stats"][0]


def _series(url: str, version: str) -> dict:
    """The scrape's samples of `m` `version` (by a new connection: either worker)."""
    scraped = samples(httpx.get(f"{url}/metrics", timeout=PATIENCE_S).text)
    return {k: v for k, v in scraped.items()
            if dict(k[1]).get("version") == version and MODEL in (dict(k[1]).get("model"), dict(k[1]).get("name"))}


# --- messages ---

@pytest.mark.anyio
async def test_a_load_logs_the_repositorys_name_and_version_and_the_files_in_brackets(tmp_path, tiny_onnx, caplog):
    root = tmp_path / "repo"
    add_version(root, tiny_onnx, 2, name="fmnist")
    settings = settings_for(root / "unused.onnx", model_repository=root, model_control_mode="explicit",
                            load_models=["fmnist"])
    with caplog.at_level(logging.INFO, logger="vitserve"):
        async with serving(settings):
            pass
    loaded = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded ")]
    assert len(loaded) == 1 and loaded[0].startswith("loaded fmnist version 2 (file: tiny-vit 7, "), loaded


def test_an_unknown_models_error_lists_the_loaded_ones_bounded():
    def table(names):
        return RoutingTable({(n, "1"): VersionView("READY") for n in names})
    with pytest.raises(ModelNotFound, match=r"^no model named 'vit' is loaded; loaded: vit-fmnist$"):
        table(["vit-fmnist"]).route("vit")
    many = [f"model-{i:02d}" for i in range(25)]
    with pytest.raises(ModelNotFound) as caught:
        table(many).route("vit")
    assert str(caught.value).endswith("loaded: " + ", ".join(many[:10]) + " and 15 more")
    with pytest.raises(ModelNotFound, match=r"^no model named 'vit' is loaded; no model is$"):
        table([]).route("vit")
