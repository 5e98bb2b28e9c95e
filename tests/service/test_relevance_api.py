"""The map a client chooses (map=rollout|relevance|none, map_format, target) on /v1 and the relevance output on
/v2: the answers are the model's own relevance path, relevance requests batch apart, and every mistake is a 4xx."""
from __future__ import annotations

import asyncio
import base64
import io

import numpy as np
import pytest
from PIL import Image

from vitserve.service.usecases.postprocess import scale_unit
from vitserve.service.usecases.preprocess import prepare_image
from service_fixtures import (only_batcher, WrappedModel, assert_error, classify, patterned_png, samples, serving, settings_for, until,
                              value)

pytestmark = pytest.mark.anyio
LABELS = ["cat", "dog", "bird"]  # tests/conftest.py's tiny model


@pytest.fixture
def settings(tiny_onnx):
    return settings_for(tiny_onnx)


@pytest.fixture(scope="module")
def fast_only_onnx(tiny_checkpoint, tmp_path_factory):
    """The tiny model exported without the relevance path."""
    from vitserve.export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("fast-only") / "tiny-fast.onnx"
    export_onnx(tiny_checkpoint, out, verify=False, relevance=False)
    return out


def expected_relevance(model, data: bytes, target: int) -> tuple[np.ndarray, np.ndarray]:
    """The model's own relevance path on the server's preprocessing: (logits (K,), relevance scaled to [0, 1])."""
    pixels = prepare_image(data, model.info, resize="fit", max_bytes=2**20, max_pixels=2**20, max_tokens=64).pixels[None]
    logits, _, relevance, *_ = model.explain(pixels, np.array([target]))
    return logits[0], scale_unit(relevance[0])


async def test_relevance_of_the_top1_by_default_and_of_a_named_class(settings, tiny_model):
    data = patterned_png((40, 40))
    async with serving(settings, tiny_model) as client:
        top1 = (await classify(client, data, map="relevance")).json()
        by_label = (await classify(client, data, map="relevance", target="bird")).json()
        by_index = (await classify(client, data, map="relevance", target="2")).json()
    logits, want = expected_relevance(tiny_model, data, -1)
    best = int(logits.argmax())
    assert top1["rollout"] is None and top1["predictions"][0]["index"] == best
    assert top1["relevance"]["target"] == {"index": best, "label": LABELS[best], "score": top1["predictions"][0]["score"]}
    np.testing.assert_allclose(top1["relevance"]["values"], want, atol=1e-5)
    _, bird = expected_relevance(tiny_model, data, 2)
    assert by_label["relevance"] == by_index["relevance"]
    assert by_label["relevance"]["target"]["label"] == "bird"
    np.testing.assert_allclose(by_label["relevance"]["values"], bird, atol=1e-5)
    assert by_label["predictions"] == top1["predictions"]  # the class explained does not change the answer


async def test_map_formats_none_and_the_older_rollout_parameter(settings, tiny_model):
    data = patterned_png((80, 40))
    async with serving(settings, tiny_model) as client:
        png = (await classify(client, data, map="relevance", map_format="png", target="cat")).json()
        overlay = (await classify(client, data, map="relevance", map_format="overlay")).json()
        none = (await classify(client, data, map="none")).json()
        old = (await classify(client, data, rollout="png")).json()
        new = (await classify(client, data, map="rollout", map_format="png")).json()
    for body in (png, overlay):
        image = Image.open(io.BytesIO(base64.b64decode(body["relevance"]["data"])))
        assert image.format == "PNG" and image.size == (80, 40) and body["relevance"]["media_type"] == "image/png"
    assert png["relevance"]["target"]["label"] == "cat"
    assert none["rollout"] is None and none["relevance"] is None and len(none["predictions"]) == 3
    assert old["rollout"] == new["rollout"] and old["relevance"] is None


@pytest.mark.parametrize("params, message", [
    ({"target": "dog"}, "needs map=relevance"),
    ({"map": "rollout", "target": "1"}, "needs map=relevance"),
    ({"map": "relevance", "target": "horse"}, "neither a class index"),
    ({"map": "relevance", "target": "3"}, "not a class index of this model"),
    ({"map": "relevance", "target": "-1"}, "neither a class index"),
    ({"map": "relevance", "target": "x" * 257}, "at most 256 characters"),
    ({"map": "gradcam"}, "'rollout', 'relevance' or 'none'"),
    ({"map": "relevance", "map_format": "svg"}, "'grid', 'png' or 'overlay'"),
    ({"rollout": "png", "map": "rollout"}, "older spelling"),
    ({"rollout": "grid", "map_format": "png"}, "older spelling"),
])
async def test_a_wrong_map_request_is_422_naming_it(settings, tiny_model, params, message):
    async with serving(settings, tiny_model) as client:
        response = await classify(client, patterned_png(), **params)
    assert_error(response, 422, "invalid_parameter")
    assert message in response.json()["error"]["message"]


