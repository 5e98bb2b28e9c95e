"""Every call of the four unmodified tritonclient clients (http, http.aio, grpc, grpc.aio) against a real `vitserve
serve` with response compression on as it ships: health, metadata, configuration, statistics, the repository
index, unload and load, errors, and inference with each request and response compression the client offers.

The asyncio HTTP client is the one at risk: aiohttp sends `Accept-Encoding: gzip, deflate` on every request, while
the client reads every body raw (`auto_decompress=False`) and inflates only an infer answer, so a compressed
statistics, metadata or error body reaches it as gzip bytes (service/http/compression.py says which answers are
compressed). The servers: the shipped settings, and every answer past the size threshold (`compress_min_bytes` 0,
gRPC answers gzip), so that no call passes only because its answer happened to be small.
"""
from __future__ import annotations

import inspect

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_grpc_aio
import tritonclient.http as triton_http
import tritonclient.http.aio as triton_http_aio
from tritonclient.utils import InferenceServerException

from service_fixtures import PATIENCE_S, free_port, uvicorn_server

# slow: a server per compression setting, every call of the four tritonclient flavours against it
pytestmark = [pytest.mark.anyio, pytest.mark.slow]
MODEL, VERSION = "tiny", "1"  # the repository's one model
ADMIN = {"authorization": "Bearer admin"}
OUTPUTS = ("logits", "rollout")
HTTP_COMPRESSIONS = [(None, None), ("gzip", None), ("deflate", None), (None, "gzip"), (None, "deflate"),
                     ("gzip", "gzip"), ("deflate", "deflate")]  # (request, response)
GRPC_COMPRESSIONS = [None, "gzip", "deflate"]  # gRPC's `compression_algorithm` compresses the request
SERVERS = {"as-shipped": {}, "everything-past-the-threshold": {"VITSERVE_COMPRESS_MIN_BYTES": "0",
                                                                "VITSERVE_GRPC_RESPONSE_COMPRESSION": "gzip"}}


@pytest.fixture(scope="module", params=list(SERVERS))
def ports(request, tiny_onnx, tmp_path_factory):
    """(HTTP host:port, gRPC host:port) of a server with a repository of one model, loaded in explicit mode."""
    root = tmp_path_factory.mktemp("repository")
    (root / MODEL / VERSION).mkdir(parents=True)
    (root / MODEL / VERSION / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    grpc_port = free_port()
    with uvicorn_server(tiny_onnx, "--model-repository", str(root), "--model-control-mode", "explicit",
                        "--load-model", MODEL, "--grpc-port", str(grpc_port),
                        env={"VITSERVE_ADMIN_KEY": "admin", **SERVERS[request.param]}) as (base_url, _):
        yield base_url.removeprefix("http://"), f"127.0.0.1:{grpc_port}"


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    """The ONNX file run directly: (B, 3, H, W) pixels -> {"logits", "rollout"}."""
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    return lambda pixels: dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"pixel_values": pixels})))


async def answer(call, *args, **kwargs):
    """One client call, awaited when the client is an asyncio one."""
    result = call(*args, **kwargs)
    return await result if inspect.isawaitable(result) else result


