"""Shadow versions (service/engine/shadow.py): a model's config names a version that gets a copy of answered requests.

The figures are checked against an offline computation, with scipy's own Jensen-Shannon distance and Spearman
correlation, on the two files' ONNX Runtime outputs for the same pixels. Also: routing never sends the shadow an
unpinned request; a full queue drops copies without touching an answer; a copy the shadow cannot run is counted
as failed; promotion is a config change and a load; the report reaches a frontend in another process (the engine
process)."""
from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path

import httpx
import numpy as np
import pytest
from scipy.spatial.distance import jensenshannon
from scipy.stats import spearmanr

from vitserve.service.engine.onnx_runtime import OnnxModel
from vitserve.service.engine.shadow import Shadow, js_divergence, rank_correlation
from vitserve.service.ground.errors import VersionRetired
from vitserve.service.ground.metrics import ServiceMetrics
from vitserve.service.repository.layout import ModelConfig, ModelEntry, ShadowConfig, VersionFile
from service_fixtures import (PATIENCE_S, assert_error, samples, scrape, serving, settings_for, until,
                              uvicorn_server, value)

pytestmark = pytest.mark.anyio
ADMIN_KEY = "admin-key"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
IMAGES = 24


def make_repository(root: Path, versions: dict[int, Path], config: dict) -> Path:
    for version, model_file in versions.items():
        (root / "m" / str(version)).mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_file, root / "m" / str(version) / "model.onnx")
    (root / "m" / "config.json").write_text(json.dumps(config))
    return root


def pixel_batches(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 1, (IMAGES, 3, 32, 32)).astype(np.float32)


def infer_body(pixels: np.ndarray) -> dict:
    return {"inputs": [{"name": "pixel_values", "datatype": "FP32", "shape": [1, *pixels.shape],
                        "data": pixels.ravel().tolist()}]}


def offline_figures(primary: Path, shadow: Path, pixels: np.ndarray) -> dict:
    """The report's figures computed apart: each file alone in ONNX Runtime, scipy's formulas."""
    outputs = []
    for path in (primary, shadow):
        model = OnnxModel.load(settings_for(path))
        named = [dict(zip(model.info.output_names(), model.run(p[None]))) for p in pixels]
        outputs.append(([o["logits"][0] for o in named], [o["rollout"][0] for o in named], model.info.temperature))
    (logits_a, maps_a, t_a), (logits_b, maps_b, t_b) = outputs

    def probabilities(logits, t):
        e = np.exp(np.asarray(logits, np.float64) / t - np.max(np.asarray(logits, np.float64) / t))
        return e / e.sum()
    agreed = [np.argmax(a) == np.argmax(b) for a, b in zip(logits_a, logits_b)]
    divergences = [jensenshannon(probabilities(a, t_a), probabilities(b, t_b), base=2) ** 2
                   for a, b in zip(logits_a, logits_b)]
    correlations = [spearmanr(a.ravel(), b.ravel()).statistic for a, b in zip(maps_a, maps_b)]
    return {"top1_agreement": float(np.mean(agreed)), "mean_js_divergence": float(np.mean(divergences)),
            "mean_map_rank_correlation": float(np.mean(correlations))}


# --- the formulas ---


