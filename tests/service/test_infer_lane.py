"""The infer lane (service/http/infer_lane.py), the one door of the inference route table
(service/http/inference_routes.py): it answers those routes before FastAPI's router (which has no route for them), in
the protocol's shapes, errors and other methods included; it checks keys, admits through the call pipeline and counts
under the routes' templates; the OpenAPI document describes them from the same table; a bug in it is a 500 in the
protocol's shape, and the server goes on."""
from __future__ import annotations

import asyncio
import json

import httpx
import numpy as np
import pytest

from vitserve.service.http import inference_routes
from vitserve.service.usecases import inference
from vitserve.service.schemas.binary_tensors import HEADER_LENGTH
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


def answer_of(response: httpx.Response) -> tuple:
    return response.status_code, {h: response.headers.get(h) for h in HEADERS_COMPARED}, response.content


async def test_the_lane_answers_every_request_in_the_protocol_s_shape(tiny_onnx):
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
        ("GET", "/v2/models/tiny-vit/infer", b"", {}),  # the lane's path, another method: 405
        ("PUT", "/v1/classify", b"", {}),  # 405
        ("POST", "/v2/models/tiny-vit/infer/more", json_body(), {}),  # not the lane's, nor any route's: 404
    ]
    async with serving(settings_for(tiny_onnx, max_json_body_bytes=64 * 1024)) as client:
        answers = [await client.request(method, path, content=body, headers=headers)
                   for method, path, body, headers in requests]
    assert [a.status_code for a in answers] == [200, 200, 200, 404, 404, 400, 400, 400, 413, 405, 405, 404]
    assert answers[1].json()["id"] == "r7" and answers[1].json()["model_version"] == "7"
    assert answers[0].headers[HEADER_LENGTH] and answers[0].headers["content-type"] == "application/octet-stream"
    for refused in answers[3:9]:  # the protocol's shape: a message, and vitserve's code
        assert set(refused.json()) == {"error", "code"}
    assert [a.json()["code"] for a in answers[3:9]] == ["model_not_found"] * 2 + ["invalid_parameter"] * 3 + [
        "payload_too_large"]
    assert answers[9].headers["allow"] == answers[10].headers["allow"] == "POST"
    assert answers[9].json() == {"error": "Method Not Allowed", "code": "method_not_allowed"}
    assert answers[10].json() == {"error": {"code": "method_not_allowed", "message": "Method Not Allowed"}}


async def test_the_lane_is_the_one_door_and_the_openapi_document_describes_it(tiny_onnx):
    lane_paths = {"/v1/classify": "post", "/v2/models/{name}/infer": "post",
                  "/v2/models/{name}/versions/{version}/infer": "post"}
    async with serving(settings_for(tiny_onnx)) as client:
        routed = {getattr(route, "path", None) for route in client.app.routes}
        spec = (await client.get("/openapi.json")).json()
    assert not routed & set(lane_paths)  # FastAPI's router never sees them
    for path, method in lane_paths.items():
        operation = spec["paths"][path][method]
        assert "200" in operation["responses"] and "429" in operation["responses"]
    assert "requestBody" in spec["paths"]["/v2/models/{name}/infer"]["post"]
    assert {p["name"] for p in spec["paths"]["/v1/classify"]["post"]["parameters"]} >= {"top_k", "map", "model"}


async def test_the_lane_wants_the_api_key(tiny_onnx):
    body = json_body(PIXELS[:1])
    async with serving(settings_for(tiny_onnx, api_key="k1")) as client:
        refused = await client.post("/v2/models/tiny-vit/infer", content=body)
        wrong = await client.post("/v2/models/tiny-vit/infer", content=body, headers={"Authorization": "Bearer k2"})
        right = await client.post("/v2/models/tiny-vit/infer", content=body, headers={"Authorization": "Bearer k1"})
        classify_refused = await client.post("/v1/classify", content=b"x", headers={"content-type": "image/png"})
    assert [r.status_code for r in (refused, wrong, right, classify_refused)] == [401, 403, 200, 401]
    assert refused.headers["www-authenticate"] == 'Bearer realm="vitserve"'
    assert refused.json()["code"] == "unauthorized" and classify_refused.json()["error"]["code"] == "unauthorized"


