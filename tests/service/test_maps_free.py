"""The maps-free graph (service/engine/attention_fusion.py) and the batches that run it: requests that ask for no map
get the answers the rollout graph gives, and every request that asks for a map still gets one."""
from __future__ import annotations

import base64
import logging
import time
from dataclasses import replace

import numpy as np
import onnx
import pytest

from service_fixtures import classify, patterned_png, samples, scrape, serving, settings_for, uvicorn_server, value

pytest.importorskip("onnxruntime")


def _fast_graph(path):
    from vitserve.service.engine.graph_paths import split_paths

    return split_paths(onnx.load(str(path))).fast


def _session(graph):
    import onnxruntime as ort

    return ort.InferenceSession(graph.SerializeToString(), providers=["CPUExecutionProvider"])


def test_every_block_attention_is_fused_and_answers_as_the_rollout_graph_at_any_size(tiny_onnx):
    from vitserve.onnx_header import read_model_info
    from vitserve.service.engine.attention_fusion import count_fused, maps_free

    info = read_model_info(tiny_onnx)
    fast = _fast_graph(tiny_onnx)
    lean = maps_free(fast, ("rollout",))
    assert count_fused(lean) == int(info.architecture["depth"]) > 0
    assert "rollout" not in [o.name for o in lean.graph.output]
    assert not any(n.op_type == "Softmax" for n in lean.graph.node)  # the long way is gone, not left beside it
    full, fused = _session(fast), _session(lean)
    names = [o.name for o in lean.graph.output]
    rng = np.random.default_rng(0)
    for shape in [(1, info.channels, *info.image_size), (3, info.channels, 48, 32), (2, info.channels, 16, 64)]:
        x = rng.standard_normal(shape).astype(np.float32)
        want = dict(zip([o.name for o in fast.graph.output], full.run(None, {"pixel_values": x})))
        for name, got in zip(names, fused.run(names, {"pixel_values": x})):
            np.testing.assert_allclose(got, want[name], rtol=1e-4, atol=1e-5)


def test_attention_whose_probabilities_are_read_elsewhere_is_left_unfused(tiny_onnx):
    """With the rollout kept, each block's probabilities feed the rollout too: fusing would lose them."""
    from vitserve.service.engine.attention_fusion import count_fused, fuse_attention

    fast = _fast_graph(tiny_onnx)
    assert count_fused(fuse_attention(fast)) == 0
    assert fuse_attention(fast) is fast


def test_a_block_that_differs_from_the_pattern_is_left_as_it_is(tiny_onnx):
    """A scale computed at run time instead of a constant: that block is not rewritten, and the graph still runs."""
    from vitserve.service.engine.attention_fusion import count_fused, fuse_attention
    from vitserve.service.engine.graph_paths import prune_outputs

    lean = prune_outputs(_fast_graph(tiny_onnx), {"rollout"})
    muls = [n for n in lean.graph.node if n.op_type == "Mul" and any(
        r.op_type == "MatMul" and r.input[0] == n.output[0] for r in lean.graph.node)]
    first = muls[0]
    computed = first.input[1] + "/computed"
    lean.graph.node.insert(list(lean.graph.node).index(first), onnx.helper.make_node(
        "Identity", [first.input[1]], [computed]))
    first.input[1] = computed
    fused = fuse_attention(lean)
    assert count_fused(fused) == len(muls) - 1
    x = np.random.default_rng(1).standard_normal((2, 3, 32, 32)).astype(np.float32)
    np.testing.assert_allclose(_session(fused).run(["logits"], {"pixel_values": x})[0],
                               _session(lean).run(["logits"], {"pixel_values": x})[0], rtol=1e-4, atol=1e-5)


def test_the_model_serves_the_maps_free_graph_where_the_setting_says(tiny_onnx):
    from vitserve.service.engine.onnx_runtime import OnnxModel

    assert OnnxModel.load(settings_for(tiny_onnx, maps_free="off")).capabilities.maps_free is None
    model = OnnxModel.load(settings_for(tiny_onnx, maps_free="on"))
    assert model.capabilities.maps_free is not None
    x = np.random.default_rng(2).standard_normal((3, model.info.channels, 40, 24)).astype(np.float32)
    with_maps, without = model.run(x), model.run_maps_free(x)
    assert len(with_maps) == len(without) and without[1].shape == (3, 0)  # the rollout's place kept, empty
    for index in [0, *range(2, len(without))]:
        np.testing.assert_allclose(without[index], with_maps[index], rtol=1e-4, atol=1e-5)


