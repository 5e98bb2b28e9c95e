"""Answers compressed as the client asks (service/http/compression.py, gRPC's `grpc_response_compression`): the
choice from Accept-Encoding and its q-values, which answers may be compressed (on /v2 an inference answer only, as
Triton), the bytes on the wire inflated and compared with the uncompressed answer (JSON, binary tensors, /v1), the
size bounds, and gRPC both ways, its bytes counted through a proxy."""
from __future__ import annotations

import asyncio
import gzip
import json
import zlib

import grpc
import numpy as np
import pytest
import tritonclient.grpc.aio as triton_grpc_aio

from vitserve.service.http.compression import chosen_coding
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH
from service_fixtures import PATIENCE_S, free_port, image_bytes, serving, settings_for, until

pytestmark = pytest.mark.anyio
INFER = "/v2/models/tiny-vit/infer"
INFLATE = {"gzip": gzip.decompress, "deflate": zlib.decompress}  # deflate: the zlib format, as tritonclient reads


@pytest.mark.parametrize("accept, chosen", [
    ("gzip", "gzip"), ("deflate", "deflate"), ("gzip, deflate", "gzip"), ("deflate, gzip", "gzip"),
    ("gzip;q=0.5, deflate", "deflate"), ("GZIP", "gzip"), ("br", None), ("identity", None), ("zstd, br", None),
    ("gzip;q=0", None), ("*", "gzip"), ("*;q=0", None), ("br, *;q=0.1", "gzip"), ("gzip;q=0.4, identity", None),
    ("gzip, identity;q=0.5", "gzip"), ("gzip;q=abc", None), ("gzip;q=2", None), ("", None), (None, None),
    ("gzip ; q=0.8 , deflate;q=0.9", "deflate"),
])
def test_the_coding_is_the_one_the_client_weighs_highest(accept, chosen):
    assert chosen_coding(accept) == chosen


def pixel_request(batch: int, side: int, binary: bool) -> bytes:
    values = np.random.default_rng(batch).normal(size=(batch, 3, side, side)).round(3).ravel().tolist()
    return json.dumps({"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [batch, 3, side, side],
                                   "data": values}], "parameters": {"binary_data_output": binary}}).encode()


async def raw_answer(client, path: str, accept: str | None, method: str = "POST", **kwargs):
    """(status, headers, the bytes as they came, not inflated: httpx would inflate them)."""
    headers = {**kwargs.pop("headers", {}), "accept-encoding": accept or ""}
    async with client.stream(method, path, headers=headers, **kwargs) as response:
        return response.status_code, response.headers, b"".join([c async for c in response.aiter_raw()])


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
async def test_v2_answers_are_compressed_as_asked_and_inflate_to_the_same_bytes(tiny_onnx, tiny_model, binary):
    request = pixel_request(8, 64, binary)
    async with serving(settings_for(tiny_onnx), tiny_model) as client:
        _, plain_headers, plain = await raw_answer(client, INFER, "identity", content=request)
        assert "content-encoding" not in plain_headers and len(plain) > 2048
        for accept, coding in (("gzip", "gzip"), ("deflate", "deflate"), ("br;q=1, gzip;q=0.5", "gzip"),
                               ("br", None), ("identity", None), ("gzip;q=0", None)):
            status, headers, body = await raw_answer(client, INFER, accept, content=request)
            assert status == 200 and headers.get("content-encoding") == coding, accept
            if coding is None:
                assert body == plain, accept
                continue
            assert INFLATE[coding](body) == plain and len(body) < len(plain), accept
            assert int(headers["content-length"]) == len(body) and "accept-encoding" in headers["vary"].lower()
            # binary tensors: the header length is still the uncompressed JSON's, as Triton sends it
            assert headers.get(HEADER_LENGTH) == plain_headers.get(HEADER_LENGTH)
        if binary:
            json_length = int(plain_headers[HEADER_LENGTH])
            assert [o["name"] for o in json.loads(plain[:json_length])["outputs"]] == ["logits", "rollout"]


