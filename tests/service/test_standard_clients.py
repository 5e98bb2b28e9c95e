"""tritonclient[http], unmodified from PyPI, against a real `vitserve serve` process: health, metadata, the model
configuration and statistics extensions, inference with JSON and binary tensors, classification, the `image` BYTES
input, compressed bodies, errors, concurrency (gevent and asyncio clients) and the `timeout` parameter.

Every answer is checked against the same ONNX file run directly by ONNX Runtime, or against /v1/classify. One server
serves the whole module; it runs with a batch size and queue delay that are not the defaults, so that the
configuration tritonclient reads is visibly the server's own. Importing tritonclient imports gevent, but nothing
monkey-patches: the other modules' asyncio tests are unaffected.
"""
from __future__ import annotations

import ast
import asyncio
import json
import re

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
import tritonclient.http.aio as triton_aio
from tritonclient.utils import InferenceServerException

from service_fixtures import PATIENCE_S, image_bytes, patterned_png, uvicorn_server, wait_until

MODEL, VERSION = "tiny-vit", "7"
LABELS = ["cat", "dog", "bird"]  # tests/conftest.py's tiny model
OUTPUTS = ("logits", "rollout")
MAX_BATCH, QUEUE_DELAY_MS = 8, 3  # not the defaults (16, 5)
TRAINED, OTHER = (32, 32), (16, 24)  # (H, W): the trained size, and another multiple of the 8-pixel patch
CLASS_ENTRY = re.compile(r"^-?\d+\.\d{6}:(\d+)(?::(\w+))?$")  # "value:index:label", value with C's %f


@pytest.fixture(scope="module")
def server(tiny_onnx):
    with uvicorn_server(tiny_onnx, "--max-batch-size", str(MAX_BATCH),
                        "--max-queue-delay-ms", str(QUEUE_DELAY_MS)) as (base_url, _):
        yield base_url


@pytest.fixture(scope="module")
def url(server) -> str:
    return server.removeprefix("http://")  # tritonclient takes host:port


@pytest.fixture(scope="module")
def client(url):
    client = triton.InferenceServerClient(url, network_timeout=PATIENCE_S)
    yield client
    client.close()