async def test_the_lane_takes_the_infer_routes_and_they_are_counted_under_their_templates(tiny_onnx):
    seen = []

    async with serving(settings_for(tiny_onnx)) as client:
        app = client.app
        inner = app.middleware_stack = app.build_middleware_stack()

        async def recording(scope, receive, send):  # the outermost layer: what the layers inside made of the scope
            await inner(scope, receive, send)
            seen.append((scope.get("state", {}).get("endpoint"), scope.get("route")))

        app.middleware_stack = recording
        for path in ("/v2/models/tiny-vit/infer", "/v2/models/tiny-vit/versions/7/infer"):
            assert (await client.post(path, content=json_body(PIXELS[:1]))).status_code == 200
        assert (await client.get("/v2/models/tiny-vit")).status_code == 200
        metrics = samples((await client.get("/metrics")).text)
    assert seen[:2] == [("/v2/models/{name}/infer", None), ("/v2/models/{name}/versions/{version}/infer", None)]
    assert seen[2][0] is None and seen[2][1].path == "/v2/models/{name}"  # the metadata route: FastAPI's
    count = "vitserve_request_duration_seconds_count"
    assert value(metrics, count, endpoint="/v2/models/{name}/infer", status="200") == 1
    assert value(metrics, count, endpoint="/v2/models/{name}/versions/{version}/infer", status="200") == 1


async def test_the_openapi_document_lists_every_inference_route_from_the_table(tiny_onnx):
    """The table the lane dispatches from makes the document: every route, its path and query parameters (each
    field of its query model, by its alias), its body and its answers; FastAPI's router holds none of them."""
    async with serving(settings_for(tiny_onnx)) as client:
        spec = (await client.get("/openapi.json")).json()
        routed = {getattr(route, "path", None) for route in client.app.routes}
    assert [route.template for route in inference_routes.ROUTES] == [
        "/v1/classify", "/v1/classify/batch", "/v1/embed", "/v2/models/{name}/infer",
        "/v2/models/{name}/versions/{version}/infer"]
    for route in inference_routes.ROUTES:
        assert route.template not in routed
        operation = spec["paths"][route.template]["post"]
        names = [p["name"] for p in operation["parameters"]]
        expected_query = [] if route.query is None else [
            field.alias or name for name, field in route.query.model_fields.items()]
        assert names == [*route.pattern.groupindex, *expected_query], route.template
        assert operation["requestBody"] == route.body and operation["responses"]["200"] == route.answer
        assert {str(code) for code in route.errors} <= set(operation["responses"])
        assert operation["summary"]
    # as FastAPI named them when these were its routes: clients generated from the document keep their methods
    assert [spec["paths"][route.template]["post"]["operationId"] for route in inference_routes.ROUTES] == [
        "classify_v1_classify_post", "classify_batch_v1_classify_batch_post", "embed_v1_embed_post",
        "infer_v2_models__name__infer_post", "versioned_infer_v2_models__name__versions__version__infer_post"]
    classify = {p["name"]: p for p in spec["paths"]["/v1/classify"]["post"]["parameters"]}
    assert classify["top_k"]["schema"]["maximum"] == 1000 and classify["rollout"]["deprecated"] is True
    assert classify["map"]["schema"]["anyOf"][0]["enum"] == ["rollout", "relevance", "none"]
    assert [p["in"] for p in spec["paths"]["/v2/models/{name}/versions/{version}/infer"]["post"]["parameters"]] == [
        "path", "path"]
    assert set(spec["paths"]["/v1/embed"]["post"]["requestBody"]["content"]) >= {"multipart/form-data", "image/png"}


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
    real = inference.infer
    calls = []

    async def broken_once(*args):
        calls.append(args)
        if len(calls) == 1:
            raise RuntimeError("a bug")
        return await real(*args)

    monkeypatch.setattr(inference, "infer", broken_once)
    async with serving(settings_for(tiny_onnx)) as client:
        transport = httpx.ASGITransport(app=client.app, raise_app_exceptions=False)  # the server logs it
        async with httpx.AsyncClient(transport=transport, base_url="http://vitserve") as bare:
            failed = await bare.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))
            assert failed.status_code == 500
            assert failed.json() == {"error": "internal server error", "code": "internal_error"}
            assert client.app.state.service.admission.in_flight == 0
            assert (await bare.post("/v2/models/tiny-vit/infer", content=json_body(PIXELS[:1]))).status_code == 200
