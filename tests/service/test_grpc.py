"""tritonclient[grpc], unmodified from PyPI, against a real `vitserve serve` process on its gRPC port: every RPC,
inference with raw and typed tensors, classification, the image input, the relevance output, errors with their
status codes, deadlines, overload, the message-size limit, keys, concurrency, and hostile connections.

Answers are checked against the ONNX file run by ONNX Runtime, and against the same server's HTTP answers
(tritonclient.http, /v1/classify): the two transports must agree. Typed `contents` and trailing metadata are
not reachable through tritonclient's client class, so those tests call tritonclient's own generated stub.
"""
from __future__ import annotations

import asyncio
import os
import socket
import time

import grpc
import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.grpc as triton_grpc
import tritonclient.grpc.aio as triton_grpc_aio
import tritonclient.http as triton_http
from tritonclient.grpc import service_pb2, service_pb2_grpc
from tritonclient.utils import InferenceServerException

from vitserve.service.ground.model_names import MAX_NAME_CHARS, MAX_VERSION_CHARS
from service_fixtures import (PATIENCE_S, WrappedModel, free_port, image_bytes, patterned_png, samples, settings_for,
                              until, uvicorn_server, value)

MODEL, VERSION = "tiny-vit", "7"
LABELS = ["cat", "dog", "bird"]
OUTPUTS = ("logits", "rollout")
TRAINED, OTHER = (32, 32), (16, 24)
MAX_BINARY_BYTES = 1 << 20  # the server's message limit: 1 MiB and the protocol's overhead


@pytest.fixture(scope="module")
def server(tiny_onnx):
    grpc_port = free_port()
    with uvicorn_server(tiny_onnx, "--grpc-port", str(grpc_port), "--max-binary-body-bytes",
                        str(MAX_BINARY_BYTES)) as (base_url, process):
        yield base_url, f"127.0.0.1:{grpc_port}", process


@pytest.fixture(scope="module")
def client(server):
    with triton_grpc.InferenceServerClient(server[1]) as client:
        yield client


@pytest.fixture(scope="module")
def http_client(server):
    with triton_http.InferenceServerClient(server[0].removeprefix("http://"), network_timeout=PATIENCE_S) as client:
        yield client


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    return lambda pixels: dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"pixel_values": pixels})))


def pixels(batch: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, *size)).astype(np.float32)


def pixel_input(array: np.ndarray) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("pixel_values", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array)
    return tensor


def image_input(images: list[bytes], shape: list[int]) -> triton_grpc.InferInput:
    tensor = triton_grpc.InferInput("image", shape, "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object).reshape(shape))
    return tensor


def refused(call, *args, **kwargs) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    return caught.value


def assert_outputs(result, expected: dict[str, np.ndarray]) -> None:
    for name in OUTPUTS:
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and got.shape == expected[name].shape, (name, got.dtype, got.shape)
        np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def stub(address: str) -> tuple[grpc.Channel, service_pb2_grpc.GRPCInferenceServiceStub]:
    channel = grpc.insecure_channel(address)
    return channel, service_pb2_grpc.GRPCInferenceServiceStub(channel)


# --- health, metadata, configuration, statistics --------------------------------------------------------------------

def test_health_and_metadata(client, http_client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, VERSION)
    assert not client.is_model_ready(MODEL, "8") and not client.is_model_ready("nope")
    metadata = client.get_server_metadata(as_json=True)
    assert metadata["name"] == "vitserve" and set(metadata["extensions"]) == set(
        http_client.get_server_metadata()["extensions"])
    grpc_model = client.get_model_metadata(MODEL, as_json=True)
    http_model = http_client.get_model_metadata(MODEL)
    for kind in ("inputs", "outputs"):
        assert [(t["name"], t["datatype"], [int(d) for d in t["shape"]]) for t in grpc_model[kind]] == [
            (t["name"], t["datatype"], t["shape"]) for t in http_model[kind]]
    assert grpc_model["versions"] == [VERSION] and grpc_model["platform"] == "onnxruntime_onnx"


@pytest.mark.parametrize("version", ["", VERSION])
def test_model_config_is_the_http_config(client, http_client, version):
    config = client.get_model_config(MODEL, version, as_json=True)["config"]
    expected = http_client.get_model_config(MODEL, version)
    assert config["name"] == MODEL and config["max_batch_size"] == expected["max_batch_size"]
    assert [(t["name"], t["data_type"], [int(d) for d in t["dims"]]) for t in config["input"]] == [
        (t["name"], t["data_type"], t["dims"]) for t in expected["input"]]
    assert config["parameters"] == expected["parameters"]


def test_statistics_count_grpc_inferences(client, http_client):
    before = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    client.infer(MODEL, [pixel_input(pixels(3, TRAINED))])

    def successes() -> int:
        stats = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
        return int(stats["inference_stats"]["success"].get("count", 0))
    wanted = int(before["inference_stats"]["success"].get("count", 0)) + 1
    deadline = time.monotonic() + PATIENCE_S
    while successes() < wanted:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    after = client.get_inference_statistics(MODEL, as_json=True)["model_stats"][0]
    assert int(after["inference_count"]) - int(before.get("inference_count", 0)) == 3
    # the same numbers on HTTP: one view of the server
    assert http_client.get_inference_statistics(MODEL)["model_stats"][0]["inference_count"] >= int(
        after["inference_count"])
    assert [e["name"] for e in client.get_inference_statistics(as_json=True)["model_stats"]] == [MODEL]


# --- inference -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch, size", [(1, TRAINED), (4, TRAINED), (1, OTHER), (4, OTHER)])
def test_raw_tensors_match_onnx_runtime(client, reference, batch, size):
    array = pixels(batch, size, seed=batch)
    result = client.infer(MODEL, [pixel_input(array)], request_id="g-1")
    assert_outputs(result, reference(array))
    response = result.get_response()
    assert (response.model_name, response.model_version, response.id) == (MODEL, VERSION, "g-1")
    assert len(response.raw_output_contents) == len(response.outputs) == 2


@pytest.mark.parametrize("batch, size", [(1, TRAINED), (4, OTHER)])
def test_typed_contents_match_raw(server, reference, batch, size):
    """fp32_contents instead of raw_input_contents: the same answer."""
    array = pixels(batch, size, seed=20 + batch)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="pixel_values", datatype="FP32", shape=array.shape)
    tensor.contents.fp32_contents.extend(array.ravel().tolist())
    channel, calls = stub(server[1])
    with channel:
        response = calls.ModelInfer(request, timeout=PATIENCE_S)
    got = {o.name: np.frombuffer(raw, "<f4").reshape(o.shape) for o, raw in
           zip(response.outputs, response.raw_output_contents)}
    for name, expected in reference(array).items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("typed", [False, True], ids=["raw", "uint_contents"])
