"""Every endpoint and parameter over real HTTP through the ASGI app (lifespan included), every error code
with a real bad input, batching, overload, deadlines and failure isolation."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from vitserve.service.ground.errors import ClientDisconnected
from vitserve.service.ground.deadlines import Deadline, StopSignal
from service_fixtures import (only_batcher, PATIENCE_S, WrappedModel, assert_error, classify, image_bytes, patterned_png,
                              png_declaring, run_as_call, serving, settings_for, until)

pytestmark = pytest.mark.anyio
PNG = {"content-type": "image/png"}


@pytest.fixture
def settings(tiny_onnx):
    return settings_for(tiny_onnx)


@pytest.mark.parametrize("fmt, content_type", [("JPEG", "image/jpeg"), ("PNG", "image/png"), ("WEBP", "image/webp"),
                                               ("BMP", "image/bmp"), ("GIF", "image/gif"), ("TIFF", "image/tiff")])
async def test_classify_raw_body_every_format(settings, tiny_model, fmt, content_type):
    async with serving(settings, tiny_model) as client:
        response = await classify(client, image_bytes(fmt), content_type)
    assert response.status_code == 200, response.text
    body = response.json()
    assert set(body) == {"model", "predictions", "rollout", "relevance", "ood", "budget", "timing_ms"} and body["relevance"] is None
    assert body["ood"] is None  # the tiny model was exported without a labelled set
    assert body["model"] == {"name": "tiny-vit", "version": "7"}
    assert [set(p) for p in body["predictions"]] == [{"index", "label", "score"}] * 3  # top_k 5 capped at 3 classes
    assert {p["label"] for p in body["predictions"]} == {"cat", "dog", "bird"}
    assert set(body["timing_ms"]) == {"queue", "preprocess", "inference", "total"}


async def test_prediction_is_the_softmax_of_the_model_and_multipart_matches_raw(settings, tiny_model):
    from vitserve.service.usecases.preprocess import prepare_image
    from vitserve.service.usecases.postprocess import softmax
    data = patterned_png()
    prepared = prepare_image(data, tiny_model.info, resize="fit", max_bytes=10**7, max_pixels=10**7, max_tokens=1024)
    expected = softmax(tiny_model.run(prepared.pixels[None])[0][0])
    async with serving(settings, tiny_model) as client:
        raw = (await classify(client, data)).json()
        multipart = (await client.post("/v1/classify", files={"file": ("x.png", data, "image/png")})).json()
    scores = [p["score"] for p in raw["predictions"]]
    assert scores == sorted(scores, reverse=True)
    assert [p["index"] for p in raw["predictions"]] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose(scores, np.sort(expected)[::-1], rtol=1e-5)
    assert [p["label"] for p in raw["predictions"]] == [["cat", "dog", "bird"][p["index"]] for p in raw["predictions"]]
    assert multipart["predictions"] == raw["predictions"] and multipart["rollout"] == raw["rollout"]


async def test_top_k_rollout_and_resize_parameters(settings, tiny_model):
    data = patterned_png((80, 40))
    async with serving(settings, tiny_model) as client:
        one = (await classify(client, data, top_k=1)).json()
        grid = (await classify(client, data, rollout="grid")).json()["rollout"]
        native = (await classify(client, data, resize="native")).json()["rollout"]
        none = (await classify(client, data, rollout="none")).json()
        png = (await classify(client, data, rollout="png")).json()["rollout"]
        overlay = (await classify(client, data, rollout="overlay", resize="native")).json()["rollout"]
    assert len(one["predictions"]) == 1
    assert grid["height"] == 4 and grid["width"] == 4 and len(grid["values"]) == 4
    values = np.array(grid["values"])
    assert values.shape == (4, 4) and values.min() == 0.0 and values.max() == 1.0
    assert (native["height"], native["width"]) == (5, 10) and np.array(native["values"]).shape == (5, 10)
    assert none["rollout"] is None and len(none["predictions"]) == 3
    for rendered in (png, overlay):
        assert rendered["media_type"] == "image/png" and (rendered["width"], rendered["height"]) == (80, 40)
        image = Image.open(io.BytesIO(base64.b64decode(rendered["data"])))
        assert image.format == "PNG" and image.size == (80, 40)
    heat = np.asarray(Image.open(io.BytesIO(base64.b64decode(png["data"]))))
    assert tuple(heat[20, 0]) == (48, 18, 59)  # fit crops 20 px either side: no attention there


async def test_a_top_k_above_the_class_count_is_answered_with_every_class_and_says_so(settings, tiny_model):
    """The tiny model has 3 classes: top_k=1000 gets all 3 and a warning; a top_k the model can meet, or none sent
    (the default 5 is a ceiling, not a request), gets the same answer as before, without the field."""
    data = patterned_png()
    files = [("file", ("a.png", data, "image/png")), ("file", ("b.png", b"garbage", "image/png"))]
    async with serving(settings, tiny_model) as client:
        capped = (await classify(client, data, top_k=1000, rollout="none")).json()
        exact = (await classify(client, data, top_k=3, rollout="none")).json()
        unsent = (await classify(client, data, rollout="none")).json()
        batch = (await client.post("/v1/classify/batch", params={"top_k": 4, "rollout": "none"}, files=files)).json()
        too_many = [await classify(client, data, top_k=k) for k in (1001, 10**30)]
        batch_too_many = await client.post("/v1/classify/batch", params={"top_k": 1001}, files=files[:1])
    assert capped["warnings"] == ["top_k=1000 is more than the model's 3 classes: all 3 are returned"]
    assert capped["predictions"] == exact["predictions"] == unsent["predictions"] and len(exact["predictions"]) == 3
    assert "warnings" not in exact and "warnings" not in unsent
    assert batch["results"][0]["warnings"] == ["top_k=4 is more than the model's 3 classes: all 3 are returned"]
    assert batch["results"][1] == {"error": {"code": "invalid_image", "message": "not a recognisable image"}}
    for response in (*too_many, batch_too_many):  # the limit is a 422 in /v1's error shape, before any work
        assert_error(response, 422, "invalid_parameter")
        assert "query.top_k" in response.json()["error"]["message"]


async def test_the_openapi_document_describes_the_top_k_warning(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        spec = (await client.get("/openapi.json")).json()
    classify = spec["paths"]["/v1/classify"]["post"]
    answer = classify["responses"]["200"]["content"]["application/json"]["schema"]
    assert "warnings" in answer["properties"] and "warnings" not in answer["required"]
    assert "top_k=1000 is more than the model's 10 classes" in answer["properties"]["warnings"]["description"]
    top_k = next(p for p in classify["parameters"] if p["name"] == "top_k")
    assert "`warnings` says so" in top_k["description"] and top_k["schema"]["maximum"] == 1000


@pytest.mark.parametrize("params", [{"top_k": 0}, {"top_k": "three"}, {"rollout": "svg"}, {"resize": "stretch"}])
async def test_invalid_parameters_are_422(settings, tiny_model, params):
    async with serving(settings, tiny_model) as client:
        assert_error(await classify(client, image_bytes("PNG"), **params), 422, "invalid_parameter")


@pytest.mark.parametrize("data, content_type, status, code", [
    (b"\x00\x01garbage bytes, not an image" * 10, "image/jpeg", 400, "invalid_image"),
    (image_bytes("JPEG", size=(64, 64))[:300], "image/jpeg", 400, "invalid_image"),
    (b"", "image/png", 400, "invalid_image"),
    (png_declaring(100_000, 100_000), "image/png", 413, "image_too_large"),
    (b"hello, world", "text/plain", 415, "unsupported_media_type"),
    (image_bytes("PNG"), "", 415, "unsupported_media_type"),
    (image_bytes("ICO", size=(16, 16)), "image/png", 415, "unsupported_media_type"),
])
async def test_bad_inputs_get_their_status_code(settings, tiny_model, data, content_type, status, code):
    async with serving(settings, tiny_model) as client:
        assert_error(await classify(client, data, content_type), status, code)


async def test_byte_limits_are_413(tiny_onnx, tiny_model):
    big = patterned_png((200, 200))
    async with serving(settings_for(tiny_onnx, max_upload_bytes=len(big) - 1, max_batch_files=2), tiny_model) as client:
        assert_error(await classify(client, big), 413, "payload_too_large")
        assert_error(await client.post("/v1/classify", files={"file": ("a.png", big, "image/png")}), 413,
                     "payload_too_large")
        too_many = [("file", (f"{i}.png", image_bytes("PNG"), "image/png")) for i in range(3)]
        assert_error(await client.post("/v1/classify/batch", files=too_many), 413, "payload_too_large")


async def test_multipart_errors(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        assert_error(await client.post("/v1/classify", files={"image": ("a.png", image_bytes("PNG"), "image/png")}),
                     422, "invalid_parameter")
        assert_error(await client.post("/v1/classify", files={"file": ("a.txt", b"hello", "text/plain")}), 415,
                     "unsupported_media_type")


async def test_batch_endpoint_answers_each_file_in_order(settings, tiny_model):
    files = [("file", ("a.png", patterned_png(), "image/png")), ("file", ("b.jpg", b"garbage", "image/jpeg")),
             ("file", ("c.gif", image_bytes("GIF"), "application/octet-stream"))]
    async with serving(settings, tiny_model) as client:
        response = await client.post("/v1/classify/batch", params={"top_k": 2, "rollout": "none"}, files=files)
        single = (await classify(client, patterned_png(), top_k=2, rollout="none")).json()
        assert_error(await client.post("/v1/classify/batch", content=b"x", headers={"content-type": "text/plain"}),
                     415, "unsupported_media_type")
    assert response.status_code == 200
    results = response.json()["results"]
    assert response.json()["model"] == {"name": "tiny-vit", "version": "7"}
    assert len(results) == 3 and results[0]["predictions"] == single["predictions"]
    assert results[1] == {"error": {"code": "invalid_image", "message": "not a recognisable image"}}
    assert len(results[2]["predictions"]) == 2 and results[2]["rollout"] is None


async def test_concurrent_requests_are_batched_within_the_maximum(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, max_batch_size=4, max_queue_delay_ms=300, dispatch_when_idle=False,
                            max_batches_in_flight=1)
    async with serving(settings, model) as client:
        model.batch_sizes.clear()
        model.hold()  # the first batch (whatever arrived within the delay) waits in the model...
        requests = [asyncio.ensure_future(classify(client, image_bytes("PNG"))) for _ in range(10)]
        queue = only_batcher(client.app)
        await until(lambda: len(model.entered) == 1 and model.entered[0] + queue.queued == 10,
                    "the first batch running and the other requests queued")
        model.release()  # ...so at least four are queued behind it, however slowly they were decoded
        responses = await asyncio.gather(*requests)
    assert [r.status_code for r in responses] == [200] * 10
    assert sum(model.batch_sizes) == 10 and max(model.batch_sizes) == 4 and min(model.batch_sizes) >= 1
    assert {r.json()["timing_ms"]["queue"] > 0 for r in responses} == {True}


async def test_queue_full_is_429_with_retry_after(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, max_batch_size=1, max_queue_size=1, max_batches_in_flight=1,
                            max_queue_delay_ms=0, retry_after_s=2, request_timeout_ms=PATIENCE_S * 1000)
    async with serving(settings, model) as client:
        batcher = only_batcher(client.app)
        model.hold()
        running = asyncio.ensure_future(classify(client, image_bytes("PNG")))
        await until(lambda: model.entered == [1], "one request in the model")
        queued = asyncio.ensure_future(classify(client, image_bytes("PNG")))
        await until(lambda: batcher.queued == 1, "one request queued behind it")
        turned_away = await asyncio.gather(*(classify(client, image_bytes("PNG")) for _ in range(3)))  # full: at once
        model.release()
        responses = [await running, await queued, *turned_away]
    statuses = [r.status_code for r in responses]
    assert statuses == [200, 200, 429, 429, 429]
    rejected = next(r for r in responses if r.status_code == 429)
    assert rejected.headers["retry-after"] == "2"
    assert_error(rejected, 429, "queue_full")


@pytest.mark.slow
async def test_deadline_is_504_and_the_late_request_never_runs(tiny_onnx, tiny_model):
    """The deadline covers the whole request: the late request expires queued behind a batch held in the model
    and never runs; the held one is answered 504 at its own deadline, while the model still holds it."""
    model = WrappedModel(tiny_model)
    # An idle model takes the first request within one event-loop turn; 2 s is room for a loaded machine.
    first_deadline_s = 2.0
    settings = settings_for(tiny_onnx, max_batch_size=1, max_batches_in_flight=1, max_queue_delay_ms=0,
                            request_timeout_ms=first_deadline_s * 1000)
    async with serving(settings, model) as client:
        model.batch_sizes.clear()
        model.hold()
        first = asyncio.ensure_future(classify(client, image_bytes("PNG")))
        await until(lambda: model.entered == [1], "the first request in the model")
        client.app.state.service.settings.request_timeout_ms = 200  # each submit reads it: the late one's
        late = await classify(client, image_bytes("PNG"))  # queued behind the held batch until it expires
        assert_error(await first, 504, "deadline_exceeded")  # answered while its batch is still held
        model.release()
    assert_error(late, 504, "deadline_exceeded")
    assert model.batch_sizes == [1]  # checked after shutdown, which runs everything still queued


async def test_a_failed_batch_fails_only_itself(settings, tiny_model):
    model = WrappedModel(tiny_model)
    async with serving(settings, model) as client:
        model.fail_next = 1
        assert_error(await classify(client, image_bytes("PNG")), 500, "inference_failed")
        assert (await classify(client, image_bytes("PNG"))).status_code == 200


async def test_not_ready_until_warm_up_finishes(settings, tiny_model):
    model = WrappedModel(tiny_model)
    model.hold()  # warm-up waits in the model
    async with serving(settings, model, wait_ready=False) as client:
        assert (await client.get("/v2/health/live")).json() == {"live": True}
        assert_error(await client.get("/v2/health/ready"), 503, "not_ready")
        assert_error(await classify(client, image_bytes("PNG")), 503, "not_ready")
        model.release()
        await until(lambda: client.app.state.service.ready, "warm-up finished")
        assert (await client.get("/v2/health/ready")).json() == {"ready": True}
        assert (await classify(client, image_bytes("PNG"))).status_code == 200


async def test_model_card(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        card = (await client.get("/v1/model")).json()
    assert card["name"] == "tiny-vit" and card["version"] == "7" and card["labels"] == ["cat", "dog", "bird"]
    assert (card["image_height"], card["image_width"], card["patch_size"], card["channels"]) == (32, 32, 8, 3)
    assert card["mean"] == [0.5] * 3 and card["std"] == [0.25] * 3 and card["precision"] == "fp32"
    assert card["provider"] == "CPUExecutionProvider" and isinstance(card["opset"], int) and card["opset"] >= 17
    assert card["test_accuracy"] == 0.5 and len(card["weights_sha256"]) == 64 and card["max_batch_size"] == 4


async def test_open_inference_protocol(settings, tiny_model):
    pixels = np.random.default_rng(0).normal(size=(2, 3, 32, 48)).astype(np.float32)
    logits, rollout, *_ = tiny_model.run(pixels)
    request = {"id": "r1", "inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                                       "data": pixels.ravel().tolist()}]}
    async with serving(settings, tiny_model) as client:
        metadata = (await client.get("/v2/models/tiny-vit")).json()
        assert (await client.get("/v2/models/tiny-vit/ready")).json() == {"name": "tiny-vit", "ready": True}
        answer = (await client.post("/v2/models/tiny-vit/infer", json=request)).json()
        only_logits = (await client.post("/v2/models/tiny-vit/infer",
                                         json={**request, "outputs": [{"name": "logits"}]})).json()
        assert_error(await client.get("/v2/models/other"), 404, "model_not_found")
        assert_error(await client.post("/v2/models/other/infer", json=request), 404, "model_not_found")
        for bad in ({"datatype": "INT8"}, {"shape": [2, 3, 32, 40]}, {"shape": [2, 1, 32, 48]},
                    {"name": "image"}, {"data": pixels.ravel().tolist()[:-1]}):
            tensor = {**request["inputs"][0], **bad}
            assert_error(await client.post("/v2/models/tiny-vit/infer", json={"inputs": [tensor]}), 400,
                         "invalid_parameter")
        assert_error(await client.post("/v2/models/tiny-vit/infer", json={"inputs": "nope"}), 400,
                     "invalid_parameter")
    assert metadata["name"] == "tiny-vit" and metadata["versions"] == ["7"]
    assert metadata["inputs"] == [{"name": "pixel_values", "datatype": "FP32", "shape": [-1, 3, -1, -1]},
                                  {"name": "image", "datatype": "BYTES", "shape": [-1, 1]}]
    assert [o["name"] for o in metadata["outputs"]] == ["logits", "rollout", "relevance", "embedding"]
    assert answer["model_name"] == "tiny-vit" and answer["id"] == "r1"
    out = {o["name"]: o for o in answer["outputs"]}
    assert out["logits"]["shape"] == [2, 3] and out["rollout"]["shape"] == [2, 4, 6]
    np.testing.assert_allclose(out["logits"]["data"], logits.ravel(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out["rollout"]["data"], rollout.ravel(), rtol=1e-5, atol=1e-6)
    assert [o["name"] for o in only_logits["outputs"]] == ["logits"]


async def test_openapi_lists_every_status_code(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        spec = (await client.get("/openapi.json")).json()
        assert (await client.get("/docs")).status_code == 200
    codes = set(spec["paths"]["/v1/classify"]["post"]["responses"])
    assert {"200", "400", "413", "415", "422", "429", "500", "503", "504", "414", "431"} <= codes
    # the connection's own refusals (a request line or headers too large) are on every route
    assert all({"414", "431"} <= set(op["responses"]) for path in spec["paths"].values() for op in path.values()
               if "responses" in op and any(k.startswith("4") for k in op["responses"]))
    assert {"image/png", "multipart/form-data"} <= set(spec["paths"]["/v1/classify"]["post"]["requestBody"]["content"])
    infer = spec["paths"]["/v2/models/{name}/infer"]["post"]["responses"]
    assert {"200", "400", "404", "429", "503", "504"} <= set(infer) and "422" not in infer
    assert "503" in spec["paths"]["/v2/health/ready"]["get"]["responses"]


async def test_unknown_path_is_404_json(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        assert_error(await client.get("/v1/nothing"), 404, "not_found")
        assert_error(await client.get("/v2/nothing"), 404, "not_found")  # the protocol's shape under /v2
        assert_error(await client.post("/v2/health/live"), 405, "method_not_allowed")


async def test_health_routes_answer_head_and_every_model_route_answers_under_its_version(settings, tiny_model):
    model = WrappedModel(tiny_model)
    model.hold()  # warm-up waits in the model: not ready yet
    async with serving(settings, model, wait_ready=False) as client:
        for path in ("/v2/health/ready", "/v2/models/tiny-vit/ready", "/v2/models/tiny-vit/versions/7/ready"):
            not_ready = await client.head(path)
            assert (not_ready.status_code, not_ready.content) == (503, b"")
        model.release()
        await until(lambda: client.app.state.service.ready, "warm-up finished")
        for path in ("/v2/health/live", "/v2/health/ready", "/v2/models/tiny-vit/ready",
                     "/v2/models/tiny-vit/versions/7/ready"):
            answer = await client.head(path)
            assert (answer.status_code, answer.content) == (200, b""), path
        plain, versioned = [(await client.get(p)).json() for p in ("/v2/models/tiny-vit",
                                                                     "/v2/models/tiny-vit/versions/7")]
        assert plain == versioned and plain["versions"] == ["7"]
        for suffix in ("", "/ready", "/config", "/stats"):
            assert_error(await client.get(f"/v2/models/tiny-vit/versions/8{suffix}"), 404, "model_not_found")
        assert (await client.get("/v2/models/tiny-vit/versions/7/config")).json()["name"] == "tiny-vit"
        stats = (await client.get("/v2/models/tiny-vit/versions/7/stats")).json()["model_stats"]
        assert [(s["name"], s["version"]) for s in stats] == [("tiny-vit", "7")]
        assert (await client.get("/v2/models/stats")).json()["model_stats"][0]["name"] == "tiny-vit"


async def test_disconnected_client_work_is_cancelled():
    class GoneRequest:
        async def receive(self):
            return {"type": "http.disconnect"}

    started = asyncio.Event()
    cancelled = asyncio.Event()

    async def queued_work():
        started.set()
        try:
            await asyncio.sleep(10)  # long work: cancelled long before it ends
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with pytest.raises(ClientDisconnected):
        await run_as_call(GoneRequest(), queued_work(), Deadline.after(PATIENCE_S), StopSignal())
    assert started.is_set()
    await asyncio.wait_for(cancelled.wait(), PATIENCE_S)  # the work sees its cancellation on its next turn
    assert cancelled.is_set()


async def test_a_failing_shadow_offer_or_answer_reading_never_leaves_a_request_unanswered(settings, tiny_model,
                                                                                          monkeypatch):
    # LocalEngine's batch callback is a request's only answer (in an engine process, the one on which its
    # frontend frees the image's shared memory): an error after the batch ran must still answer it
    from vitserve.service.engine.local import LocalEngine
    from vitserve.service.engine.served_model import ServedModel

    def broken_offer(self, *args):
        raise RuntimeError("a shadow that cannot take the copy")

    monkeypatch.setattr(LocalEngine, "_offer_shadow", broken_offer)
    async with serving(settings, tiny_model) as client:
        assert (await classify(client, image_bytes("PNG"))).status_code == 200  # the answer, despite the shadow

        def unreadable(self, outcome):
            raise ValueError("an output the server cannot read")

        monkeypatch.setattr(ServedModel, "result_of", unreadable)
        answer = await asyncio.wait_for(classify(client, image_bytes("PNG")), PATIENCE_S)
        assert_error(answer, 500, "inference_failed")