async def test_v1_json_is_compressed_and_small_answers_are_not(tiny_onnx, tiny_model):
    async with serving(settings_for(tiny_onnx), tiny_model) as client:
        png = image_bytes("PNG", size=(64, 64))
        status, headers, body = await raw_answer(client, "/v1/classify?rollout=overlay", "gzip", content=png,
                                                 headers={"content-type": "image/png"})
        assert status == 200 and headers["content-encoding"] == "gzip"
        answer = json.loads(gzip.decompress(body))
        assert answer["model"]["name"] == "tiny-vit" and len(answer["predictions"]) == 3
        # below compress_min_bytes (1 KiB): sent as it is
        status, headers, body = await raw_answer(client, "/v2/repository/index", "gzip")
        assert status == 200 and "content-encoding" not in headers and len(body) < 1024 and json.loads(body)
        # an error answer too (small), in its protocol's shape
        status, headers, body = await raw_answer(client, INFER, "gzip", content=b"{")
        assert status == 400 and "content-encoding" not in headers and json.loads(body)["code"] == "invalid_parameter"


ASKED_AS_AIOHTTP = "gzip, deflate, br"  # aiohttp's default, on every call of tritonclient's asyncio client
PLAIN_ON_V2 = [("GET", "/v2", 200), ("GET", "/v2/health/live", 200), ("GET", "/v2/health/ready", 200),
               ("GET", "/v2/models/tiny-vit", 200), ("GET", "/v2/models/tiny-vit/versions/7", 200),
               ("GET", "/v2/models/tiny-vit/ready", 200), ("GET", "/v2/models/tiny-vit/config", 200),
               ("GET", "/v2/models/stats", 200), ("GET", "/v2/models/tiny-vit/stats", 200),
               ("POST", "/v2/repository/index", 200), ("GET", "/v2/models/nope", 404),
               ("GET", "/v2/models/nope/stats", 404), ("POST", "/v2/models/nope/infer", 404),
               ("POST", "/v2/models/tiny-vit/versions/8/infer", 404)]


async def test_on_v2_only_a_successful_inference_answer_is_compressed(tiny_onnx, tiny_model):
    """As Triton: every other /v2 answer, and every error, goes as it is even past the size threshold (here 0),
    whatever the client accepts: tritonclient's asyncio client reads those bodies raw. An infer answer, versioned or
    not, and vitserve's own answers (/v1, /metrics) are compressed."""
    request = pixel_request(1, 32, False)
    async with serving(settings_for(tiny_onnx, compress_min_bytes=0), tiny_model) as client:
        for method, path, expected in PLAIN_ON_V2:
            status, headers, body = await raw_answer(client, path, ASKED_AS_AIOHTTP, method, content=request)
            assert (status, headers.get("content-encoding")) == (expected, None), path
            assert json.loads(body) and "vary" not in headers, path
        status, headers, body = await raw_answer(client, INFER, ASKED_AS_AIOHTTP, content=b"{")
        assert (status, headers.get("content-encoding"), json.loads(body)["code"]) == (400, None, "invalid_parameter")
        for path in (INFER, "/v2/models/tiny-vit/versions/7/infer"):
            status, headers, body = await raw_answer(client, path, ASKED_AS_AIOHTTP, content=request)
            assert (status, headers["content-encoding"]) == (200, "gzip"), path
            assert json.loads(gzip.decompress(body))["model_version"] == "7"
        status, headers, body = await raw_answer(client, "/metrics", ASKED_AS_AIOHTTP, "GET")
        assert (status, headers["content-encoding"]) == (200, "gzip") and b"# HELP" in gzip.decompress(body)
        status, headers, body = await raw_answer(client, "/v1/classify", ASKED_AS_AIOHTTP, content=b"not an image",
                                                 headers={"content-type": "image/png"})
        assert (status, headers.get("content-encoding")) == (400, None) and json.loads(body)["error"]["code"]


async def test_answers_past_the_size_bound_are_sent_uncompressed(tiny_onnx, tiny_model):
    request = pixel_request(8, 64, False)
    async with serving(settings_for(tiny_onnx, compress_max_bytes=2048), tiny_model) as client:
        status, headers, body = await raw_answer(client, INFER, "gzip", content=request)
        assert status == 200 and "content-encoding" not in headers and len(body) > 2048
        assert json.loads(body)["model_name"] == "tiny-vit"
    async with serving(settings_for(tiny_onnx, compress_max_bytes=0), tiny_model) as client:  # 0: off
        assert "content-encoding" not in (await raw_answer(client, INFER, "gzip", content=request))[1]


# --- gRPC ------------------------------------------------------------------------------------------------------------

