"""The lone-request path (service/engine/lone_path.py): behind an engine process, a worker runs a request that is alone
on its own session of the same plan, and every other request in the engine; both answer the same image with the same
bits."""
from __future__ import annotations

import concurrent.futures

import httpx
import numpy as np
import pytest

from service_fixtures import scrape, uvicorn_server, value

pytestmark = pytest.mark.slow  # a uvicorn server with engine processes

LONE = ("--engine", "process", "--lone-request-path", "true")


def probe(channels: int, height: int, width: int, seed: int) -> dict:
    pixels = np.random.default_rng(seed).normal(size=(1, channels, height, width)).astype(np.float32)
    return {"inputs": [{"name": "pixel_values", "shape": list(pixels.shape), "datatype": "FP32",
                        "data": pixels.ravel().tolist()}], "outputs": [{"name": "logits"}]}


def logits(base_url: str, body: dict) -> list[float]:
    reply = httpx.post(f"{base_url}/v2/models/tiny-vit/infer", json=body, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["outputs"][0]["data"]


def test_a_lone_request_runs_in_the_worker_and_answers_as_the_engine_does(tiny_onnx):
    with uvicorn_server(tiny_onnx, *LONE) as (base_url, _):
        card = httpx.get(f"{base_url}/v1/model", timeout=30).json()
        bodies = [probe(card["channels"], card["image_height"], card["image_width"], seed) for seed in range(3)]
        alone = [logits(base_url, body) for body in bodies]  # one at a time: each alone in the worker
        lone_images = value(scrape(base_url), "vitserve_lone_path_images_total")
        assert lone_images >= 2, lone_images  # the first may come before the worker's session is warmed up
        # many at once: the worker has others in flight, so most go to the engine
        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            crowded = list(pool.map(lambda body: logits(base_url, body), bodies * 8))
        in_worker = value(scrape(base_url), "vitserve_lone_path_images_total") - lone_images
        assert in_worker < len(crowded) // 2, in_worker
    # the same bits, whichever path ran them
    assert all(answer == alone[i % 3] for i, answer in enumerate(crowded))