def test_uint8_pixels_raw_or_typed_are_normalised_by_the_server(server, reference, typed):
    from vitserve.artifact import normalize_pixels

    raw = np.random.default_rng(9).integers(0, 256, (2, 3, *TRAINED), dtype=np.uint8)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    tensor = request.inputs.add(name="pixel_values", datatype="UINT8", shape=raw.shape)
    if typed:
        tensor.contents.uint_contents.extend(raw.ravel().tolist())
    else:
        request.raw_input_contents.append(raw.tobytes())
    channel, calls = stub(server[1])
    with channel:
        response = calls.ModelInfer(request, timeout=PATIENCE_S)
        over = service_pb2.ModelInferRequest(model_name=MODEL)
        over.inputs.add(name="pixel_values", datatype="UINT8", shape=[1, 3, *TRAINED]).contents.uint_contents.extend(
            [256] * 3 * TRAINED[0] * TRAINED[1])
        with pytest.raises(grpc.RpcError) as caught:
            calls.ModelInfer(over, timeout=PATIENCE_S)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "256" in caught.value.details()
    got = {o.name: np.frombuffer(r, "<f4").reshape(o.shape) for o, r in
           zip(response.outputs, response.raw_output_contents)}
    for name, expected in reference(normalize_pixels(raw, [0.5] * 3, [0.25] * 3)).items():
        np.testing.assert_allclose(got[name], expected, rtol=1e-5, atol=1e-5)


def test_typed_and_raw_together_or_neither_are_invalid(server):
    channel, calls = stub(server[1])
    with channel:
        both = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[b"\0" * 4 * 3 * 32 * 32])
        both.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 32, 32]).contents.fp32_contents.extend(
            [0.0] * 3 * 32 * 32)
        neither = service_pb2.ModelInferRequest(model_name=MODEL)
        neither.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 32, 32])
        wrong_field = service_pb2.ModelInferRequest(model_name=MODEL)
        wrong_field.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 1, 1]).contents.int_contents.extend(
            [1, 2, 3])
        for request, words in ((both, "send one"), (neither, "no contents"), (wrong_field, "fp32_contents")):
            with pytest.raises(grpc.RpcError) as caught:
                calls.ModelInfer(request, timeout=PATIENCE_S)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and words in caught.value.details()


