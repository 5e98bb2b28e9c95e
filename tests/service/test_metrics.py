"""Prometheus metrics: counts and sums match the requests sent (failures included), and with several
uvicorn workers (multiprocess mode) one scrape aggregates them all."""
from __future__ import annotations

import asyncio
import time

import httpx
import numpy as np
import pytest

from vitserve.service.ground.metrics import BATCH_SIZE_BUCKETS, LATENCY_BUCKETS, ServiceMetrics
from service_fixtures import (WrappedModel, image_bytes, patterned_png, samples, scrape, serving, settings_for,
                              uvicorn_server, value, wait_until)


@pytest.mark.anyio
async def test_counts_and_sums_match_the_requests_sent(tiny_onnx, tiny_model):
    model = WrappedModel(tiny_model)
    metrics = ServiceMetrics()
    pixels = np.zeros((2, 3, 32, 32), np.float32)
    infer = {"inputs": [{"name": "pixel_values", "shape": [2, 3, 32, 32], "datatype": "FP32",
                         "data": pixels.ravel().tolist()}]}
    async with serving(settings_for(tiny_onnx, max_queue_delay_ms=20), model, metrics=metrics) as client:
        started = time.perf_counter()
        ok = await asyncio.gather(*(client.post("/v1/classify", content=patterned_png(),
                                                headers={"content-type": "image/png"}) for _ in range(5)))
        bad = [await client.post("/v1/classify", content=b"garbage" * 9, headers={"content-type": "image/png"})
               for _ in range(2)]
        bad.append(await client.post("/v1/classify", content=b"hi", headers={"content-type": "text/plain"}))
        bad.append(await client.post("/v1/classify?top_k=0", content=image_bytes("PNG"),
                                     headers={"content-type": "image/png"}))
        batch = await client.post("/v1/classify/batch", files=[("file", ("a.png", image_bytes("PNG"), "image/png")),
                                                                ("file", ("b.png", b"junk", "image/png"))])
        v2 = await client.post("/v2/models/tiny-vit/infer", json=infer)
        model.fail_next = 1
        failed = await client.post("/v1/classify", content=image_bytes("PNG"), headers={"content-type": "image/png"})
        elapsed = time.perf_counter() - started
        text = (await client.get("/metrics")).text
    assert [r.status_code for r in ok] == [200] * 5 and [r.status_code for r in bad] == [400, 400, 415, 422]
    assert batch.status_code == 200 and v2.status_code == 200 and failed.status_code == 500
    m = samples(text)
    count = "vitserve_request_duration_seconds_count"
    assert value(m, count, endpoint="/v1/classify", status="200") == 5
    assert value(m, count, endpoint="/v1/classify", status="400") == 2
    assert value(m, count, endpoint="/v1/classify", status="415") == 1
    assert value(m, count, endpoint="/v1/classify", status="422") == 1
    assert value(m, count, endpoint="/v1/classify", status="500") == 1
    assert value(m, count, endpoint="/v1/classify/batch", status="200") == 1
    assert value(m, count, endpoint="/v2/models/{name}/infer", status="200") == 1
    duration_sum = value(m, "vitserve_request_duration_seconds_sum", endpoint="/v1/classify", status="200")
    served_ms = sum(r.json()["timing_ms"]["total"] for r in ok)
    assert served_ms / 1000 * 0.99 <= duration_sum <= 5 * elapsed  # the middleware wraps what the route timed
    images = 5 + 1 + 2 + 1  # classify, the batch's good file, the v2 tensor's two, the failed batch's one
    assert value(m, "vitserve_images_total") == images
    assert value(m, "vitserve_batch_size_sum") == images
    assert value(m, "vitserve_queue_wait_seconds_count") == images
    ort_calls = len(model.batch_sizes) - 1  # less the warm-up
    assert value(m, "vitserve_batch_size_count") == value(m, "vitserve_inference_seconds_count") == ort_calls
    # images prepared and answered: 5 + the batch's good one + the v2 tensor's two
    assert value(m, "vitserve_preprocess_seconds_count") == 8
    assert value(m, "vitserve_postprocess_seconds_count") == 8
    by_size = {dict(labels)["batch_size"]: v for (name, labels), v in m.items() if name == "vitserve_batches_total"}
    assert sum(by_size.values()) == ort_calls and sum(int(size) * n for size, n in by_size.items()) == images
    assert value(m, "vitserve_requests_rejected_total", reason="invalid_image") == 3
    assert value(m, "vitserve_requests_rejected_total", reason="unsupported_media_type") == 1
    assert value(m, "vitserve_requests_rejected_total", reason="invalid_parameter") == 1
    assert value(m, "vitserve_requests_rejected_total", reason="inference_failed") == 1
    assert value(m, "vitserve_queue_depth") == 0 and value(m, "vitserve_ready") == 1
    assert value(m, "vitserve_requests_in_flight") == 1  # the scrape itself
    info = [k for k in m if k[0] == "vitserve_model_info"]
    # a model handed over whole: no plan of its own
    assert info == [("vitserve_model_info", (("name", "tiny-vit"), ("opset", str(tiny_model.info.opset)),
                                             ("plan", "given"), ("plan_key", ""),
                                             ("provider", "CPUExecutionProvider"), ("version", "7")))]


