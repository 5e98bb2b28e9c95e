"""The latency budget as the server measures it: with `server_timing`, each inference answer over HTTP carries a
W3C Server-Timing header, the call's stages in order and then `total`, from when the request came in."""
from __future__ import annotations

import json

import numpy as np
import pytest

from service_fixtures import classify, patterned_png, serving, settings_for

pytestmark = pytest.mark.anyio
IMAGE_STAGES = ["accept", "admit", "route", "body", "decode", "decode_wait", "queue", "inference", "engine_hop"]


def stages_of(header: str) -> list[tuple[str, float]]:
    """`name;dur=MS, ...` -> [(name, ms)] in order."""
    pairs = []
    for entry in header.split(","):
        name, _, duration = entry.strip().partition(";dur=")
        pairs.append((name, float(duration)))
    return pairs


def assert_a_budget(header: str, expected: list[str]) -> None:
    stages = stages_of(header)
    assert [name for name, _ in stages] == [*expected, "total"]
    assert all(ms >= 0 for _, ms in stages)
    # the stages are apart in time, within the request's: together they cannot be longer than it
    *parts, (_, total) = stages
    assert sum(ms for _, ms in parts) <= total + 0.01


async def test_a_classify_answer_tells_where_its_time_went(tiny_onnx):
    async with serving(settings_for(tiny_onnx, server_timing=True)) as client:
        response = await classify(client, patterned_png())
        assert response.status_code == 200
        assert_a_budget(response.headers["server-timing"], [*IMAGE_STAGES, "postprocess", "encode"])


async def test_an_open_inference_answer_tells_its_parse_and_encode_too(tiny_onnx):
    pixels = np.zeros((1, 3, 16, 16), np.float32)
    body = {"inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                        "data": pixels.ravel().tolist()}]}
    async with serving(settings_for(tiny_onnx, server_timing=True)) as client:
        response = await client.post("/v2/models/tiny-vit/infer", content=json.dumps(body))
        assert response.status_code == 200
        stages = ["accept", "admit", "route", "body", "parse", "queue", "inference", "engine_hop", "encode"]
        assert_a_budget(response.headers["server-timing"], stages)


async def test_without_the_setting_no_answer_carries_the_header(tiny_onnx):
    async with serving(settings_for(tiny_onnx)) as client:
        response = await classify(client, patterned_png())
        assert response.status_code == 200 and "server-timing" not in response.headers