def _raw_request(**changes) -> service_pb2.ModelInferRequest:
    """A valid raw ModelInferRequest for one trained-size image, then `changes` applied to it."""
    request = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[b"\0" * 4 * 3 * 32 * 32])
    tensor = request.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 32, 32])
    for key, value in changes.get("parameters", {}).items():
        request.parameters[key].CopyFrom(value)
    if "id" in changes:
        request.id = changes["id"]
    if "name" in changes:
        tensor.name = changes["name"]
    if "datatype" in changes:
        tensor.datatype = changes["datatype"]
    if "shape" in changes:
        del tensor.shape[:]
        tensor.shape.extend(changes["shape"])
    for name in changes.get("outputs", []):
        request.outputs.add(name=name)
    return request


def test_the_protobuf_is_held_to_v2s_limits_without_its_json_models(server):
    """gRPC reads ModelInfer field by field (service/schemas/inference_protocol.py `checked_infer_request`), with the
    limits /v2's pydantic models hold for JSON: each one refused, naming the field."""
    from vitserve.service.schemas.v2 import (MAX_DIM, MAX_ID_CHARS, MAX_OUTPUTS, MAX_PARAMETER_KEY_CHARS,
                                                    MAX_PARAMETER_STRING_CHARS, MAX_PARAMETERS)
    string = service_pb2.InferParameter
    cases = [
        ({"id": "x" * (MAX_ID_CHARS + 1)}, f"at most {MAX_ID_CHARS}"),
        ({"parameters": {f"p{i}": string(int64_param=i) for i in range(MAX_PARAMETERS + 1)}},
         f"at most {MAX_PARAMETERS} entries"),
        ({"parameters": {"k" * (MAX_PARAMETER_KEY_CHARS + 1): string(bool_param=True)}}, "a key is at most"),
        ({"parameters": {"p": string(string_param="x" * (MAX_PARAMETER_STRING_CHARS + 1))}}, "parameters.p"),
        ({"parameters": {"p": string(double_param=float("nan"))}}, "finite number"),
        ({"parameters": {"p": string()}}, "a parameter must be"),
        ({"name": "attention"}, "inputs.0.name"),
        ({"datatype": "INT64"}, "inputs.0.datatype"),
        ({"shape": [1, 3, 32, 0]}, "inputs.0.shape"),
        ({"shape": [1, 3, 32, MAX_DIM + 1]}, "inputs.0.shape"),
        ({"shape": [1, 1, 3, 32, 32]}, "inputs.0.shape"),
        ({"outputs": ["attention"]}, "outputs.0.name"),
        ({"outputs": ["logits"] * (MAX_OUTPUTS + 1)}, f"at most {MAX_OUTPUTS}"),
    ]
    channel, calls = stub(server[1])
    with channel:
        for changes, words in cases:
            with pytest.raises(grpc.RpcError) as caught:
                calls.ModelInfer(_raw_request(**changes), timeout=PATIENCE_S)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (changes, caught.value)
            assert words in caught.value.details(), (words, caught.value.details())
        answer = calls.ModelInfer(_raw_request(outputs=["logits", "rollout", "relevance", "embedding"]),
                                  timeout=PATIENCE_S)  # every output the file has, in one request
        assert [o.name for o in answer.outputs] == ["logits", "rollout", "relevance", "embedding"]


def test_typed_contents_past_the_value_limit_are_refused_for_raw(tiny_onnx):
    """Typed values convert one by one on the event loop: past the JSON value limit they are refused, naming the
    raw form, before any is converted."""
    from vitserve.service.grpc.messages import parsed_from_grpc
    from vitserve.service.schemas.inference_protocol import ProtocolLimits
    limits = ProtocolLimits(max_json_bytes=2**20, max_json_values=1000, max_batch=32, max_image_bytes=2**20,
                            channels=3, patch_size=8, max_tokens=1024)
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="pixel_values", datatype="FP32", shape=[1, 3, 32, 32]).contents.fp32_contents.extend(
        [0.0] * 3 * 32 * 32)
    from vitserve.service.ground.errors import PayloadTooLarge
    with pytest.raises(PayloadTooLarge, match="raw_input_contents"):
        parsed_from_grpc(request, limits)
    small = ProtocolLimits(**{**limits.__dict__, "max_json_values": 4096})
    assert parsed_from_grpc(request, small).pixels.shape == (1, 3, 32, 32)


def test_typed_bytes_contents_carry_images(server, client):
    image = patterned_png((48, 40))
    request = service_pb2.ModelInferRequest(model_name=MODEL)
    request.inputs.add(name="image", datatype="BYTES", shape=[1]).contents.bytes_contents.append(image)
    channel, calls = stub(server[1])
    with channel:
        response = calls.ModelInfer(request, timeout=PATIENCE_S)
    raw = client.infer(MODEL, [image_input([image], [1])]).as_numpy("logits")
    np.testing.assert_allclose(np.frombuffer(response.raw_output_contents[0], "<f4").reshape(1, 3), raw, atol=1e-6)