async def refused(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await answer(call, *args, **kwargs)
    return caught.value


def pixel_input(module, array: np.ndarray, binary: bool):
    tensor = module.InferInput("pixel_values", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, **({"binary_data": binary} if module in (triton_http, triton_http_aio) else {}))
    return tensor


async def assert_health_metadata_and_statistics(client, as_json: dict) -> None:
    """Every read-only call, each answer's values exact. `as_json`: gRPC's `as_json=True`, {} on HTTP."""
    assert await answer(client.is_server_live) and await answer(client.is_server_ready)
    assert await answer(client.is_model_ready, MODEL) and await answer(client.is_model_ready, MODEL, VERSION)
    assert not await answer(client.is_model_ready, "nope")
    server = await answer(client.get_server_metadata, **as_json)
    assert server["name"] == "vitserve" and set(server["extensions"]) == {
        "binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"}
    for version in ("", VERSION):
        metadata = await answer(client.get_model_metadata, MODEL, version, **as_json)
        assert (metadata["name"], metadata["versions"]) == (MODEL, [VERSION])
        assert [t["name"] for t in metadata["inputs"]] == ["pixel_values", "image"]
        config = await answer(client.get_model_config, MODEL, version, **as_json)
        config = config.get("config", config)  # gRPC wraps it
        assert (config["name"], [t["name"] for t in config["input"]]) == (MODEL, ["pixel_values", "image"])
    for args in ((), (MODEL,), (MODEL, VERSION)):
        statistics = await answer(client.get_inference_statistics, *args, **as_json)
        assert [(s["name"], s["version"]) for s in statistics["model_stats"]] == [(MODEL, VERSION)]
    error = await refused(client.get_model_metadata, "nope", **as_json)
    assert "'nope'" in error.message(), error.message()  # the error's body read as the server sent it


async def index(client, as_json: dict) -> list[tuple]:
    models = await answer(client.get_model_repository_index, headers=ADMIN, **as_json)
    return [(m["name"], m.get("version"), m.get("state")) for m in (models["models"] if as_json else models)]


async def assert_unload_and_load(client, as_json: dict) -> None:
    assert await index(client, as_json) == [(MODEL, VERSION, "READY")]
    await answer(client.unload_model, MODEL, headers=ADMIN)
    assert not await answer(client.is_model_ready, MODEL)
    assert await index(client, as_json) == [(MODEL, VERSION, "UNAVAILABLE")]
    await answer(client.load_model, MODEL, headers=ADMIN)
    assert await answer(client.is_model_ready, MODEL) and await index(client, as_json) == [(MODEL, VERSION, "READY")]


def assert_outputs(result, expected: dict) -> None:
    for name in OUTPUTS:
        np.testing.assert_allclose(result.as_numpy(name), expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("module", [triton_http, triton_http_aio], ids=["http", "http.aio"])
async def test_every_http_call(ports, reference, module):
    client = module.InferenceServerClient(ports[0], **({"network_timeout": PATIENCE_S} if module is triton_http else
                                                       {"conn_timeout": PATIENCE_S}))
    try:
        await assert_http_inference(client, module, reference)
        # every batch size 1-8 has run: the statistics, one entry per size, are past compress_min_bytes (1 KiB)
        assert len(httpx.get(f"http://{ports[0]}/v2/models/stats", timeout=PATIENCE_S).content) > 1024
        await assert_health_metadata_and_statistics(client, {})
        await assert_unload_and_load(client, {})
    finally:
        await answer(client.close)


async def assert_http_inference(client, module, reference) -> None:
    """Each request and response compression, JSON and binary tensors, batches of 1 to 8 (answers up to 3 KB;
    at the trained size, so that no batch is split by the batcher's cost bound)."""
    combinations = [(binary, *codings) for binary in (False, True) for codings in HTTP_COMPRESSIONS]
    for i, (binary, request, response) in enumerate(combinations):
        array = np.random.default_rng(i).normal(size=(1 + i % 8, 3, 32, 32)).astype(np.float32)
        outputs = [module.InferRequestedOutput(name, binary_data=binary) for name in OUTPUTS]
        result = await answer(client.infer, MODEL, [pixel_input(module, array, binary)], outputs=outputs,
                              request_compression_algorithm=request, response_compression_algorithm=response)
        assert_outputs(result, reference(array))
    error = await refused(client.infer, "nope", [pixel_input(module, array, True)],
                          response_compression_algorithm="gzip")
    assert error.status() == "404" and "'nope'" in error.message(), error.message()


@pytest.mark.parametrize("module", [triton_grpc, triton_grpc_aio], ids=["grpc", "grpc.aio"])
async def test_every_grpc_call(ports, reference, module):
    client = module.InferenceServerClient(ports[1])
    try:
        await assert_health_metadata_and_statistics(client, {"as_json": True})
        await assert_unload_and_load(client, {"as_json": True})
        array = np.random.default_rng(4).normal(size=(8, 3, 32, 32)).astype(np.float32)
        outputs = [module.InferRequestedOutput(name) for name in OUTPUTS]
        for algorithm in GRPC_COMPRESSIONS:
            result = await answer(client.infer, MODEL, [pixel_input(module, array, True)], outputs=outputs,
                                  compression_algorithm=algorithm)
            assert_outputs(result, reference(array))
        error = await refused(client.infer, "nope", [pixel_input(module, array, True)])
        assert error.status() == "StatusCode.NOT_FOUND" and "'nope'" in error.message(), error.message()
    finally:
        await answer(client.close)