@pytest.fixture(scope="module")
def reference(tiny_onnx):
    """The ONNX file run directly: (B, 3, H, W) pixels -> {"logits": (B, 3), "rollout": (B, H/8, W/8)}."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(tiny_onnx), options, providers=["CPUExecutionProvider"])
    return lambda pixels: dict(zip(OUTPUTS, session.run(list(OUTPUTS), {"pixel_values": pixels})))


def pixels(batch: int, size: tuple[int, int], seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(batch, 3, *size)).astype(np.float32)


def pixel_input(array: np.ndarray, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("pixel_values", list(array.shape), "FP32")
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def image_input(images: list[bytes], shape: list[int]) -> triton.InferInput:
    """Encoded images as a BYTES tensor (binary: tritonclient sends JSON BYTES as UTF-8 text, which a PNG is not)."""
    tensor = triton.InferInput("image", shape, "BYTES")
    tensor.set_data_from_numpy(np.array(images, dtype=object).reshape(shape), binary_data=True)
    return tensor


def requested(binary: bool, **class_counts: int) -> list[triton.InferRequestedOutput]:
    return [triton.InferRequestedOutput(name, binary_data=binary, class_count=class_counts.get(name, 0))
            for name in OUTPUTS]


def assert_outputs(result, expected: dict[str, np.ndarray]) -> None:
    for name in OUTPUTS:
        got = result.as_numpy(name)
        assert got.dtype == np.float32 and got.shape == expected[name].shape, (name, got.dtype, got.shape)
        np.testing.assert_allclose(got, expected[name], rtol=1e-5, atol=1e-5, err_msg=name)


def refused(call, *args, **kwargs) -> InferenceServerException:
    """The exception `call` raises; its str() must work (tritonclient builds it from the body's `error`)."""
    with pytest.raises(InferenceServerException) as caught:
        call(*args, **kwargs)
    error = caught.value
    assert isinstance(error.message(), str) and str(error) == f"[{error.status()}] {error.message()}"
    return error


def classify_v1(server: str, data: bytes, **params) -> dict:
    response = httpx.post(f"{server}/v1/classify", params=params, content=data,
                          headers={"content-type": "image/png"}, timeout=PATIENCE_S)
    assert response.status_code == 200, response.text
    return response.json()


def softmax(logits: np.ndarray) -> np.ndarray:
    e = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def model_stats(client, **version) -> dict:
    (entry,) = client.get_inference_statistics(MODEL, **version)["model_stats"]
    return entry


# --- health, metadata, configuration ------------------------------------------------------------------------------

def test_health_and_readiness(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready(MODEL) and client.is_model_ready(MODEL, VERSION)
    assert not client.is_model_ready(MODEL, "8")
    assert not client.is_model_ready("nope")


def test_server_metadata_lists_the_extensions(client):
    metadata = client.get_server_metadata()
    assert metadata["name"] == "vitserve" and isinstance(metadata["version"], str) and metadata["version"]
    assert set(metadata["extensions"]) == {"binary_tensor_data", "classification", "model_configuration",
                                           "model_repository", "statistics"}


@pytest.mark.parametrize("version", ["", VERSION])
def test_model_metadata_lists_both_inputs(client, version):
    metadata = client.get_model_metadata(MODEL, version)
    assert metadata["name"] == MODEL and metadata["versions"] == [VERSION]
    inputs = {t["name"]: t for t in metadata["inputs"]}
    assert [(t["name"], t["datatype"]) for t in metadata["inputs"]] == [("pixel_values", "FP32"), ("image", "BYTES")]
    assert inputs["pixel_values"]["shape"] == [-1, 3, -1, -1]
    assert inputs["image"]["shape"][0] == -1
    assert [(t["name"], t["datatype"], t["shape"]) for t in metadata["outputs"]] == [
        ("logits", "FP32", [-1, 3]), ("rollout", "FP32", [-1, -1, -1]), ("relevance", "FP32", [-1, -1, -1]),
        ("embedding", "FP32", [-1, 32])]


@pytest.mark.parametrize("version", ["", VERSION])
def test_model_config_is_the_servers_own(client, version):
    config = client.get_model_config(MODEL, version)
    assert config["name"] == MODEL and config["max_batch_size"] == MAX_BATCH
    assert config["dynamic_batching"]["max_queue_delay_microseconds"] == QUEUE_DELAY_MS * 1000
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["input"]] == [
        ("pixel_values", "TYPE_FP32", [3, -1, -1]), ("image", "TYPE_STRING", [1])]
    assert [(t["name"], t["data_type"], t["dims"]) for t in config["output"]] == [
        ("logits", "TYPE_FP32", [3]), ("rollout", "TYPE_FP32", [-1, -1]), ("relevance", "TYPE_FP32", [-1, -1]),
        ("embedding", "TYPE_FP32", [32])]


def test_metadata_shapes_are_the_config_dims_with_a_batch_dimension(client):
    """max_batch_size > 0: Triton's config dims leave out the batch dimension that the metadata shapes hold."""
    metadata, config = client.get_model_metadata(MODEL), client.get_model_config(MODEL)
    for kind, dims in (("inputs", "input"), ("outputs", "output")):
        assert [t["shape"] for t in metadata[kind]] == [[-1, *t["dims"]] for t in config[dims]]


@pytest.mark.parametrize("version", [{}, {"model_version": VERSION}], ids=["plain", "versioned"])
def test_statistics_count_what_was_sent(client, reference, version):
    before = model_stats(client, **version)
    for batch in (1, 3):
        client.infer(MODEL, [pixel_input(pixels(batch, TRAINED), binary=True)], outputs=requested(True))
    # success and fail are counted once the response has gone out: wait for them, then assert exactly
    wait_until(lambda: model_stats(client, **version)["inference_stats"]["success"]["count"]
               >= before["inference_stats"]["success"]["count"] + 2, "both requests counted")
    after = model_stats(client, **version)
    assert (after["name"], after["version"]) == (MODEL, VERSION)

    def grew(stage: str) -> tuple[int, int]:
        was, now = before["inference_stats"][stage], after["inference_stats"][stage]
        return now["count"] - was["count"], now["ns"] - was["ns"]

    assert grew("success")[0] == 2 and grew("fail") == (0, 0)
    assert after["inference_count"] - before["inference_count"] == 4
    assert 1 <= after["execution_count"] - before["execution_count"] <= 4
    for stage in ("queue", "compute_input", "compute_infer", "compute_output"):
        assert grew(stage)[0] == 4, stage  # per image
    for stage in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert grew(stage)[1] > 0, stage
    assert after["last_inference"] >= before["last_inference"] and after["last_inference"] > 1.6e12  # ms since 1970

    def images(stats) -> int:  # every image ran in one executed batch
        return sum(b["batch_size"] * b["compute_infer"]["count"] for b in stats["batch_stats"])
    assert images(after) - images(before) == 4


def test_statistics_of_every_model_and_of_a_wrong_version(client):
    assert [entry["name"] for entry in client.get_inference_statistics()["model_stats"]] == [MODEL]
    error = refused(client.get_inference_statistics, MODEL, "8")
    assert error.status() == "404" and "'8'" in error.message()


# --- inference -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("binary_in, binary_out", [(False, False), (True, True), (True, False), (False, True)],
                         ids=["json", "binary", "binary-in-json-out", "json-in-binary-out"])