async def test_a_parameter_given_twice_is_422(settings, tiny_model):
    async with serving(settings, tiny_model) as client:
        response = await client.post("/v1/classify?map=relevance&map=rollout", content=patterned_png(),
                                     headers={"content-type": "image/png"})
    assert_error(response, 422, "invalid_parameter")
    assert "given more than once: map" in response.json()["error"]["message"]


async def test_relevance_requests_batch_apart_within_their_own_limit(tiny_onnx, tiny_model):
    wrapped = WrappedModel(tiny_model)
    settings = settings_for(tiny_onnx, max_batch_size=8, max_relevance_batch_size=2, max_queue_delay_ms=50,
                            max_batches_in_flight=1)
    data = patterned_png()
    async with serving(settings, wrapped) as client:
        wrapped.hold()
        warm_up = len(wrapped.batch_sizes)
        first = asyncio.ensure_future(classify(client, data))  # holds the model while the others queue
        await until(lambda: len(wrapped.entered) == 1, "the first batch at the gate")
        requests = [classify(client, data, map="relevance", target=LABELS[i % 3]) for i in range(5)]
        requests += [classify(client, data) for _ in range(4)]
        pending = [asyncio.ensure_future(r) for r in requests]
        await until(lambda: only_batcher(client.app).queued == 9, "nine images queued")
        wrapped.release()
        answers = await asyncio.gather(first, *pending)
        metrics = samples((await client.get("/metrics")).text)
    assert all(a.status_code == 200 for a in answers)
    # The relevance path's calls are timed apart: the fast path's latency metric stays the fast path's.
    assert value(metrics, "vitserve_relevance_images_total") == 5
    assert value(metrics, "vitserve_relevance_inference_seconds_count") == 3
    assert value(metrics, "vitserve_inference_seconds_count") == 2  # the held one, the four (warm-up is not served)
    assert value(metrics, "vitserve_images_total") == 10
    assert sorted(wrapped.batch_sizes[warm_up:]) == [1, 1, 2, 2, 4]  # the held one; relevance 2+2+1; the fast four together
    assert sorted(t for call in wrapped.explained for t in call) == [0, 0, 1, 1, 2]
    assert all(len(call) <= 2 for call in wrapped.explained)
    assert all(a.json()["relevance"] is not None for a in answers[1:6])
    assert all(a.json()["relevance"] is None for a in answers[6:])


async def test_a_model_without_the_relevance_path(fast_only_onnx):
    from vitserve.service.engine.onnx_runtime import OnnxModel

    settings = settings_for(fast_only_onnx)
    async with serving(settings, OnnxModel.load(settings)) as client:
        fast = await classify(client, patterned_png())
        refused = await classify(client, patterned_png(), map="relevance")
        metadata = (await client.get("/v2/models/tiny-vit")).json()
        v2 = await client.post("/v2/models/tiny-vit/infer", json={
            "inputs": [{"name": "pixel_values", "shape": [1, 3, 32, 32], "datatype": "FP32", "data": [0.0] * 3072}],
            "outputs": [{"name": "relevance"}]})
    assert fast.status_code == 200 and fast.json()["rollout"] is not None
    assert_error(refused, 422, "invalid_parameter")
    assert "without the relevance path" in refused.json()["error"]["message"]
    assert [o["name"] for o in metadata["outputs"]] == ["logits", "rollout", "embedding"]
    assert_error(v2, 400, "invalid_parameter")


async def test_open_inference_relevance_output_matches_v1(settings, tiny_model):
    data = patterned_png((40, 40))
    request = {"inputs": [{"name": "image", "shape": [2], "datatype": "BYTES",
                           "data": [base64.b64encode(data).decode()] * 2}],
               "outputs": [{"name": "logits"}, {"name": "relevance"}], "parameters": {"target": "dog"}}
    async with serving(settings, tiny_model) as client:
        v2 = (await client.post("/v2/models/tiny-vit/infer", json=request)).json()
        default = (await client.post("/v2/models/tiny-vit/infer", json={"inputs": request["inputs"]})).json()
        v1 = (await classify(client, data, map="relevance", target="dog")).json()
    names = {o["name"]: o for o in v2["outputs"]}
    assert list(names) == ["logits", "relevance"] and names["relevance"]["shape"] == [2, 4, 4]
    raw = np.array(names["relevance"]["data"], np.float32).reshape(2, 4, 4)
    np.testing.assert_allclose(scale_unit(raw[1]), v1["relevance"]["values"], atol=1e-5)
    assert [o["name"] for o in default["outputs"]] == ["logits", "rollout"]  # relevance only when named