def test_buckets_resolve_sub_millisecond_to_tens_of_seconds():
    assert LATENCY_BUCKETS[0] <= 0.0001 and LATENCY_BUCKETS[-1] >= 30
    assert sum(1 for b in LATENCY_BUCKETS if b <= 0.01) >= 6  # millisecond resolution where it matters
    assert list(LATENCY_BUCKETS) == sorted(LATENCY_BUCKETS)


@pytest.mark.slow
def test_multiprocess_mode_aggregates_two_workers(tiny_onnx, tmp_path):
    directory = tmp_path / "prometheus"
    directory.mkdir()
    (directory / "counter_999999.db").write_bytes(b"stale")  # a previous run's file: removed at start
    # Yielded once both workers are warmed up (their ready gauges say so), so that any worker may answer.
    with uvicorn_server(tiny_onnx, workers=2, env={"PROMETHEUS_MULTIPROC_DIR": str(directory)}) as (url, _):
        for _ in range(12):  # a new connection each: the kernel spreads them over the workers
            response = httpx.post(f"{url}/v1/classify", content=image_bytes("PNG"),
                                  headers={"content-type": "image/png"}, timeout=30)
            assert response.status_code == 200
        bad = httpx.post(f"{url}/v1/classify", content=b"nope", headers={"content-type": "image/png"}, timeout=30)
        assert bad.status_code == 400
        # A worker records a request's duration just after sending its answer, so the answer can reach us first.
        wait_until(lambda: _classify_counts(url) == (12, 1), "every request recorded")
        scrapes = [samples(httpx.get(f"{url}/metrics", timeout=30).text) for _ in range(4)]
    for m in scrapes:  # whichever worker answers, the totals are the same
        assert value(m, "vitserve_request_duration_seconds_count", endpoint="/v1/classify", status="200") == 12
        assert value(m, "vitserve_request_duration_seconds_count", endpoint="/v1/classify", status="400") == 1
        assert value(m, "vitserve_images_total") == 12 and value(m, "vitserve_batch_size_sum") == 12
        assert value(m, "vitserve_requests_rejected_total", reason="invalid_image") == 1
        assert value(m, "vitserve_ready") == 1
        assert value(m, "vitserve_http_workers") == 2 and value(m, "vitserve_http_workers_ready") == 2
        assert len([k for k in m if k[0] == "vitserve_model_info"]) == 1
    assert not (directory / "counter_999999.db").exists()


def _classify_counts(url: str) -> tuple[float, float]:
    """(200s, 400s) recorded for /v1/classify, summed over the workers."""
    m, count = scrape(url), "vitserve_request_duration_seconds_count"
    return (value(m, count, endpoint="/v1/classify", status="200"),
            value(m, count, endpoint="/v1/classify", status="400"))


class RecordingMirror:
    """A MetricMirror that keeps every update: (kind, name, value, tags)."""

    def __init__(self):
        self.updates: list[tuple] = []
        self.declared: dict[str, tuple] = {}

    def recorder(self, kind, name, documentation, labelnames, buckets):
        self.declared[name] = (kind, labelnames, buckets)
        return lambda value, tags: self.updates.append((kind, name, value, dict(tags)))