@pytest.mark.parametrize("shape", [[2], [2, 1]], ids=["B", "Bx1"])
def test_image_input_matches_v1_classify(server, client, shape):
    images = [patterned_png((48, 40)), image_bytes("PNG", size=(20, 36), color=(10, 200, 90))]
    logits = client.infer(MODEL, [image_input(images, shape)]).as_numpy("logits")
    assert logits.shape == (2, 3)
    for image, row in zip(images, logits):
        answer = httpx.post(f"{server[0]}/v1/classify", content=image, headers={"content-type": "image/png"},
                            timeout=PATIENCE_S).json()
        scores = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        np.testing.assert_allclose([p["score"] for p in answer["predictions"]],
                                   scores[[p["index"] for p in answer["predictions"]]], atol=1e-6)


def test_classification_strings_equal_the_http_ones(client, http_client):
    array = pixels(4, TRAINED, seed=7)
    grpc_result = client.infer(MODEL, [pixel_input(array)], outputs=[
        triton_grpc.InferRequestedOutput("logits", class_count=3)])
    http_input = triton_http.InferInput("pixel_values", list(array.shape), "FP32")
    http_input.set_data_from_numpy(array, binary_data=True)
    http_result = http_client.infer(MODEL, [http_input], outputs=[
        triton_http.InferRequestedOutput("logits", binary_data=True, class_count=3)])
    got = grpc_result.as_numpy("logits")
    assert got.shape == (4, 3) and got.tolist() == http_result.as_numpy("logits").tolist()
    assert all(entry.decode().split(":")[2] in LABELS for entry in got.ravel())


def test_relevance_output_with_a_target(client, tiny_onnx):
    array = pixels(2, OTHER, seed=11)
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    outputs = [triton_grpc.InferRequestedOutput(name) for name in ("logits", "relevance")]
    for target, index in (("dog", 1), (2, 2)):
        result = client.infer(MODEL, [pixel_input(array)], outputs=outputs, parameters={"target": target})
        want = session.run(["relevance"], {"pixel_values": array, "target_class": np.full(2, index)})[0]
        np.testing.assert_allclose(result.as_numpy("relevance"), want, rtol=0, atol=1e-6)
    error = refused(client.infer, MODEL, [pixel_input(array)], parameters={"target": "dog"})
    assert "StatusCode.INVALID_ARGUMENT" in error.status() and "request the relevance output" in error.message()


# --- errors --------------------------------------------------------------------------------------------------------

def test_errors_have_tritons_status_codes(client):
    array = pixels(1, TRAINED)
    cases = [
        ((client.infer, "nope", [pixel_input(array)]), "NOT_FOUND", "'nope'"),
        ((client.get_model_metadata, "nope"), "NOT_FOUND", "'nope'"),
        ((client.get_model_config, MODEL, "8"), "NOT_FOUND", "'8'"),
        ((client.infer, MODEL, [pixel_input(pixels(1, (12, 16)))]), "INVALID_ARGUMENT", "multiples of 8"),
        ((client.infer, MODEL, [pixel_input(np.zeros((1, 1, 32, 32), np.float32))]), "INVALID_ARGUMENT", "3 channels"),
        ((client.infer, MODEL, [image_input([patterned_png(), b"not an image"], [2])]), "INVALID_ARGUMENT", "item 1"),
        ((client.infer, "../etc", [pixel_input(array)]), "NOT_FOUND", "../etc"),  # routing only looks names up
        ((client.infer, "x" * 10_000, [pixel_input(array)]), "INVALID_ARGUMENT", "at most"),
        # the names /v1 and the repository allow, no longer: a name longer than any served is refused, not looked up
        ((client.infer, "x" * (MAX_NAME_CHARS + 1), [pixel_input(array)]), "INVALID_ARGUMENT",
         f"at most {MAX_NAME_CHARS} characters"),
        ((client.infer, MODEL, [pixel_input(array)], "9" * (MAX_VERSION_CHARS + 1)), "INVALID_ARGUMENT",
         f"versions at most {MAX_VERSION_CHARS}"),
        ((client.infer, "", [pixel_input(array)]), "INVALID_ARGUMENT", "name the model"),
    ]
    for (call, *args), code, words in cases:
        error = refused(call, *args)
        assert error.status() == f"StatusCode.{code}", (args[:1], error)
        assert words in error.message(), error.message()
    assert client.is_server_ready()