@pytest.mark.parametrize("batch, size", [(1, TRAINED), (4, TRAINED), (1, OTHER), (4, OTHER)])
def test_infer_matches_onnx_runtime(client, reference, binary_in, binary_out, batch, size):
    array = pixels(batch, size, seed=batch)
    result = client.infer(MODEL, [pixel_input(array, binary_in)], outputs=requested(binary_out), request_id="r-1")
    expected = reference(array)
    assert expected["rollout"].shape == (batch, size[0] // 8, size[1] // 8)
    assert_outputs(result, expected)
    response = result.get_response()
    assert (response["model_name"], response["model_version"], response["id"]) == (MODEL, VERSION, "r-1")
    for output in response["outputs"]:
        assert output["datatype"] == "FP32" and output["shape"] == list(expected[output["name"]].shape)
        assert ("parameters" in output) == binary_out and ("data" in output) == (not binary_out)
        if binary_out:
            assert output["parameters"] == {"binary_data_size": expected[output["name"]].size * 4}


@pytest.mark.parametrize("binary", [False, True])
def test_uint8_pixels_are_normalised_by_the_server_as_the_model_was_trained(client, reference, binary):
    from vitserve.artifact import normalize_pixels

    raw = np.random.default_rng(5).integers(0, 256, (2, 3, *TRAINED), dtype=np.uint8)
    tensor = triton.InferInput("pixel_values", list(raw.shape), "UINT8")
    tensor.set_data_from_numpy(raw, binary_data=binary)
    result = client.infer(MODEL, [tensor], outputs=requested(True))
    assert_outputs(result, reference(normalize_pixels(raw, [0.5] * 3, [0.25] * 3)))  # the tiny model's mean, std


@pytest.mark.parametrize("binary", [False, True])
def test_relevance_output_with_a_target_parameter(client, tiny_onnx, binary):
    """The relevance output asked for by name, the class to explain as a request parameter (label or index), as
    tritonclient sends them unmodified; the values are the ONNX file's own relevance path."""
    array = pixels(3, OTHER, seed=11)
    session = ort.InferenceSession(str(tiny_onnx), providers=["CPUExecutionProvider"])
    outputs = [triton.InferRequestedOutput(name, binary_data=binary) for name in ("logits", "relevance")]
    for target, index in (("dog", 1), (2, 2)):
        result = client.infer(MODEL, [pixel_input(array, binary)], outputs=outputs, parameters={"target": target})
        want = session.run(["logits", "relevance"], {"pixel_values": array, "target_class": np.full(3, index)})
        np.testing.assert_allclose(result.as_numpy("relevance"), want[1], rtol=0, atol=1e-6)
        np.testing.assert_allclose(result.as_numpy("logits"), want[0], rtol=0, atol=1e-5)
    top1 = client.infer(MODEL, [pixel_input(array, binary)], outputs=outputs)  # no target: each image's top-1
    want = session.run(["relevance"], {"pixel_values": array, "target_class": np.full(3, -1)})[0]
    np.testing.assert_allclose(top1.as_numpy("relevance"), want, rtol=0, atol=1e-6)


def test_a_target_without_the_relevance_output_is_400(client):
    with pytest.raises(InferenceServerException, match="request the relevance output"):
        client.infer(MODEL, [pixel_input(pixels(1, TRAINED, seed=1), True)], outputs=requested(True),
                     parameters={"target": "dog"})
    with pytest.raises(InferenceServerException, match="neither a class index"):
        client.infer(MODEL, [pixel_input(pixels(1, TRAINED, seed=1), True)],
                     outputs=[triton.InferRequestedOutput("relevance")], parameters={"target": "horse"})


def test_infer_without_outputs_returns_all_binary(client, reference):
    """No `outputs`: tritonclient asks for every output with the request's binary_data_output; the relevance
    output, which costs a backward pass, only when named."""
    array = pixels(2, OTHER, seed=5)
    result = client.infer(MODEL, [pixel_input(array, binary=True)])
    assert [(o["name"], set(o)) for o in result.get_response()["outputs"]] == [
        (name, {"name", "datatype", "shape", "parameters"}) for name in OUTPUTS]
    assert_outputs(result, reference(array))


def test_versioned_infer(client, reference):
    array = pixels(2, TRAINED, seed=6)
    result = client.infer(MODEL, [pixel_input(array, binary=True)], model_version=VERSION, outputs=requested(True))
    assert result.get_response()["model_version"] == VERSION
    assert_outputs(result, reference(array))
    error = refused(client.infer, MODEL, [pixel_input(array, binary=True)], model_version="8")
    assert error.status() == "404" and "'8'" in error.message() and MODEL in error.message()


def parse_classes(entries: np.ndarray) -> list[list[tuple[float, int, str | None]]]:
    """BYTES [B, k] of "value:index[:label]" (bytes when binary, str when JSON) -> [[(value, index, label)]]."""
    rows = []
    for row in entries:
        parsed = []
        for entry in row:
            text = entry.decode() if isinstance(entry, bytes) else entry
            match = CLASS_ENTRY.match(text)
            assert match, text
            parsed.append((float(text.split(":")[0]), int(match[1]), match[2]))
        rows.append(parsed)
    return rows


def assert_top_classes(entries: np.ndarray, values: np.ndarray, k: int, labels: list[str] | None) -> None:
    """`entries` are the top `k` of each row of `values` (flattened per item), best first, labelled if `labels`."""
    flat = values.reshape(len(values), -1)
    assert entries.shape == (len(values), k)
    for row, got in zip(flat, parse_classes(entries)):
        got_values = [value for value, _, _ in got]
        assert got_values == sorted(got_values, reverse=True)
        np.testing.assert_allclose(got_values, np.sort(row)[::-1][:k], atol=2e-6)  # 6 decimals, and float32 noise
        np.testing.assert_allclose([row[index] for _, index, _ in got], got_values, atol=2e-6)  # the right indices
        assert len({index for _, index, _ in got}) == k
        assert [label for _, _, label in got] == ([labels[i] for _, i, _ in got] if labels else [None] * k)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_classification_extension(client, reference, binary):
    array = pixels(4, TRAINED, seed=7)
    result = client.infer(MODEL, [pixel_input(array, binary)], outputs=requested(binary, logits=3, rollout=2))
    expected = reference(array)
    outputs = {o["name"]: o for o in result.get_response()["outputs"]}
    assert [(o["datatype"], o["shape"]) for o in outputs.values()] == [("BYTES", [4, 3]), ("BYTES", [4, 2])]
    assert_top_classes(result.as_numpy("logits"), expected["logits"], 3, LABELS)
    assert_top_classes(result.as_numpy("rollout"), expected["rollout"], 2, None)  # each item's map, flattened


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_class_count_past_the_classes_is_clamped(client, reference, binary):
    array = pixels(2, OTHER, seed=8)  # a 2x3 rollout: 6 values per item
    result = client.infer(MODEL, [pixel_input(array, binary)], outputs=requested(binary, logits=10, rollout=100))
    expected = reference(array)
    assert_top_classes(result.as_numpy("logits"), expected["logits"], 3, LABELS)
    assert_top_classes(result.as_numpy("rollout"), expected["rollout"], 6, None)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_compressed_requests(client, reference, algorithm, binary):
    array = pixels(2, OTHER, seed=9)
    plain = client.infer(MODEL, [pixel_input(array, binary)], outputs=requested(binary))
    squeezed = client.infer(MODEL, [pixel_input(array, binary)], outputs=requested(binary),
                            request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
    assert_outputs(squeezed, reference(array))
    for name in OUTPUTS:
        np.testing.assert_allclose(squeezed.as_numpy(name), plain.as_numpy(name), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_answers_come_compressed_as_tritonclient_asks(client, reference, monkeypatch, algorithm, binary):
    """tritonclient's response_compression_algorithm: the answer (above compress_min_bytes) comes back compressed,
    tritonclient inflates it itself (seen here by wrapping the inflate it calls; the client is unchanged) and
    reads the binary tensors after the uncompressed JSON's length."""
    import tritonclient.http._infer_result as result_module
    inflated = []
    inflate = getattr(result_module, "gzip" if algorithm == "gzip" else "zlib").decompress

    class Spy:
        @staticmethod
        def decompress(data):
            inflated.append((len(data), len(inflate(data))))
            return inflate(data)
    monkeypatch.setattr(result_module, "gzip" if algorithm == "gzip" else "zlib", Spy)
    array = pixels(8, (64, 64), seed=4)  # 8 rollouts of 8x8: answers of 2-5 KB
    result = client.infer(MODEL, [pixel_input(array, binary)], outputs=requested(binary),
                          request_compression_algorithm=algorithm, response_compression_algorithm=algorithm)
    # compressed bytes came (plain ones would not inflate), fewer than the answer's
    assert len(inflated) == 1 and inflated[0][0] < inflated[0][1], inflated
    assert_outputs(result, reference(array))


# --- the image input -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [[2], [2, 1]], ids=["B", "Bx1"])
def test_image_input_matches_v1_classify(server, client, shape):
    images = [patterned_png((48, 40)), image_bytes("PNG", size=(20, 36), color=(10, 200, 90))]
    result = client.infer(MODEL, [image_input(images, shape)], outputs=requested(True))
    logits, rollout = result.as_numpy("logits"), result.as_numpy("rollout")
    assert logits.shape == (2, 3) and rollout.shape == (2, 4, 4)  # resize=fit: the trained 4x4 patch grid
    for image, row in zip(images, logits):
        predictions = classify_v1(server, image)["predictions"]
        scores = softmax(row.astype(np.float64))
        np.testing.assert_allclose([p["score"] for p in predictions], scores[[p["index"] for p in predictions]],
                                   atol=1e-6)
        assert [p["index"] for p in predictions] == list(np.argsort(-scores, kind="stable"))


def test_image_input_native_resize(server, client):
    """parameters={"resize": "native"}: the image's own size snapped to the patch, as /v1/classify?resize=native."""
    image = patterned_png((48, 40))
    result = client.infer(MODEL, [image_input([image], [1])], outputs=requested(False),
                          parameters={"resize": "native"})
    assert result.as_numpy("rollout").shape == (1, 5, 6)  # 40/8 rows, 48/8 columns
    scores = softmax(result.as_numpy("logits")[0].astype(np.float64))
    predictions = classify_v1(server, image, resize="native")["predictions"]
    np.testing.assert_allclose([p["score"] for p in predictions], scores[[p["index"] for p in predictions]], atol=1e-6)
    assert [p["index"] for p in predictions] == list(np.argsort(-scores, kind="stable"))


def test_an_image_that_is_not_one_is_400_naming_its_item(client):
    error = refused(client.infer, MODEL, [image_input([patterned_png(), b"not an image"], [2])])
    assert error.status() == "400" and "item 1" in error.message()


# --- errors --------------------------------------------------------------------------------------------------------

def test_unknown_model_is_404_with_a_readable_message(client):
    array = pixels(1, TRAINED)
    for call, args in ((client.infer, ("nope", [pixel_input(array, True)])), (client.get_model_metadata, ("nope",)),
                       (client.get_model_config, ("nope",)), (client.get_inference_statistics, ("nope",))):
        error = refused(call, *args)
        assert error.status() == "404" and "'nope'" in error.message(), call.__name__


@pytest.mark.parametrize("tensor, names", [
    (lambda: pixel_input(pixels(1, (12, 16)), True), ["shape", "multiples of 8"]),  # not a multiple of the patch
    (lambda: pixel_input(np.zeros((1, 1, 32, 32), np.float32), False), ["shape", "3 channels"]),
    (lambda: pixel_input(np.zeros((3, 32, 32), np.float32), True), ["shape"]),  # no batch dimension
    (lambda: _fp64_input(), ["datatype", "FP32"]),
], ids=["patch", "channels", "rank", "datatype"])
def test_a_bad_tensor_is_400_naming_the_problem(client, tensor, names):
    error = refused(client.infer, MODEL, [tensor()])
    assert error.status() == "400"
    for name in names:
        assert name in error.message(), error.message()


def _fp64_input() -> triton.InferInput:
    tensor = triton.InferInput("pixel_values", [1, 3, 32, 32], "FP64")
    tensor.set_data_from_numpy(np.zeros((1, 3, 32, 32), np.float64), binary_data=True)
    return tensor


# --- concurrency ---------------------------------------------------------------------------------------------------

def test_async_infer_16_in_flight(url, reference):
    """The gevent client with 8 connections: 16 requests in flight, each answered with its own input's outputs."""
    arrays = [pixels(1 + i % 3, TRAINED if i % 2 else OTHER, seed=100 + i) for i in range(16)]
    with triton.InferenceServerClient(url, concurrency=8, network_timeout=PATIENCE_S) as client:
        pending = [client.async_infer(MODEL, [pixel_input(array, binary=i % 4 != 0)], request_id=f"q{i}",
                                      outputs=requested(binary=i % 2 == 0)) for i, array in enumerate(arrays)]
        results = [request.get_result(timeout=PATIENCE_S) for request in pending]
    for i, (array, result) in enumerate(zip(arrays, results)):
        assert result.get_response()["id"] == f"q{i}"
        assert_outputs(result, reference(array))


@pytest.mark.anyio
async def test_asyncio_client(url, reference):
    """tritonclient.http.aio (aiohttp; it sends Content-Type application/octet-stream): gathered infers."""
    arrays = [pixels(2, OTHER if i % 2 else TRAINED, seed=200 + i) for i in range(6)]
    async with triton_aio.InferenceServerClient(url, conn_timeout=PATIENCE_S) as client:
        assert await client.is_server_ready() and await client.is_model_ready(MODEL)
        results = await asyncio.gather(*(
            client.infer(MODEL, [pixel_input(array, binary=i % 3 != 0)], outputs=requested(binary=i % 2 == 0))
            for i, array in enumerate(arrays)))
        error = await _aio_refused(client.infer("nope", [pixel_input(arrays[0], True)]))
    for array, result in zip(arrays, results):
        assert_outputs(result, reference(array))
    assert error.status() == "404" and "'nope'" in str(error)


async def _aio_refused(call) -> InferenceServerException:
    with pytest.raises(InferenceServerException) as caught:
        await call
    return caught.value


# --- the timeout parameter -----------------------------------------------------------------------------------------

def test_timeout_is_sent_in_microseconds_and_a_normal_one_succeeds(url, reference, capsys):
    """tritonclient sends `timeout=` as the request parameter `timeout` (microseconds); verbose prints the body."""
    array = pixels(1, TRAINED, seed=10)
    with triton.InferenceServerClient(url, verbose=True, network_timeout=PATIENCE_S) as client:
        result = client.infer(MODEL, [pixel_input(array, binary=False)], outputs=requested(False), timeout=5_000_000)
    assert_outputs(result, reference(array))
    printed = capsys.readouterr().out.splitlines()
    posted = printed[next(i for i, line in enumerate(printed) if line.startswith(f"POST /v2/models/{MODEL}/infer")) + 1]
    assert json.loads(ast.literal_eval(posted))["parameters"] == {"timeout": 5_000_000}


def test_a_timeout_shorter_than_the_work_is_504(client):
    """1 microsecond: gone before the request reaches the batcher (were it read as ms or s, this would succeed)."""
    error = refused(client.infer, MODEL, [pixel_input(pixels(1, TRAINED), binary=True)], timeout=1)
    assert error.status() == "504" and "deadline" in error.message()
    assert client.is_server_ready()


def test_a_timeout_of_zero_means_none(client, reference):
    """As in Triton (tritonserver.h, TRITONSERVER_InferenceRequestSetTimeoutMicroseconds: 'The default is 0 which
    indicates that the request has no timeout'): the server's own deadline holds."""
    array = pixels(1, TRAINED, seed=11)
    result = client.infer(MODEL, [pixel_input(array, binary=True)], outputs=requested(True), timeout=0)
    assert_outputs(result, reference(array))