def test_a_maps_free_graph_that_answers_differently_is_not_served(tiny_onnx, monkeypatch, caplog):
    """The fused graph is checked against the rollout graph at load: one that disagrees (here, its head's weights
    negated) costs speed, never answers."""
    from vitserve.service.engine import onnx_runtime as runtime
    from vitserve.service.engine.attention_fusion import maps_free

    def broken(fast, drop):
        graph = maps_free(fast, drop)
        for tensor in graph.graph.initializer:
            if "head" in tensor.name and "weight" in tensor.name:
                values = -onnx.numpy_helper.to_array(tensor)
                tensor.CopyFrom(onnx.numpy_helper.from_array(values, tensor.name))
        return graph

    monkeypatch.setattr(runtime, "maps_free", broken)
    with caplog.at_level(logging.WARNING, logger="vitserve.runtime"):
        model = runtime.OnnxModel.load(settings_for(tiny_onnx, maps_free="on"))
    assert model.maps_free_path is None and model.capabilities.maps_free is None
    assert "answers differ" in caplog.text


class PathRecordingModel:
    """The real model, recording which graph ran each batch."""

    def __init__(self, model):
        self.inner, self.info, self.provider = model, model.info, model.provider
        self.paths: list[str] = []
        self.capabilities = replace(model.capabilities, maps_free=self.run_maps_free, wide=None)

    def run(self, pixel_values):
        self.paths.append("rollout")
        return self.inner.run(pixel_values)

    def run_maps_free(self, pixel_values):
        self.paths.append("maps-free")
        return self.inner.run_maps_free(pixel_values)

    def explain(self, pixel_values, targets):
        self.paths.append("relevance")
        return self.inner.explain(pixel_values, targets)


@pytest.mark.anyio
async def test_requests_without_maps_run_the_maps_free_graph_and_answer_as_the_rollout_graph(tiny_onnx):
    from vitserve.service.engine.runtime import load_model

    settings = settings_for(tiny_onnx, maps_free="on", warmup_batch_sizes=[])
    model = PathRecordingModel(load_model(settings))
    image = patterned_png((48, 40))
    async with serving(settings, model) as client:
        assert model.paths == ["rollout", "maps-free"] * 2  # warm-up: both graphs, at batch 1 and the largest
        model.paths.clear()
        with_map = (await classify(client, image, top_k=3, map="rollout")).json()
        assert model.paths == ["rollout"]
        without = (await classify(client, image, top_k=3, map="none")).json()
        assert model.paths[-1] == "maps-free" and without["rollout"] is None
        for got, want in zip(without["predictions"], with_map["predictions"]):
            assert got["label"] == want["label"] and got["score"] == pytest.approx(want["score"], abs=1e-5)
        explained = await classify(client, image, top_k=3, map="relevance")
        assert explained.status_code == 200 and model.paths[-1] == "relevance"

        embedded = await client.post("/v1/embed", content=image, headers={"content-type": "image/png"})
        assert embedded.status_code == 200, embedded.text
        assert model.paths[-1] == "maps-free"

        body = {"inputs": [{"name": "image", "shape": [1], "datatype": "BYTES",
                            "data": [base64.b64encode(image).decode()]}]}
        only_logits = await client.post("/v2/models/tiny-vit/infer", json={**body, "outputs": [{"name": "logits"}]})
        assert only_logits.status_code == 200, only_logits.text
        assert model.paths[-1] == "maps-free"
        assert [o["name"] for o in only_logits.json()["outputs"]] == ["logits"]
        every_output = await client.post("/v2/models/tiny-vit/infer", json=body)
        assert every_output.status_code == 200 and model.paths[-1] == "rollout"
        rollout = next(o for o in every_output.json()["outputs"] if o["name"] == "rollout")
        assert rollout["shape"][1:] != [0] and len(rollout["data"]) > 0
        metrics = samples((await client.get("/metrics")).text)
    assert value(metrics, "vitserve_maps_free_images_total") == 3  # map=none, embed, /v2 logits only