def test_unimplemented_rpcs_say_so(client, server):
    calls = [(client.get_system_shared_memory_status, "SystemSharedMemoryStatus"),
             (client.get_cuda_shared_memory_status, "CudaSharedMemoryStatus"),
             (client.unregister_system_shared_memory, "SystemSharedMemoryUnregister"),
             (client.get_trace_settings, "TraceSetting"), (client.get_log_settings, "LogSettings")]
    for call, name in calls:
        error = refused(call)
        assert error.status() == "StatusCode.UNIMPLEMENTED" and f"{name} is not served by vitserve" in error.message()
    # counted as the client's (a status of their own), not as an unhandled error of the server's
    parsed = samples(httpx.get(f"{server[0]}/metrics", timeout=PATIENCE_S).text)
    assert value(parsed, "vitserve_request_duration_seconds_count", protocol="grpc",
                 endpoint="/inference.GRPCInferenceService/LogSettings", status="UNIMPLEMENTED") >= 1


def test_a_short_grpc_deadline_is_deadline_exceeded_and_the_server_goes_on(client, reference):
    error = refused(client.infer, MODEL, [pixel_input(pixels(16, TRAINED))], client_timeout=1e-4)
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED"
    error = refused(client.infer, MODEL, [pixel_input(pixels(1, TRAINED))], timeout=1)  # 1 us: the server's own
    assert error.status() == "StatusCode.DEADLINE_EXCEEDED" and "deadline" in error.message()
    array = pixels(1, TRAINED, seed=3)
    assert_outputs(client.infer(MODEL, [pixel_input(array)]), reference(array))


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_a_message_over_the_limit_is_refused_unbuffered(server, client):
    """A 32 MiB message against the 1 MiB limit: grpcio refuses it from its length prefix (RESOURCE_EXHAUSTED),
    and the worker's memory does not grow by the message."""
    process = server[2]
    before = rss_bytes(process.pid)
    huge = np.zeros((8, 3, 512, 512), np.float32)  # 24 MiB
    for _ in range(3):
        error = refused(client.infer, MODEL, [pixel_input(huge)])
        assert error.status() == "StatusCode.RESOURCE_EXHAUSTED" and "larger than max" in error.message()
    assert rss_bytes(process.pid) - before < 16 * 2**20
    assert client.is_server_ready()


# --- concurrency ---------------------------------------------------------------------------------------------------

@pytest.mark.anyio
async def test_16_concurrent_asyncio_calls_each_get_their_own_answer(server, reference):
    arrays = [pixels(1 + i % 4, TRAINED if i % 2 else OTHER, seed=100 + i) for i in range(16)]
    async with triton_grpc_aio.InferenceServerClient(server[1]) as client:
        assert await client.is_server_ready()
        results = await asyncio.gather(*(client.infer(MODEL, [pixel_input(a)], request_id=f"q{i}")
                                         for i, a in enumerate(arrays)))
    for i, (array, result) in enumerate(zip(arrays, results)):
        assert result.get_response().id == f"q{i}"
        assert_outputs(result, reference(array))


def test_metrics_carry_the_protocol(server, client):
    client.infer(MODEL, [pixel_input(pixels(1, TRAINED))])
    parsed = samples(httpx.get(f"{server[0]}/metrics", timeout=PATIENCE_S).text)
    assert value(parsed, "vitserve_request_duration_seconds_count", protocol="grpc",
                 endpoint="/inference.GRPCInferenceService/ModelInfer", status="OK", model=MODEL) >= 1
    assert value(parsed, "vitserve_request_duration_seconds_count", protocol="grpc",
                 status="NOT_FOUND") >= 0  # the label exists for errors too (counted when they happen)
    assert value(parsed, "vitserve_request_duration_seconds_count", protocol="http") >= 1


# --- hostile connections -------------------------------------------------------------------------------------------

def _raw(address: str, data: bytes) -> bytes:
    host, port = address.split(":")
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(data)
        connection.settimeout(5)
        try:
            return connection.recv(4096)
        except (TimeoutError, ConnectionResetError):
            return b""


