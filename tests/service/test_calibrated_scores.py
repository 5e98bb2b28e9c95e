"""A file with a temperature (export/calibration.py): /v1 answers softmax(logits / T), the relevance map's class
score too, and the card says so; /v2 keeps the raw logits, its classification extension included."""
from __future__ import annotations

import base64
import json

import numpy as np
import onnx
import pytest

from vitserve.artifact import ModelInfo
from service_fixtures import classify, patterned_png, serving, settings_for

pytestmark = pytest.mark.anyio

TEMPERATURE = 2.5
CALIBRATION = {"source": "a test", "temperature": TEMPERATURE, "fit_images": 500, "report_images": 500,
               "accuracy": 0.9, "ece_before": 0.08, "ece_after": 0.01, "nll_before": 0.4, "nll_after": 0.3}


@pytest.fixture(scope="module")
def calibrated_onnx(tiny_onnx, tmp_path_factory):
    proto = onnx.load(str(tiny_onnx))
    props = {p.key: p.value for p in proto.metadata_props}
    props.update({"vitserve.temperature": repr(TEMPERATURE), "vitserve.calibration": json.dumps(CALIBRATION)})
    onnx.helper.set_model_props(proto, props)
    out = tmp_path_factory.mktemp("calibrated") / "model.onnx"
    onnx.save(proto, str(out))
    return out


def softmax(logits, temperature=1.0):
    scaled = np.asarray(logits, np.float64) / temperature
    exp = np.exp(scaled - scaled.max())
    return exp / exp.sum()


async def test_v1_scores_are_calibrated_and_v2_logits_are_raw(calibrated_onnx):
    image = patterned_png()
    async with serving(settings_for(calibrated_onnx)) as client:
        classified = (await classify(client, image, top_k=3, rollout="none")).json()["predictions"]
        relevance = (await classify(client, image, top_k=1, map="relevance", target=2)).json()
        inputs = [{"name": "image", "datatype": "BYTES", "shape": [1], "data": [base64.b64encode(image).decode()]}]
        raw = (await client.post("/v2/models/tiny-vit/infer", json={"inputs": inputs,
                                                                    "outputs": [{"name": "logits"}]})).json()
        classes = (await client.post("/v2/models/tiny-vit/infer", json={
            "inputs": inputs, "outputs": [{"name": "logits", "parameters": {"classification": 3}}]})).json()
        card = (await client.get("/v1/model")).json()
    logits = np.array(raw["outputs"][0]["data"])
    expected = softmax(logits, TEMPERATURE)
    assert [p["index"] for p in classified] == list(np.argsort(-expected, kind="stable"))
    assert [p["score"] for p in classified] == pytest.approx([expected[p["index"]] for p in classified], abs=1e-6)
    assert relevance["relevance"]["target"]["score"] == pytest.approx(expected[2], abs=1e-6)
    assert not np.allclose(expected, softmax(logits), atol=1e-3)  # the temperature moved the scores
    # the classification extension reports the raw logits, as Triton's does
    values = [float(s.split(":")[0]) for s in classes["outputs"][0]["data"]]
    assert values == pytest.approx(sorted(logits, reverse=True), abs=1e-5)
    assert card["temperature"] == TEMPERATURE and card["calibration"] == CALIBRATION


async def test_an_uncalibrated_file_scores_plain_softmax_and_says_so(tiny_onnx):
    image = patterned_png()
    async with serving(settings_for(tiny_onnx)) as client:
        classified = (await classify(client, image, top_k=3, rollout="none")).json()["predictions"]
        body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                            "data": [base64.b64encode(image).decode()]}], "outputs": [{"name": "logits"}]}
        logits = np.array((await client.post("/v2/models/tiny-vit/infer", json=body)).json()["outputs"][0]["data"])
        card = (await client.get("/v1/model")).json()
    assert [p["score"] for p in classified] == pytest.approx(sorted(softmax(logits), reverse=True), abs=1e-6)
    assert (card["temperature"], card["calibration"]) == (1.0, None)
    assert ModelInfo.from_metadata({p.key: p.value for p in onnx.load(str(tiny_onnx)).metadata_props}).temperature == 1.0


CURVE = {"mean": 1.0, "std": 0.5, "low": -2.0, "high": 3.0, "coefficients": [0.4, 0.5, -0.1]}


@pytest.fixture(scope="module")
def curved_onnx(calibrated_onnx, tmp_path_factory):
    proto = onnx.load(str(calibrated_onnx))
    props = {p.key: p.value for p in proto.metadata_props}
    props["vitserve.temperature_by_entropy"] = json.dumps(CURVE)
    onnx.helper.set_model_props(proto, props)
    out = tmp_path_factory.mktemp("curved") / "model.onnx"
    onnx.save(proto, str(out))
    return out


def curve_temperature(logits):
    p = softmax(logits)
    u = np.clip((-(p * np.log(p)).sum() - CURVE["mean"]) / CURVE["std"], CURVE["low"], CURVE["high"])
    c0, c1, c2 = CURVE["coefficients"]
    return float(np.exp(c0 + c1 * u + c2 * u * u))


async def test_a_file_with_a_curve_scores_each_answer_at_its_own_temperature(curved_onnx):
    images = [patterned_png(size) for size in ((48, 40), (32, 32), (64, 48))]
    answers = []
    async with serving(settings_for(curved_onnx)) as client:
        for image in images:
            classified = (await classify(client, image, top_k=3, rollout="none")).json()["predictions"]
            relevance = (await classify(client, image, top_k=1, map="relevance", target=1)).json()
            body = {"inputs": [{"name": "image", "datatype": "BYTES", "shape": [1],
                                "data": [base64.b64encode(image).decode()]}], "outputs": [{"name": "logits"}]}
            raw = (await client.post("/v2/models/tiny-vit/infer", json=body)).json()
            answers.append((classified, relevance, np.array(raw["outputs"][0]["data"])))
        card = (await client.get("/v1/model")).json()
    temperatures = []
    for classified, relevance, logits in answers:
        temperature = curve_temperature(logits)
        temperatures.append(temperature)
        expected = softmax(logits, temperature)
        assert [p["index"] for p in classified] == list(np.argsort(-expected, kind="stable"))[:3]
        assert [p["score"] for p in classified] == pytest.approx([expected[p["index"]] for p in classified], abs=1e-6)
        assert relevance["relevance"]["target"]["score"] == pytest.approx(expected[1], abs=1e-6)
        assert not np.allclose(expected, softmax(logits, TEMPERATURE), atol=1e-4)  # the curve, not the one T
    assert card["temperature_by_entropy"] == CURVE and card["temperature"] == TEMPERATURE