def test_the_divergence_and_the_rank_correlation_are_scipys():
    rng = np.random.default_rng(3)
    for _ in range(20):
        p, q = rng.dirichlet(np.ones(10)), rng.dirichlet(np.ones(10) * 0.3)
        assert js_divergence(p, q) == pytest.approx(jensenshannon(p, q, base=2) ** 2, abs=1e-12)
        a, b = rng.random((7, 7)), rng.random((7, 7))
        assert rank_correlation(a, b) == pytest.approx(spearmanr(a.ravel(), b.ravel()).statistic, abs=1e-12)
    assert js_divergence(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    assert js_divergence(np.array([0.3, 0.7]), np.array([0.3, 0.7])) == 0.0
    assert rank_correlation(np.ones((4, 4)), rng.random((4, 4))) is None  # a constant map has no ranking


# --- the config and which versions load ---


def entry(versions: list[int], **config) -> ModelEntry:
    return ModelEntry("m", ModelConfig.model_validate(config),
                      {str(v): VersionFile(str(v), Path(f"/r/m/{v}/model.onnx"), 1, 1) for v in versions})


def test_the_policy_picks_among_the_other_versions_and_the_shadow_loads_beside_them():
    plain = entry([1, 2, 3], shadow={"version": 3, "fraction": 0.1})
    assert plain.wanted() == ["3", "2"] and plain.serves() == ["2"]  # latest 1 of the others: 2
    assert entry([1, 2, 3], shadow={"version": 1}).serves() == ["3"]  # shadowing an older version works too
    assert entry([1, 2], shadow={"version": 5}).wanted() == ["2"]  # its folder is absent: nothing to shadow
    assert entry([1, 2]).wanted() == ["2"]
    for wrong in ({"version": 0}, {"version": 2, "fraction": 0}, {"version": 2, "fraction": 1.5},
                  {"version": 2, "max_queue_size": 0}, {"version": 2, "surprise": 1}):
        with pytest.raises(ValueError):
            ShadowConfig.model_validate(wrong)


async def test_a_model_whose_only_version_is_the_shadow_fails_its_load_by_saying_so(tmp_path, tiny_onnx):
    root = make_repository(tmp_path / "repo", {2: tiny_onnx}, {"shadow": {"version": 2}})
    settings = settings_for(tiny_onnx, model_repository=root, model_control_mode="explicit", admin_key=ADMIN_KEY)
    async with serving(settings) as client:
        answer = await client.post("/v2/repository/models/m/load", headers=ADMIN)
        assert answer.status_code == 400 and "only version is the shadow version 2" in answer.json()["error"]


# --- served ---


async def test_copies_are_compared_as_an_offline_run_computes_them(tmp_path, tiny_onnx, tiny_onnx_other):
    root = make_repository(tmp_path / "repo", {1: tiny_onnx, 2: tiny_onnx_other}, {"shadow": {"version": 2}})
    pixels = pixel_batches()
    async with serving(settings_for(tiny_onnx, model_repository=root)) as client:
        for image in pixels:
            answer = await client.post("/v2/models/m/infer", json=infer_body(image))
            assert answer.status_code == 200 and answer.json()["model_version"] == "1"  # never the shadow
        report = client.app.state.service.engine.registry.shadows["m"]

        await until(lambda: report.pairs["1"].compared == IMAGES, "every copy compared")
        got = (await client.get("/v1/models/m/shadow")).json()
        pair = got["pairs"][0]
        assert (got["model"], got["shadow_version"], got["fraction"]) == ("m", "2", 1.0)
        assert (pair["version"], pair["offered"], pair["compared"], pair["dropped"], pair["failed"]) == \
            ("1", IMAGES, IMAGES, 0, 0)
        expected = offline_figures(tiny_onnx, tiny_onnx_other, pixels)
        assert 0 < expected["top1_agreement"] < 1, "the two versions must disagree on some images to test this"
        for figure, number in expected.items():
            assert pair[figure] == pytest.approx(number, abs=1e-5), figure
        assert set(pair["shadow_latency_ms"]) == {"p50", "p90", "p99"}

        series = samples((await client.get("/metrics")).text)
        pair_labels = dict(model="m", version="1", shadow_version="2")
        assert value(series, "vitserve_shadow_copies_total", outcome="compared", **pair_labels) == IMAGES
        assert value(series, "vitserve_shadow_top1_agreements_total", **pair_labels) == \
            round(expected["top1_agreement"] * IMAGES)
        assert value(series, "vitserve_shadow_js_divergence_sum", **pair_labels) == \
            pytest.approx(expected["mean_js_divergence"] * IMAGES, abs=1e-4)
        assert value(series, "vitserve_shadow_map_rank_correlation_count", **pair_labels) == IMAGES
        assert value(series, "vitserve_shadow_latency_seconds_count", **pair_labels) == IMAGES

        # a client may still ask the shadow by name; its answer is not copied to itself
        pinned = await client.post("/v2/models/m/versions/2/infer", json=infer_body(pixels[0]))
        assert pinned.status_code == 200 and pinned.json()["model_version"] == "2"
        assert (await client.get("/v1/model", params={"model": "m"})).json()["version"] == "1"
        assert report.pairs.keys() == {"1"}


async def test_a_shadow_report_of_a_model_without_one_is_a_404(tmp_path, tiny_onnx):
    async with serving(settings_for(tiny_onnx)) as client:
        answer = await client.get("/v1/models/tiny-vit/shadow")
        assert_error(answer, 404, "shadow_not_configured")  # the model exists: what is missing is its shadow
        assert answer.json()["error"]["message"] == "model 'tiny-vit' has no shadow version (its config.json names none)"
        assert_error(await client.get("/v1/models/nope/shadow"), 404, "model_not_found")
        assert (await client.get("/v1/models/..%2Fetc/shadow")).status_code == 404  # no such route
        assert (await client.get("/v1/models/" + "x" * 65 + "/shadow")).status_code == 422


@pytest.mark.slow
async def test_promotion_is_a_config_change_and_a_load(tmp_path, tiny_onnx, tiny_onnx_other):
    root = make_repository(tmp_path / "repo", {1: tiny_onnx, 2: tiny_onnx_other}, {"shadow": {"version": 2}})
    settings = settings_for(tiny_onnx, model_repository=root, model_control_mode="explicit", load_models=["m"],
                            admin_key=ADMIN_KEY)
    async with serving(settings) as client:
        assert (await client.post("/v2/models/m/infer", json=infer_body(pixel_batches()[0]))).json()[
            "model_version"] == "1"
        (root / "m" / "config.json").write_text("{}")  # latest 1: version 2, no shadow
        assert (await client.post("/v2/repository/models/m/load", headers=ADMIN)).status_code == 200
        assert (await client.post("/v2/models/m/infer", json=infer_body(pixel_batches()[0]))).json()[
            "model_version"] == "2"
        assert_error(await client.get("/v1/models/m/shadow"), 404, "shadow_not_configured")
        index = (await client.post("/v2/repository/index", headers=ADMIN)).json()
        assert [(e["version"], e["state"]) for e in index] == [("2", "READY"), ("1", "UNAVAILABLE")]


# --- the queue and failures, on a Shadow alone ---


class _Served:
    """A shadow version that never finishes (its copies pile up) or is gone."""

    def __init__(self, info, gone: bool = False):
        self.info, self.gone = info, gone


def test_a_full_queue_drops_copies_and_the_fraction_samples(tiny_model):
    info = tiny_model.info
    outputs = tiny_model.run(np.zeros((1, 3, 32, 32), np.float32))
    one = tuple(o[0] for o in outputs)
    metrics = ServiceMetrics()

    async def offer_many(fraction: float, queue: int, count: int) -> Shadow:
        shadow = Shadow("m", ShadowConfig(version=2, fraction=fraction, max_queue_size=queue),
                        lambda name, version: _Served(info), metrics, batch_size=1, seed=7)
        for _ in range(count):  # no await between offers: the worker cannot take one off the queue meanwhile
            shadow.offer("1", np.zeros((3, 32, 32), np.float32), one, info)
        await shadow.close()
        return shadow

    full = asyncio.run(offer_many(1.0, 3, 10))
    assert (full.pairs["1"].offered, full.pairs["1"].dropped) == (10, 7)
    sampled = asyncio.run(offer_many(0.25, 1000, 400))
    assert 70 <= sampled.pairs["1"].offered <= 130  # a quarter of 400, give or take a seeded draw
    assert sampled.pairs["1"].dropped == 0
    rendered = metrics.render()[0].decode()
    assert 'vitserve_shadow_copies_total{model="m",outcome="dropped",shadow_version="2",version="1"} 7.0' in \
        rendered


async def test_a_copy_the_shadow_cannot_run_is_counted_as_failed(tiny_model):
    info = tiny_model.info

    def gone(name, version):
        raise VersionRetired("model 'm' version 2 is no longer served")
    shadow = Shadow("m", ShadowConfig(version=2), gone, ServiceMetrics(), batch_size=2, seed=0)
    outputs = tuple(o[0] for o in tiny_model.run(np.zeros((1, 3, 32, 32), np.float32)))
    for _ in range(5):
        shadow.offer("1", np.zeros((3, 32, 32), np.float32), outputs, info)
    await until(lambda: shadow.pairs["1"].failed == 5, "five failed copies")
    assert shadow.report()["pairs"][0]["compared"] == 0
    await shadow.close()


async def test_copies_wait_while_a_served_version_is_busy(tiny_model):
    info, busy, asked = tiny_model.info, [True], []

    def lookup(name, version):
        asked.append(version)
        raise VersionRetired("gone")
    shadow = Shadow("m", ShadowConfig(version=2), lookup, ServiceMetrics(), batch_size=4, busy=lambda: busy[0])
    outputs = tuple(o[0] for o in tiny_model.run(np.zeros((1, 3, 32, 32), np.float32)))
    for _ in range(6):
        shadow.offer("1", np.zeros((3, 32, 32), np.float32), outputs, info)
    await asyncio.sleep(0.2)
    assert asked == [] and shadow.report()["queued"] == 5  # the worker holds one, waiting; none has run
    busy[0] = False
    await until(lambda: shadow.pairs["1"].failed == 6, "every copy tried once the model is idle")
    await shadow.close()


# --- a frontend in another process ---


@pytest.mark.slow
def test_the_report_and_the_series_cross_the_engine_process(tmp_path, tiny_onnx, tiny_onnx_other):
    root = make_repository(tmp_path / "repo", {1: tiny_onnx, 2: tiny_onnx_other},
                           {"shadow": {"version": 2, "fraction": 1.0}})
    with uvicorn_server(tiny_onnx, "--model-repository", str(root), "--engine", "process", workers=2) as (url, _):
        for image in pixel_batches()[:8]:
            answer = httpx.post(f"{url}/v2/models/m/infer", json=infer_body(image), timeout=PATIENCE_S)
            assert answer.status_code == 200 and answer.json()["model_version"] == "1"

        def compared() -> int:
            return httpx.get(f"{url}/v1/models/m/shadow", timeout=PATIENCE_S).json()["pairs"][0]["compared"]
        until_sync(lambda: compared() == 8, "8 copies compared")
        assert value(scrape(url), "vitserve_shadow_copies_total", outcome="compared", model="m") == 8
        assert httpx.get(f"{url}/v1/models/nope/shadow", timeout=PATIENCE_S).status_code == 404


def until_sync(condition, what: str) -> None:
    from service_fixtures import wait_until
    wait_until(condition, what)
