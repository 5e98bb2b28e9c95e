"""The infer lane (service/http/infer_lane.py): it takes POST .../infer before FastAPI's router, and answers every
request as the FastAPI route does (the same statuses, headers and bytes, errors included); it admits, checks keys
and counts as the route's dependencies do; a bug in it is a 500 in the protocol's shape, and the server goes on."""
from __future__ import annotations

import asyncio
import json
from contextlib import asynccontextmanager

import httpx
import numpy as np
import pytest

from vitserve.service.http import infer_lane
from vitserve.service.http.infer_lane import InferenceLane, RouteTemplate
from vitserve.service.protocols.binary_tensors import HEADER_LENGTH
from service_fixtures import WrappedModel, samples, serving, settings_for, until, value

pytestmark = pytest.mark.anyio
PIXELS = np.random.default_rng(3).normal(size=(2, 3, 16, 16)).astype(np.float32)  # the tiny model: 3 channels, patch 8
HEADERS_COMPARED = ("content-type", "content-length", "retry-after", "www-authenticate", "connection", HEADER_LENGTH)


def json_body(pixels=PIXELS, **request) -> bytes:
    tensor = {"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
              "data": pixels.ravel().tolist()}
    return json.dumps({"inputs": [tensor], **request}).encode()


def binary_body(pixels=PIXELS) -> tuple[bytes, dict]:
    header = json.dumps({"inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                                     "parameters": {"binary_data_size": pixels.nbytes}}],
                         "outputs": [{"name": "logits", "parameters": {"binary_data": True}},
                                     {"name": "rollout"}]}).encode()
    return header + pixels.tobytes(), {HEADER_LENGTH: str(len(header)), "content-type": "application/octet-stream"}


@asynccontextmanager
async def served(settings, model=None, *, lane: bool):
    async with serving(settings, model) as client:
        if not lane:  # before the first request builds the middleware stack
            client.app.user_middleware = [m for m in client.app.user_middleware if m.cls is not InferenceLane]
        yield client


def answer_of(response: httpx.Response) -> tuple:
    return response.status_code, {h: response.headers.get(h) for h in HEADERS_COMPARED}, response.content


async def test_the_lane_answers_every_request_as_the_fastapi_route_does(tiny_onnx):
    binary, binary_headers = binary_body()
    requests = [
        ("POST", "/v2/models/tiny-vit/infer", binary, binary_headers),
        ("POST", "/v2/models/tiny-vit/infer", json_body(id="r7"), {}),
        ("POST", "/v2/models/tiny-vit/versions/7/infer", json_body(PIXELS[:1]), {}),
        ("POST", "/v2/models/tiny-vit/versions/9/infer", json_body(), {}),  # no such version: 404
        ("POST", "/v2/models/nothing/infer", json_body(), {}),  # no such model: 404
        ("POST", "/v2/models/tiny-vit/infer", b"{not json", {}),  # 400
        ("POST", "/v2/models/tiny-vit/infer", b"", {}),  # 400
        ("POST", "/v2/models/tiny-vit/infer", json_body(np.zeros((1, 3, 16, 17), np.float32)), {}),  # 400
        ("POST", "/v2/models/tiny-vit/infer", b"[" * 70_000, {}),  # past max_json_body_bytes: 413
        ("GET", "/v2/models/tiny-vit/infer", b"", {}),  # not the lane's: FastAPI's 405 both times
        ("POST", "/v2/models/tiny-vit/infer/more", json_body(), {}),  # nor this: 404
    ]
    answers = {}
    for lane in (True, False):
        async with served(settings_for(tiny_onnx, max_json_body_bytes=64 * 1024), lane=lane) as client:
            answers[lane] = [answer_of(await client.request(method, path, content=body, headers=headers))
                             for method, path, body, headers in requests]
    statuses = [status for status, _, _ in answers[True]]
    assert statuses == [200, 200, 200, 404, 404, 400, 400, 400, 413, 405, 404]
    assert answers[True] == answers[False]


async def test_the_lane_wants_the_api_key_as_the_route_does(tiny_onnx):
    body = json_body(PIXELS[:1])
    answers = {}
    for lane in (True, False):
        async with served(settings_for(tiny_onnx, api_key="k1"), lane=lane) as client:
            refused = await client.post("/v2/models/tiny-vit/infer", content=body)
            wrong = await client.post("/v2/models/tiny-vit/infer", content=body, headers={"Authorization": "Bearer k2"})
            right = await client.post("/v2/models/tiny-vit/infer", content=body, headers={"Authorization": "Bearer k1"})
            answers[lane] = [answer_of(r) for r in (refused, wrong, right)]
    assert [a[0] for a in answers[True]] == [401, 403, 200]  # no key, a wrong key, the key
    assert answers[True][0][1]["www-authenticate"] == 'Bearer realm="vitserve"'
    assert answers[True] == answers[False]


async def test_the_lane_takes_the_infer_routes_and_they_are_counted_under_their_templates(tiny_onnx):
    routes = []

    async with serving(settings_for(tiny_onnx)) as client:
        app = client.app
        inner = app.middleware_stack = app.build_middleware_stack()

        async def recording(scope, receive, send):  # the outermost layer: what the layers inside made of the scope
            await inner(scope, receive, send)
            routes.append(scope.get("route"))

        app.middleware_stack = recording
        for path in ("/v2/models/tiny-vit/infer", "/v2/models/tiny-vit/versions/7/infer"):
            assert (await client.post(path, content=json_body(PIXELS[:1]))).status_code == 200
        assert (await client.get("/v2/models/tiny-vit")).status_code == 200
        metrics = samples((await client.get("/metrics")).text)
    assert routes[:2] == [RouteTemplate("/v2/models/{name}/infer"),
                          RouteTemplate("/v2/models/{name}/versions/{version}/infer")]
    assert not isinstance(routes[2], RouteTemplate)  # the metadata route: FastAPI's
    count = "vitserve_request_duration_seconds_count"
    assert value(metrics, count, endpoint="/v2/models/{name}/infer", status="200") == 1
    assert value(metrics, count, endpoint="/v2/models/{name}/versions/{version}/infer", status="200") == 1


async def test_the_lane_admits_as_the_dependency_does_and_lets_go_after(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, max_requests_in_flight=1, retry_after_s=4)
    async with serving(settings, model) as client:
        model.hold()
        first = asyncio.ensure_future(client.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1])))
        await until(lambda: model.entered == [1], "the first request in the model")
        refused = await client.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))
        assert refused.status_code == 429 and refused.headers["retry-after"] == "4"
        assert refused.json()["code"] == "overloaded"
        model.release()
        assert (await first).status_code == 200
        assert client.app.state.service.admission.in_flight == 0
        assert (await client.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))).status_code == 200


async def test_a_bug_in_the_lane_is_a_500_in_the_protocol_s_shape_and_the_next_request_is_served(tiny_onnx,
                                                                                                   monkeypatch):
    real = infer_lane.infer_response
    calls = []

    async def broken_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return await real(*args)

    monkeypatch.setattr(infer_lane, "infer_response", broken_once)
    async with serving(settings_for(tiny_onnx)) as client:
        transport = httpx.ASGITransport(app=client.app, raise_app_exceptions=False)  # the server logs it
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve") as bare:
            failed = await bare.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))
            assert failed.status_code == 500
            assert failed.json() == {"error": "internal server error", "code": "internal_error"}
            assert client.app.state.service.admission.in_flight == 0
            assert (await bare.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))).status_code == 200