def test_every_histogram_has_positive_increasing_boundaries_as_rays_histograms_require():
    """service/ray_serve.py mirrors each metric into a Ray histogram, which refuses a boundary at or below zero:
    the replica would fail to start (a shadow's rank-correlation buckets once began at -0.5)."""
    mirror = RecordingMirror()
    ServiceMetrics(mirror=mirror)
    histograms = {name: buckets for name, (kind, _, buckets) in mirror.declared.items() if kind == "histogram"}
    assert "vitserve_shadow_map_rank_correlation" in histograms
    for name, buckets in histograms.items():
        assert all(b > 0 for b in buckets) and list(buckets) == sorted(set(buckets)), name


def test_a_mirror_gets_every_metric_with_its_labels_and_buckets_and_every_update():
    mirror = RecordingMirror()
    metrics = ServiceMetrics(mirror=mirror)
    plain = ServiceMetrics()
    assert set(mirror.declared) == {f.name for f in plain.registry.collect()}  # every one, by its base name
    assert mirror.declared["vitserve_request_duration_seconds"] == (
        "histogram", ("endpoint", "status", "model", "version", "protocol"), LATENCY_BUCKETS)
    assert mirror.declared["vitserve_batch_size"] == ("histogram", ("model", "version"), BATCH_SIZE_BUCKETS)
    assert mirror.declared["vitserve_images"] == ("counter", ("model", "version"), None)
    model = metrics.for_model("m", "1")
    mirror.updates.clear()
    metrics.request_started()
    metrics.request_started()
    metrics.request_done("/v1/classify", 200, 0.25, "m", "1")
    model.batch_done(3, 0.02, 0.0)  # stacking took no measurable time: a zero increment is not sent
    metrics.rejected_request("overloaded")
    m1 = {"model": "m", "version": "1"}
    assert mirror.updates == [
        ("gauge", "vitserve_requests_in_flight", 1.0, {}), ("gauge", "vitserve_requests_in_flight", 2.0, {}),
        ("gauge", "vitserve_requests_in_flight", 1.0, {}),  # a gauge hands over its value, not the change
        ("histogram", "vitserve_request_duration_seconds", 0.25, {"endpoint": "/v1/classify", "status": "200",
                                                                  **m1, "protocol": "http"}),
        ("histogram", "vitserve_inference_seconds", 0.02, m1), ("histogram", "vitserve_batch_size", 3, m1),
        ("counter", "vitserve_images", 3, m1), ("counter", "vitserve_batches", 1, {**m1, "batch_size": "3"}),
        ("counter", "vitserve_batch_seconds", 0.02, {**m1, "batch_size": "3"}),
        ("gauge", "vitserve_last_inference_timestamp_seconds", mirror.updates[9][2], m1),
        ("counter", "vitserve_requests_rejected", 1, {"reason": "overloaded"})]
    # the registry itself is unchanged by mirroring: the same exposition as an unmirrored one
    text = metrics.render()[0].decode()
    assert "vitserve_requests_in_flight 1.0" in text
    assert 'vitserve_images_total{model="m",version="1"} 3.0' in text
    # a retired version's series leave the registry (the mirror, Ray's, keeps its last values)
    metrics.retire("m", "1")
    assert 'version="1"' not in metrics.render()[0].decode()
    assert 'vitserve_requests_rejected_total{reason="overloaded"} 1.0' in text


def test_a_request_refused_from_its_request_line_is_rejected_and_a_429_never_in_flight():
    """The connection's refusals (service/http/connection.py) report as a refused request's own path does: a
    rejection by reason and an answer of 429 on its endpoint; its series made once, every refusal counted."""
    metrics = ServiceMetrics()
    for _ in range(3):
        metrics.refused_at_once("/v1/classify", "overloaded")
    metrics.refused_at_once("/v2/models/{name}/infer", "overloaded")
    m = samples(metrics.render()[0].decode())
    assert value(m, "vitserve_requests_rejected_total", reason="overloaded") == 4
    count = "vitserve_request_duration_seconds_count"
    assert value(m, count, endpoint="/v1/classify", status="429", model="", protocol="http") == 3
    assert value(m, count, endpoint="/v2/models/{name}/infer", status="429") == 1
    assert value(m, "vitserve_request_duration_seconds_sum", status="429") == 0.0
    assert value(m, "vitserve_requests_in_flight") == 0