def test_the_maps_free_graph_in_captured_buckets_answers_as_its_dynamic_session(tiny_onnx):
    """The captured path's binding (service/engine/cuda_graphs.py) over the maps-free session, its buffers on the
    CPU: a short batch padded to its bucket, from float32 pixels and from uint8 ones normalised into the bucket's
    input, the rows as the dynamic session's, the rollout's place empty."""
    import onnxruntime as ort

    from vitserve.artifact import normalize_pixels
    from vitserve.service.engine.cuda_graphs import CapturedBucket, CudaGraphBuckets
    from vitserve.service.engine.pixels import DeviceNormaliser, PixelTable
    from vitserve.service.engine.onnx_runtime import OnnxModel

    model = OnnxModel.load(settings_for(tiny_onnx, maps_free="on"))
    lean, info = model.maps_free_path, model.info
    image = (info.channels, *info.image_size)
    raw = np.random.default_rng(6).integers(0, 256, (3, *image), dtype=np.uint8)
    floats = normalize_pixels(raw, info.mean, info.std)
    dynamic = model.run_maps_free(floats)
    probe = lean.run_dynamic(floats[:1])
    bucket = CapturedBucket(lean.session, "pixel_values", 4, (4, *image),
                            [(n, p.shape[1:], p.dtype.type) for n, p in zip(lean.names, probe)], 0, device="cpu")
    lean.captured = CudaGraphBuckets({4: bucket}, [4], image)
    table = PixelTable(info.mean, info.std).graph().SerializeToString()
    model.normaliser = DeviceNormaliser(ort.InferenceSession(table, providers=["CPUExecutionProvider"]), "cpu")
    for captured in (model.run_maps_free(floats), model.run_maps_free(raw)):
        assert len(captured) == len(dynamic) and captured[1].shape == (3, 0)
        for got, want in zip(captured, dynamic):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_maps_free_graph_that_cannot_be_made_costs_speed_not_the_model(tiny_onnx, monkeypatch, caplog):
    from vitserve.service.engine import onnx_runtime as runtime

    def failing(fast, drop):
        raise ValueError("a graph this rewrite did not expect")

    monkeypatch.setattr(runtime, "maps_free", failing)
    with caplog.at_level(logging.WARNING, logger="vitserve.runtime"):
        model = runtime.OnnxModel.load(settings_for(tiny_onnx, maps_free="on"))
    assert model.run_maps_free is None and "did not expect" in caplog.text
    assert model.run(np.zeros((1, model.info.channels, *model.info.image_size), np.float32))[0].shape[0] == 1


@pytest.mark.slow
def test_a_server_process_runs_requests_without_maps_on_the_maps_free_graph(tiny_onnx):
    """Through `vitserve serve` as users start it: the request's need crosses from the HTTP worker to the engine
    process (the engine's `Submit` message), and the maps-free graph's images are counted."""
    import httpx

    image = patterned_png((48, 40))
    with uvicorn_server(tiny_onnx, "--maps-free", "on") as (base_url, _):
        answers = {}
        for kind in ("rollout", "none", "none"):
            response = httpx.post(f"{base_url}/v1/classify", params={"map": kind, "top_k": 3}, content=image,
                                  headers={"content-type": "image/png"}, timeout=30)
            assert response.status_code == 200, response.text
            answers[kind] = response.json()
        metrics = scrape(base_url)
    assert value(metrics, "vitserve_maps_free_images_total") == 2
    assert answers["none"]["rollout"] is None and answers["rollout"]["rollout"] is not None
    labels = {kind: [p["label"] for p in answer["predictions"]] for kind, answer in answers.items()}
    assert labels["none"] == labels["rollout"]


def test_auto_serves_the_maps_free_graph_unless_a_record_measured_it_no_faster(tiny_onnx, monkeypatch):
    """Its gain on a CPU depends on the chip (10-15% on a Xeon with AVX-512, none on an EPYC with AVX2): a tuning
    record measures it once (service/engine/tuning.py); with no record `auto` serves it; nothing is timed at load."""
    from vitserve.service.engine import runtime, tuning

    monkeypatch.setattr(tuning, "maps_free_costs", lambda *args, **kwargs: pytest.fail("timed at load"))
    assert runtime.load_model(settings_for(tiny_onnx, maps_free="auto")).capabilities.maps_free is not None


@pytest.mark.parametrize("share, kept", [(0.5, True), (0.99, False)])
def test_a_record_keeps_the_maps_free_graph_only_where_it_measured_faster(tiny_onnx, monkeypatch, share, kept):
    from vitserve.service.engine import runtime, tuning

    monkeypatch.setattr(tuning, "others_busy_share", lambda: 0.0)
    monkeypatch.setattr(tuning, "maps_free_costs", lambda *args, **kwargs: (2.0, 2.0 * share))
    settings = settings_for(tiny_onnx, maps_free="auto")
    _, choice = tuning.tune(settings, "test")
    assert choice["maps_free"] is kept
    model = runtime.load_model(settings)
    assert model.capabilities.plan is not None and model.capabilities.plan.maps_free is kept
    assert (model.capabilities.maps_free is not None) is kept