def test_garbage_and_http1_on_the_grpc_port(server, client):
    for data in (os.urandom(4096), b"GET / HTTP/1.1\r\nHost: x\r\n\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 64):
        answer = _raw(server[1], data)
        assert not answer.startswith(b"HTTP/1.1 200")
    assert client.is_server_ready()


def test_a_thousand_idle_streams_cost_bounded_memory(server, client, reference):
    """One HTTP/2 connection opens 1,000 streams (headers of ModelInfer, no message) and holds them: the server
    lets 100 open (grpc_max_concurrent_streams), its memory stays bounded, and other clients are served."""
    h2 = pytest.importorskip("h2.connection")
    import h2.config
    process = server[2]
    before = rss_bytes(process.pid)
    host, port = server[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    connection.initiate_connection()
    sock.sendall(connection.data_to_send())
    headers = [(":method", "POST"), (":scheme", "http"), (":path", "/inference.GRPCInferenceService/ModelInfer"),
               (":authority", server[1]), ("content-type", "application/grpc"), ("te", "trailers")]
    sent = 0
    for _ in range(1000):
        stream = connection.get_next_available_stream_id()
        try:
            connection.send_headers(stream, headers)
        except Exception:  # the server's SETTINGS capped the streams: h2 refuses to open more
            break
        sent += 1
        sock.sendall(connection.data_to_send())
        if sent == 1:  # the server's SETTINGS arrive
            connection.receive_data(sock.recv(65536))
    try:
        array = pixels(1, TRAINED, seed=4)
        assert_outputs(client.infer(MODEL, [pixel_input(array)]), reference(array))
        assert rss_bytes(process.pid) - before < 64 * 2**20
        assert connection.remote_settings.max_concurrent_streams == 100 or sent <= 100
    finally:
        sock.close()
    assert client.is_server_ready()


def test_huge_metadata_is_refused_and_the_server_goes_on(client):
    error = refused(client.is_model_ready, MODEL, headers={"x-big": "a" * 100_000})
    assert "StatusCode" in error.status()
    assert client.is_server_ready() and client.is_model_ready(MODEL)


# --- in process: overload, keys and the repository RPCs ------------------------------------------------------------

@pytest.mark.anyio
async def test_overload_is_resource_exhausted_with_a_retry_hint(tiny_onnx, tiny_model):
    from vitserve.service.app import create_app
    wrapped = WrappedModel(tiny_model)
    port = free_port()
    settings = settings_for(tiny_onnx, grpc_port=port, max_requests_in_flight=1, retry_after_s=3)
    app = create_app(settings, model=wrapped, serve_grpc=True)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            calls = service_pb2_grpc.GRPCInferenceServiceStub(channel)
            array = pixels(1, TRAINED)
            request = service_pb2.ModelInferRequest(model_name=MODEL, raw_input_contents=[array.tobytes()])
            request.inputs.add(name="pixel_values", datatype="FP32", shape=array.shape)
            wrapped.hold()
            held = asyncio.ensure_future(calls.ModelInfer(request, timeout=PATIENCE_S))
            await until(lambda: wrapped.entered, "the first call reached the model")
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await calls.ModelInfer(request, timeout=PATIENCE_S)
            error = caught.value
            assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in flight" in error.details()
            assert ("retry-after", "3") in tuple(error.trailing_metadata())
            # a deadline shorter than the held call: the client hears DEADLINE_EXCEEDED, the server goes on
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await calls.ModelInfer(request, timeout=0.2)
            assert caught.value.code() in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.RESOURCE_EXHAUSTED)
            wrapped.release()
            answer = await held
            assert answer.model_name == MODEL and len(answer.raw_output_contents) == 2


@pytest.mark.anyio
async def test_keys_travel_as_metadata(tiny_onnx, tiny_model):
    from vitserve.service.app import create_app
    port = free_port()
    settings = settings_for(tiny_onnx, grpc_port=port, api_key="secret-key")
    app = create_app(settings, model=tiny_model, serve_grpc=True)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        async with triton_grpc_aio.InferenceServerClient(f"127.0.0.1:{port}") as client:
            assert await client.is_server_live() and await client.is_server_ready()  # open, as /v2/health
            for headers, code in (({}, "UNAUTHENTICATED"), ({"authorization": "Bearer wrong"}, "PERMISSION_DENIED"),
                                  ({"authorization": "Basic secret-key"}, "UNAUTHENTICATED")):
                with pytest.raises(InferenceServerException) as caught:
                    await client.infer(MODEL, [pixel_input(pixels(1, TRAINED))], headers=headers)
                assert caught.value.status() == f"StatusCode.{code}"
            result = await client.infer(MODEL, [pixel_input(pixels(1, TRAINED))],
                                        headers={"authorization": "Bearer secret-key"})
            assert result.as_numpy("logits").shape == (1, 3)


@pytest.mark.slow
def test_repository_rpcs(tiny_onnx, tmp_path):
    root = tmp_path / "repo"
    for version in ("1", "2"):
        (root / "tiny" / version).mkdir(parents=True)
        (root / "tiny" / version / "model.onnx").write_bytes(tiny_onnx.read_bytes())
    grpc_port = free_port()
    with uvicorn_server(tiny_onnx, "--model-repository", str(root), "--model-control-mode", "explicit",
                        "--load-model", "tiny", "--grpc-port", str(grpc_port),
                        env={"VITSERVE_ADMIN_KEY": "admin"}) as _:
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            key = {"authorization": "Bearer admin"}
            assert refused(client.get_model_repository_index).status() == "StatusCode.UNAUTHENTICATED"
            index = client.get_model_repository_index(headers=key, as_json=True)["models"]
            assert {(m["name"], m.get("version"), m.get("state")) for m in index} >= {("tiny", "1", "READY")} or \
                {(m["name"], m.get("version"), m.get("state")) for m in index} >= {("tiny", "2", "READY")}
            client.unload_model("tiny", headers=key)
            assert not client.is_model_ready("tiny")
            client.load_model("tiny", headers=key)
            assert client.is_model_ready("tiny")
            error = refused(client.load_model, "../x", headers=key)
            assert error.status() == "StatusCode.INVALID_ARGUMENT"
            error = refused(client.load_model, "tiny", headers=key, config='{"max_batch_size": 2}')
            assert error.status() == "StatusCode.INVALID_ARGUMENT" and "not supported" in error.message()


# --- TLS, drain, the stubs, the command line ------------------------------------------------------------------------

def _openssl(*args: str) -> None:
    import subprocess
    subprocess.run(["openssl", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def certificates(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, both signed by the CA (openssl)."""
    import shutil
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed (.ci/run installs it)")
    d = tmp_path_factory.mktemp("tls")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=test-ca",
             "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))
    for name, extension in (("server", "subjectAltName=IP:127.0.0.1"), ("client", "extendedKeyUsage=clientAuth")):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", str(d / f"{name}.key"),
                 "-out", str(d / f"{name}.csr"))
        (d / f"{name}.ext").write_text(extension + "\n")
        _openssl("x509", "-req", "-in", str(d / f"{name}.csr"), "-CA", str(d / "ca.pem"), "-CAkey", str(d / "ca.key"),
                 "-CAcreateserial", "-days", "2", "-extfile", str(d / f"{name}.ext"), "-out", str(d / f"{name}.pem"))
    return d


@pytest.mark.slow
def test_tls_on_http_and_grpc_and_mutual_tls(tiny_onnx, certificates):
    d = certificates
    grpc_port = free_port()
    flags = ["--grpc-port", str(grpc_port), "--ssl-certfile", str(d / "server.pem"), "--ssl-keyfile",
             str(d / "server.key"), "--ssl-ca-certs", str(d / "ca.pem")]
    # the fixture waits for readiness over plain HTTP: a TLS server is waited for here
    import subprocess, sys
    from service_fixtures import REPO, wait_until
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "vitserve.cli", "serve", "--model", str(tiny_onnx), "--port",
                                str(port), "--providers", "cpu", "--workers", "1", "--log-level", "warning", *flags],
                               cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    ca, cert = str(d / "ca.pem"), (str(d / "client.pem"), str(d / "client.key"))
    try:
        def https_ready() -> bool:
            assert process.poll() is None, process.stdout.read().decode()
            try:
                import ssl
                context = ssl.create_default_context(cafile=ca)
                context.load_cert_chain(*cert)
                return httpx.get(f"https://127.0.0.1:{port}/v2/health/ready", verify=context, timeout=5).is_success
            except httpx.TransportError:
                return False
        wait_until(https_ready, "the TLS server ready")
        with pytest.raises(httpx.TransportError):  # no client certificate: the handshake fails
            import ssl
            httpx.get(f"https://127.0.0.1:{port}/v2/health/ready", verify=ssl.create_default_context(cafile=ca),
                      timeout=5)
        with pytest.raises(httpx.TransportError):  # plain text to a TLS port
            httpx.get(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5)
        root, chain, key = (open(p, "rb").read() for p in (ca, *cert))
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}", ssl=True, root_certificates=ca,
                                               private_key=cert[1], certificate_chain=cert[0]) as client:
            assert client.is_server_ready()
            assert client.infer(MODEL, [pixel_input(pixels(1, TRAINED))]).as_numpy("logits").shape == (1, 3)
        credentials = grpc.ssl_channel_credentials(root_certificates=root)  # TLS, but no client certificate
        with grpc.secure_channel(f"127.0.0.1:{grpc_port}", credentials) as channel:
            with pytest.raises(grpc.RpcError) as caught:
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(service_pb2.ServerLiveRequest(),
                                                                              timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:  # plain text to the TLS port
            with pytest.raises(grpc.RpcError):
                service_pb2_grpc.GRPCInferenceServiceStub(channel).ServerLive(service_pb2.ServerLiveRequest(),
                                                                              timeout=10)
        assert key  # the key file was readable (the server read it too)
    finally:
        process.terminate()
        process.wait(30)


@pytest.mark.slow
def test_sigterm_drains_grpc_then_exits_cleanly(tiny_onnx):
    """SIGTERM: the server finishes, new gRPC calls are refused (UNAVAILABLE), and the process exits 0."""
    import signal
    grpc_port = free_port()
    with uvicorn_server(tiny_onnx, "--grpc-port", str(grpc_port), "--drain-timeout-s", "2") as (_, process):
        with triton_grpc.InferenceServerClient(f"127.0.0.1:{grpc_port}") as client:
            assert client.infer(MODEL, [pixel_input(pixels(1, TRAINED))]).as_numpy("logits").shape == (1, 3)
            process.send_signal(signal.SIGTERM)
            assert process.wait(PATIENCE_S) == 0
            error = refused(client.is_server_live, client_timeout=5)
            assert error.status() in ("StatusCode.UNAVAILABLE", "StatusCode.DEADLINE_EXCEEDED")


def test_the_checked_in_stubs_are_what_make_grpc_stubs_makes(tmp_path):
    """The generated files match the .proto files and the pinned grpcio-tools (pyproject's dev extra)."""
    pytest.importorskip("grpc_tools")
    import filecmp
    import shutil
    import subprocess
    import sys
    from service_fixtures import REPO
    generated = REPO / "service" / "grpc" / "generated"
    for name in ("grpc_service.proto", "model_config.proto", "__init__.py"):
        shutil.copy(generated / name, tmp_path / name)
    shutil.copy(REPO / "Makefile", tmp_path / "Makefile")
    # the recipe's own commands, on a copy (GRPC_GENERATED pointed at it; the venv's python)
    subprocess.run(["make", "-s", "-o", ".venv/.dev-installed", "grpc-stubs", f"GRPC_GENERATED={tmp_path}",
                    f"BIN={os.path.dirname(sys.executable)}"], cwd=tmp_path, check=True, capture_output=True)
    made = sorted(p.name for p in tmp_path.glob("*_pb2*"))
    assert made == sorted(p.name for p in generated.glob("*_pb2*")), made
    for name in made:
        assert filecmp.cmp(tmp_path / name, generated / name, shallow=False), f"{name}: run make grpc-stubs"


def test_serve_refuses_a_grpc_port_in_use_in_one_line(tiny_onnx, private_environ, capsys):
    from vitserve.cli import main
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # the HTTP port free too (not the default 8000, which a server of the developer's may hold): the gRPC one
        # is the refusal under test
        assert main(["serve", "--model", str(tiny_onnx), "--port", str(free_port()), "--grpc-port", str(port)]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and f"127.0.0.1:{port} is in use" in error and "--grpc-port" in error


def test_a_port_left_in_time_wait_is_free_for_the_next_server():
    """A server that just stopped leaves its closed connections in TIME_WAIT: restarting it must not be told its
    port is in use (the servers bind with SO_REUSEADDR); a listener still holds it."""
    from vitserve.service.cli import port_is_free
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    assert not port_is_free("127.0.0.1", port)
    accepted.close()  # the server's side closes first: it waits in TIME_WAIT
    client.close()
    listener.close()
    assert port_is_free("127.0.0.1", port)


def test_serve_refuses_grpc_on_the_http_port_and_half_a_tls_pair(tiny_onnx, tmp_path, private_environ, capsys):
    from vitserve.cli import main
    assert main(["serve", "--model", str(tiny_onnx), "--port", "9555", "--grpc-port", "9555"]) == 2
    assert "is the HTTP port" in capsys.readouterr().err
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    assert main(["serve", "--model", str(tiny_onnx), "--ssl-certfile", str(cert), "--grpc-port", "0"]) == 2
    assert "go together" in capsys.readouterr().err
    assert main(["serve", "--model", str(tiny_onnx), "--ssl-certfile", str(tmp_path / "missing.pem"),
                 "--ssl-keyfile", str(cert), "--grpc-port", "0"]) == 2
    assert "ssl_certfile" in capsys.readouterr().err


def test_the_token_budget_is_asked_and_said_in_parameters(client):
    """docs/token-budgets.md: request parameters max_tokens and degrade; response parameters budget_*. This server
    serves the tiny file's full budget only (its cheaper ones have no measured accuracy)."""
    result = client.infer(MODEL, [pixel_input(pixels(1, TRAINED))], parameters={"max_tokens": 16, "degrade": "never"})
    said = result.get_response().parameters
    assert (said["budget_tokens"].int64_param, said["budget_full_tokens"].int64_param,
            said["budget_grid"].string_param) == (16, 16, "32x32")
    assert "budget_reason" not in said  # the full budget
    error = refused(client.infer, MODEL, [pixel_input(pixels(1, TRAINED))], parameters={"max_tokens": 9})
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "cheapest budget this model serves (16 tokens" in \
        error.message()
    error = refused(client.infer, MODEL, [pixel_input(pixels(1, TRAINED))], parameters={"degrade": "sometimes"})
    assert error.status() == "StatusCode.INVALID_ARGUMENT" and "parameters.degrade must be one of load, never" in \
        error.message()