class CountingProxy:
    """A TCP proxy that counts the bytes the server sends: what the wire carried, compressed or not."""

    def __init__(self, target_port: int):
        self.target_port, self.from_server, self.server = target_port, 0, None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _connection(self, client_reader, client_writer):
        server_reader, server_writer = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def pipe(reader, writer, counted: bool):
            while data := await reader.read(65536):
                if counted:
                    self.from_server += len(data)
                writer.write(data)
                await writer.drain()
            writer.close()

        await asyncio.gather(pipe(client_reader, server_writer, False), pipe(server_reader, client_writer, True),
                             return_exceptions=True)


@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
async def test_grpc_reads_compressed_requests_and_compresses_answers(tiny_onnx, tiny_model, algorithm):
    from vitserve.service.app import create_app
    from vitserve.service.grpc.generated import grpc_service_pb2 as pb
    from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc
    port = free_port()
    settings = settings_for(tiny_onnx, grpc_port=port, grpc_response_compression=algorithm)
    app = create_app(settings, model=tiny_model, serve_grpc=True)
    array = np.zeros((8, 3, 64, 64), np.float32)  # zeros: a request that compresses to almost nothing
    request = pb.ModelInferRequest(model_name="tiny-vit", raw_input_contents=[array.tobytes()])
    request.inputs.add(name="pixel_values", datatype="FP32", shape=array.shape)
    compression = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate}[algorithm]
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        proxy = CountingProxy(port)
        proxy_port = await proxy.start()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{proxy_port}") as channel:
            calls = pb_grpc.GRPCInferenceServiceStub(channel)
            await calls.ServerLive(pb.ServerLiveRequest())  # the connection's own bytes, not counted below
            before = proxy.from_server
            answer = await calls.ModelInfer(request, compression=compression, timeout=PATIENCE_S)
            sent = proxy.from_server - before
        proxy.server.close()
        # the compressed request was read: the same answer as a plain one, and as the model's own
        async with triton_grpc_aio.InferenceServerClient(f"127.0.0.1:{port}") as client:
            tensor = triton_grpc_aio.InferInput("pixel_values", list(array.shape), "FP32")
            tensor.set_data_from_numpy(array)
            squeezed = await client.infer("tiny-vit", [tensor], compression_algorithm=algorithm)
    logits, rollout, *_ = tiny_model.run(array)
    np.testing.assert_allclose(squeezed.as_numpy("logits"), logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(squeezed.as_numpy("rollout"), rollout, rtol=1e-5, atol=1e-6)
    # zeros in: eight identical items out, which compress well; uncompressed, the wire carries more than the
    # tensors themselves (the next test)
    raw = b"".join(answer.raw_output_contents)
    assert len(raw) > 2048 and sent < 0.8 * len(raw), (sent, len(raw))
    np.testing.assert_array_equal(np.frombuffer(answer.raw_output_contents[0], "<f4").reshape(8, 3), logits)


@pytest.mark.parametrize("overrides", [{}, {"grpc_response_compression": "gzip", "compress_max_bytes": 1024}],
                         ids=["default", "past-the-size-bound"])
async def test_grpc_answers_are_not_compressed_by_default_nor_past_the_bound(tiny_onnx, tiny_model, overrides):
    """The default, as Triton's (--grpc-infer-response-compression-level none): only requests are inflated. With
    compression on, an answer over compress_max_bytes still goes uncompressed."""
    from vitserve.service.app import create_app
    from vitserve.service.grpc.generated import grpc_service_pb2 as pb
    from vitserve.service.grpc.generated import grpc_service_pb2_grpc as pb_grpc
    port = free_port()
    app = create_app(settings_for(tiny_onnx, grpc_port=port, **overrides), model=tiny_model, serve_grpc=True)
    array = np.zeros((8, 3, 64, 64), np.float32)
    request = pb.ModelInferRequest(model_name="tiny-vit", raw_input_contents=[array.tobytes()])
    request.inputs.add(name="pixel_values", datatype="FP32", shape=array.shape)
    async with app.router.lifespan_context(app):
        await until(lambda: app.state.service.ready, "warm-up finished")
        proxy = CountingProxy(port)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{await proxy.start()}") as channel:
            calls = pb_grpc.GRPCInferenceServiceStub(channel)
            await calls.ServerLive(pb.ServerLiveRequest())
            before = proxy.from_server
            answer = await calls.ModelInfer(request, compression=grpc.Compression.Gzip, timeout=PATIENCE_S)
            sent = proxy.from_server - before
        proxy.server.close()
    assert sent > len(b"".join(answer.raw_output_contents)), sent