def test_the_measurement_keeps_a_graph_at_most_its_share_of_the_rollout_graph_s_time(tiny_model):
    from vitserve.service.engine.tuning import MAPS_FREE_CPU_SHARE, maps_free_costs

    def costing(ms):
        def run(pixels):
            time.sleep(ms / 1000 * len(pixels))
            return ()
        return run
    info = tiny_model.info
    rollout, lean = maps_free_costs(costing(2.0), costing(1.0), info, max_batch=2, rounds=1)
    assert lean <= MAPS_FREE_CPU_SHARE * rollout
    rollout, lean = maps_free_costs(costing(2.0), costing(2.0 * MAPS_FREE_CPU_SHARE + 0.4), info, max_batch=2,
                                    rounds=1)
    assert lean > MAPS_FREE_CPU_SHARE * rollout


@pytest.mark.slow
def test_a_graph_whose_calls_are_long_is_timed_with_fewer_calls(tiny_model, monkeypatch):
    from vitserve.service.engine import tuning

    monkeypatch.setattr(tuning, "MAPS_FREE_ROUND_MS", 200.0)
    counted: dict[str, list[int]] = {"rollout": [], "maps-free": []}

    def costing(name, ms):
        def run(pixels):
            counted[name].append(len(pixels))
            time.sleep(ms / 1000 * len(pixels))
            return ()
        return run
    tuning.maps_free_costs(costing("rollout", 40.0), costing("maps-free", 1.0), tiny_model.info, max_batch=2,
                           rounds=2)
    # one uncounted call of each size, then each round's: 40 ms calls, as many as 200 ms holds (a sleep overshoots:
    # 4 or 5); 80 ms, the least (3); 1-2 ms, the most (7)
    per_round = (counted["rollout"].count(1) - 1) / 2
    assert per_round in (4, 5) and counted["rollout"].count(2) == 1 + 2 * 3
    assert counted["maps-free"].count(1) == counted["maps-free"].count(2) == 1 + 2 * 7


def test_openvino_serves_its_own_maps_free_graph_that_answers_as_the_rollout_graph(tiny_onnx):
    pytest.importorskip("openvino")
    from vitserve.service.engine.openvino_runtime import load_openvino_model

    model = load_openvino_model(settings_for(tiny_onnx, runtime="openvino", maps_free="on"))
    assert load_openvino_model(settings_for(tiny_onnx, runtime="openvino")).capabilities.maps_free is None  # off
    x = np.random.default_rng(4).standard_normal((3, model.info.channels, 16, 16)).astype(np.float32)
    with_maps, without = model.run(x), model.run_maps_free(x)
    assert len(with_maps) == len(without) and without[1].shape == (3, 0) and with_maps[1].shape[0] == 3
    for index in [0, *range(2, len(without))]:
        np.testing.assert_allclose(without[index], with_maps[index], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("runtime", ["onnxruntime", "openvino"])
def test_the_wide_copy_of_a_model_with_runners_keeps_the_graphs_the_model_kept_and_answers_as_it(tiny_onnx, runtime,
                                                                                                 monkeypatch):
    """Two runners on two cores: a thread each, and the model loaded once more with both for a lone image; that copy
    serves the maps-free graph where the model does (a lone `map=none` request keeps every core), and neither more
    copies nor other answers."""
    if runtime == "openvino":
        pytest.importorskip("openvino")
    from vitserve.service.engine.runtime import load_model

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    x = np.random.default_rng(5).standard_normal((2, 3, 32, 32)).astype(np.float32)
    for maps_free in ("on", "off"):
        model = load_model(settings_for(tiny_onnx, runtime=runtime, maps_free=maps_free, batch_runners=2,
                                        intra_op_threads=0))
        wide = model.capabilities.wide
        assert wide is not None and wide.capabilities.wide is None and wide.runtime == model.runtime
        assert (wide.capabilities.maps_free is not None) == (model.capabilities.maps_free is not None) == \
            (maps_free == "on")
        for ours, theirs in zip(wide.run(x), model.run(x)):
            np.testing.assert_array_equal(ours, theirs)
        if maps_free == "on":
            for ours, theirs in zip(wide.run_maps_free(x), model.run_maps_free(x)):
                np.testing.assert_array_equal(ours, theirs)
    assert load_model(settings_for(tiny_onnx, runtime=runtime, intra_op_threads=0)).capabilities.wide is None
