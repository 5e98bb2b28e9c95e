"""uint8 pixels normalised by the engine (service/engine/pixels.py): the same input to the model, bit for bit, as the
frontend's float32 normalisation, whichever side does it and whatever path the batch takes."""
from __future__ import annotations

import numpy as np
import pytest

from vitserve.service.engine.inference_model import Capabilities
from service_fixtures import classify, patterned_png, serving, settings_for

pytest.importorskip("onnxruntime")


@pytest.mark.parametrize("mean,std", [([0.2860], [0.3530]), ([0.485, 0.456, 0.406], [0.229, 0.224, 0.225]),
                                      ([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
def test_the_table_and_its_graph_normalise_every_value_as_the_reference_does(mean, std):
    import onnxruntime as ort

    from vitserve.artifact import normalize_pixels
    from vitserve.service.engine.pixels import RAW_INPUT, PixelTable

    every_value = np.arange(256, dtype=np.uint8)
    pixels = np.stack([np.roll(every_value, 17 * c) for c in range(len(mean))]).reshape(1, len(mean), 16, 16)
    pixels = np.concatenate([pixels, pixels[:, :, ::-1]])  # (2, C, 16, 16): each value in each channel
    reference = normalize_pixels(pixels, mean, std)
    table = PixelTable(mean, std)
    assert np.array_equal(table.host(pixels), reference)
    session = ort.InferenceSession(table.graph().SerializeToString(), providers=["CPUExecutionProvider"])
    (graph_out,) = session.run(None, {RAW_INPUT: pixels})
    assert graph_out.dtype == np.float32 and np.array_equal(graph_out, reference)


def test_a_models_table_is_made_once_and_no_caller_can_change_it_for_the_others():
    # every image's preprocessing asks for its model's table: made each time it was 0.7% of an HTTP worker's samples
    from vitserve.artifact import normalization_table
    from vitserve.service.usecases.preprocess import normalize_image

    table = normalization_table([0.5, 0.4, 0.3], [0.2, 0.2, 0.2])
    assert normalization_table([0.5, 0.4, 0.3], [0.2, 0.2, 0.2]) is table
    assert normalization_table([0.5, 0.4, 0.3], [0.2, 0.2, 0.25]) is not table
    with pytest.raises(ValueError):
        table[0, 0] = 1.0
    from PIL import Image
    image = Image.fromarray(np.arange(48, dtype=np.uint8).reshape(4, 4, 3))
    out = normalize_image(image, [0.5, 0.4, 0.3], [0.2, 0.2, 0.2])
    out[:] = 0  # the caller's own array, not a view of the table
    assert table[0, 0] != 0


def test_a_lookup_takes_only_indices_that_cannot_leave_its_table():
    # "clip" would silently answer the last value for an index past the table: only types that cannot get there
    from vitserve.artifact import lookup

    table = np.arange(256, dtype=np.float32) * 2
    pixels = np.array([[0, 7], [128, 255]], np.uint8)
    assert np.array_equal(lookup(table, pixels), pixels.astype(np.float32) * 2)
    out = np.zeros((2, 2), np.float32)
    assert lookup(table, pixels, out=out) is out and np.array_equal(out, pixels * 2.0)
    for wider in (np.uint16, np.int16, np.int64):
        with pytest.raises(ValueError, match="could leave a table of 256"):
            lookup(table, pixels.astype(wider))


def test_the_frontend_sends_raw_pixels_only_to_an_engine_that_normalises_them():
    from vitserve.service.engine.pixels import engine_normalises

    assert engine_normalises("auto", "CUDAExecutionProvider")
    assert engine_normalises("auto", "TensorrtExecutionProvider")
    assert not engine_normalises("auto", "CPUExecutionProvider")
    assert not engine_normalises("auto", "OpenVINO/CPU/bf16")
    assert not engine_normalises("auto", "unknown")  # an engine not heard from yet gets what every model takes
    assert not engine_normalises("float32", "CUDAExecutionProvider")
    assert engine_normalises("uint8", "CPUExecutionProvider")


def test_a_model_that_normalises_on_its_device_answers_raw_pixels_as_it_answers_normalised_ones(tiny_onnx):
    from vitserve.artifact import normalize_pixels
    from vitserve.service.engine.onnx_runtime import OnnxModel

    model = OnnxModel.load(settings_for(tiny_onnx, pixel_transport="uint8"))
    assert model.takes_raw_pixels
    info = model.info
    raw = np.random.default_rng(3).integers(0, 256, (5, info.channels, 48, 32), dtype=np.uint8)
    for from_raw, from_floats in zip(model.run(raw), model.run(normalize_pixels(raw, info.mean, info.std))):
        assert from_raw.dtype == from_floats.dtype and np.array_equal(from_raw, from_floats)


def test_a_model_without_a_normaliser_refuses_raw_pixels_rather_than_reading_them_as_values(tiny_onnx):
    from vitserve.service.engine.onnx_runtime import OnnxModel

    model = OnnxModel.load(settings_for(tiny_onnx, pixel_transport="auto"))  # on the CPU: float32 transport
    assert not model.takes_raw_pixels
    with pytest.raises(TypeError, match="float32"):
        model.run(np.zeros((1, model.info.channels, 32, 32), np.uint8))


class RecordingModel:
    """The real model, recording the dtype of each batch it is handed."""

    def __init__(self, model):
        self.inner, self.info, self.provider = model, model.info, model.provider
        self.capabilities = Capabilities(raw_pixels=model.capabilities.raw_pixels)
        self.dtypes: list[str] = []

    def run(self, pixel_values):
        self.dtypes.append(("run", pixel_values.dtype.name))
        return self.inner.run(pixel_values)

    def explain(self, pixel_values, targets):
        self.dtypes.append(("explain", pixel_values.dtype.name))
        return self.inner.explain(pixel_values, targets)


@pytest.mark.anyio
@pytest.mark.parametrize("engine_normalises", [True, False])
async def test_a_server_sending_raw_pixels_answers_as_one_sending_normalised_ones(tiny_onnx, engine_normalises):
    """uint8 transport through the server: the fast path (the model normalises) and the relevance path and a model
    that cannot (the engine normalises on the host) answer exactly as with float32 transport."""
    from vitserve.service.engine.runtime import load_model

    answers, dtypes = {}, {}
    for transport in ("float32", "uint8"):
        settings = settings_for(tiny_onnx, pixel_transport=transport)
        model = RecordingModel(load_model(settings))
        model.capabilities = Capabilities(raw_pixels=model.capabilities.raw_pixels and engine_normalises)
        async with serving(settings, model) as client:
            answers[transport] = [(await classify(client, patterned_png((48 + 16 * i, 40)), top_k=3,
                                                  map=kind)).json() for i in range(3) for kind in ("none", "relevance")]
        dtypes[transport] = set(model.dtypes)
        for answer in answers[transport]:
            answer.pop("timing_ms", None)
    # warm-up included: it runs what the frontends will send
    assert dtypes["float32"] == {("run", "float32"), ("explain", "float32")}
    assert dtypes["uint8"] == {("run", "uint8" if engine_normalises else "float32"), ("explain", "float32")}
    assert answers["uint8"] == answers["float32"]


def test_a_bucket_filled_on_its_device_from_raw_pixels_answers_as_one_given_normalised_pixels(tiny_onnx):
    """The captured path's binding (service/engine/cuda_graphs.py) with its buffers on the CPU: a short batch of
    uint8 pixels padded to the bucket, normalised straight into the bucket's input, its rows as the float path's."""
    import onnxruntime as ort

    from vitserve.artifact import normalize_pixels
    from vitserve.service.engine.cuda_graphs import CapturedBucket
    from vitserve.service.engine.pixels import DeviceNormaliser, PixelTable
    from vitserve.service.engine.onnx_runtime import OnnxModel

    model = OnnxModel.load(settings_for(tiny_onnx))
    info, names = model.info, model.info.output_names()
    shape = (4, info.channels, *info.image_size)
    raw = np.random.default_rng(5).integers(0, 256, (3, *shape[1:]), dtype=np.uint8)
    floats = normalize_pixels(raw, info.mean, info.std)
    probe = model.run(floats[:1])
    bucket = CapturedBucket(model.session, "pixel_values", 4, shape,
                            [(n, p.shape[1:], p.dtype.type) for n, p in zip(names, probe)], 0, device="cpu")
    table = PixelTable(info.mean, info.std).graph().SerializeToString()
    normaliser = DeviceNormaliser(ort.InferenceSession(table, providers=["CPUExecutionProvider"]), "cpu")
    for from_raw, from_floats, direct in zip(bucket.run(raw, normaliser.to_device), bucket.run(floats),
                                             model.run(floats)):
        assert len(from_raw) == 3 and np.array_equal(from_raw, from_floats)
        np.testing.assert_allclose(from_raw, direct, rtol=1e-5, atol=1e-6)  # padded rows change nothing


def test_the_normaliser_graph_is_written_for_older_runtimes_and_its_refusal_falls_back_to_the_host(
        tiny_onnx, monkeypatch, caplog):
    """onnx 1.23 writes IR 14 unless told; onnxruntime-gpu 1.31 takes up to 13 and refused the graph on the first GPU
    run, which stopped the model loading. Now the graph carries its opset's IR version, and a refusal costs speed,
    never the model."""
    from vitserve.service.engine import onnx_runtime as runtime
    from vitserve.service.engine.pixels import PixelTable

    assert PixelTable([0.5], [0.5]).graph().ir_version <= 9  # what onnxruntime 1.15 (2023) and later load

    original = PixelTable.graph

    def unloadable(table):
        model = original(table)
        model.ir_version = 99
        return model

    monkeypatch.setattr(runtime.PixelTable, "graph", unloadable)
    with caplog.at_level("WARNING", logger="vitserve.runtime"):
        model = runtime.OnnxModel.load(settings_for(tiny_onnx, pixel_transport="uint8"))
    assert not model.takes_raw_pixels
    assert any("normalised on the host" in r.getMessage() for r in caplog.records)
