"""Same input, same answer: an image's logits do not depend on which requests the batcher put beside it, for every
runtime and precision the server ships (ONNX Runtime fp32, int8 with its static scales, OpenVINO fp32, and bf16 on a
CPU that computes it; docs/architecture.md, "Batch invariance")."""
from __future__ import annotations

import asyncio
import os

import numpy as np
import pytest

from service_fixtures import WrappedModel, serving, settings_for

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def tiny_int8(tiny_checkpoint, tmp_path_factory):
    from vitserve.export.onnx_export import export_onnx

    out = tmp_path_factory.mktemp("int8") / "tiny-int8.onnx"
    export_onnx(tiny_checkpoint, out, precision="int8", verify=False, inspection_images=0)
    return out


def infer_request(pixels: np.ndarray) -> dict:
    return {"inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                        "data": pixels.ravel().tolist()}], "outputs": [{"name": "logits"}]}


async def logits_of(client, pixels: np.ndarray) -> np.ndarray:
    response = await client.post("/v2/models/tiny-vit/infer", json=infer_request(pixels))
    assert response.status_code == 200, response.text
    output = response.json()["outputs"][0]
    return np.asarray(output["data"], np.float32).reshape(output["shape"])


@pytest.mark.parametrize("precision", ["fp32", "int8", "openvino-fp32", "openvino-bf16", "fp32-two-runners",
                                       "fp32-two-runners-wide", "openvino-fp32-two-runners",
                                       "openvino-fp32-two-runners-wide", "openvino-bf16-two-runners-wide"])
async def test_an_image_answers_the_same_alone_and_among_concurrent_traffic(precision, tiny_onnx, tiny_int8,
                                                                            monkeypatch):
    """Two runners: batches on two threads at once, on one session (ONNX Runtime) or two streams (OpenVINO); with
    the cores shared out by the server (not one thread set), a lone image runs on the fast graph compiled again with
    every core's thread."""
    from vitserve.service.engine.runtime import load_model

    path = tiny_int8 if precision == "int8" else tiny_onnx
    runtime: dict = {"batch_runners": 2} if "-two-runners" in precision else {}
    wide = precision.endswith("-wide")
    if wide:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})  # a thread per runner, two for the wide
        runtime["intra_op_threads"] = 0
    precision = precision.removesuffix("-wide").removesuffix("-two-runners")
    if precision.startswith("openvino"):
        pytest.importorskip("openvino")
        from vitserve.service.engine import openvino_runtime

        hint = precision.split("-")[1]
        if hint == "bf16" and "BF16" not in openvino_runtime.cpu_capabilities():
            pytest.skip("this CPU has no bfloat16 arithmetic (AVX512-BF16 or AMX)")
        runtime.update(runtime="openvino", precision_hint=hint)
    settings = settings_for(path, max_batch_size=8, max_queue_delay_ms=20, **runtime)
    model = WrappedModel(load_model(settings))
    rng = np.random.default_rng(11)
    watched = rng.standard_normal((12, 3, 32, 32)).astype(np.float32)
    # neighbours of another range: a scale taken from the batch (dynamic int8) would follow them
    traffic = (8 * rng.standard_normal((36, 3, 32, 32))).astype(np.float32)
    async with serving(settings, model) as client:
        alone = [await logits_of(client, watched[i:i + 1]) for i in range(len(watched))]
        assert set(model.batch_sizes) == {1}
        assert model.wide_batches == ([1] * len(watched) if wide else [])
        model.batch_sizes.clear()
        order = rng.permutation(len(watched) + len(traffic))
        everything = np.concatenate([watched, traffic])
        answers = await asyncio.gather(*(logits_of(client, everything[i:i + 1]) for i in order))
    assert max(model.batch_sizes) > 1  # the images did share batches, with the traffic and each other
    mixed = {int(i): answer for i, answer in zip(order, answers)}
    for i in range(len(watched)):
        assert mixed[i].argmax() == alone[i].argmax()
        np.testing.assert_allclose(mixed[i], alone[i], rtol=1e-5, atol=1e-5)
