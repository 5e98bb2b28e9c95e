"""What a new runtime and a new output cost: a runtime is one `RuntimeSpec` registered in service/engine/runtime.py's
`RUNTIMES`, an output one `OptionalOutput` in vitserve/artifact.py's `OPTIONAL_OUTPUT_SPECS`. Here a runtime written
in numpy and an output it computes (each image's mean pixel) are added in those two places only, and served: chosen
by `--runtime`, run by the batcher, named in /v2's model configuration and metadata, and sent by /v2 inference, as
JSON and as binary, through the same code gRPC's ModelInfer encodes with (service/schemas/inference_protocol.py
`output_arrays`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from vitserve import artifact
from vitserve.service.engine import runtime
from vitserve.service.engine.inference_model import Capabilities, RuntimeSpec, read_model_file_info
from vitserve.service.ground.errors import ModelLoadError
from service_fixtures import serving, settings_for

pytestmark = pytest.mark.anyio
BRIGHTNESS = "brightness"
PIXELS = np.random.default_rng(5).normal(size=(3, 3, 16, 16)).astype(np.float32)  # the tiny model: 3 channels


class MeanPixelModel:
    """A runtime in numpy: logits from each channel's mean, a flat rollout, zeros for the file's optional outputs,
    and the new output."""

    runtime, precision_hint, provider = "numpy_mean", "auto", "CPUExecutionProvider"
    capabilities = Capabilities()  # float32 pixels, every batch with its maps, no wide copy

    def __init__(self, info: artifact.ModelInfo):
        self.info = info

    def run(self, pixels: np.ndarray) -> tuple[np.ndarray, ...]:
        batch, patch = len(pixels), self.info.patch_size
        means = pixels.mean(axis=(2, 3))  # (B, C)
        logits = np.resize(means, (batch, self.info.num_classes)).astype(np.float32)
        grid = np.full((batch, pixels.shape[2] // patch, pixels.shape[3] // patch), 0.5, np.float32)
        outputs = {BRIGHTNESS: pixels.mean(axis=(1, 2, 3)).astype(np.float32),
                   artifact.EMBEDDING_NAME: np.zeros((batch, self.info.embedding_size), np.float32),
                   artifact.OOD_SCORE_NAME: np.zeros(batch, np.float32)}
        return (logits, grid, *(outputs[name] for name in self.info.extra_outputs))

    def explain(self, pixels: np.ndarray, targets: np.ndarray) -> tuple[np.ndarray, ...]:
        raise ModelLoadError("no relevance path")


@pytest.fixture
def numpy_runtime_with_brightness(monkeypatch):
    spec = RuntimeSpec("numpy_mean", lambda settings, _: MeanPixelModel(read_model_file_info(Path(settings.model_path))))
    monkeypatch.setitem(runtime.RUNTIMES, spec.name, spec)  # the runtime's one registration
    brightness = artifact.OptionalOutput(BRIGHTNESS, lambda info: True, lambda info: [1])
    monkeypatch.setattr(artifact, "OPTIONAL_OUTPUT_SPECS", [*artifact.OPTIONAL_OUTPUT_SPECS, brightness])  # the output's


async def test_a_runtime_is_one_registration_and_an_output_one_declaration(tiny_onnx,
                                                                           numpy_runtime_with_brightness):
    async with serving(settings_for(tiny_onnx, runtime="numpy_mean")) as client:
        config = (await client.get("/v2/models/tiny-vit/config")).json()
        assert {"name": BRIGHTNESS, "data_type": "TYPE_FP32", "dims": [1]} in config["output"]
        metadata = (await client.get("/v2/models/tiny-vit")).json()
        assert {"name": BRIGHTNESS, "datatype": "FP32", "shape": [-1, 1]} in metadata["outputs"]
        tensor = {"name": "pixel_values", "shape": list(PIXELS.shape), "datatype": "FP32",
                  "data": PIXELS.ravel().tolist()}
        as_json = await client.post("/v2/models/tiny-vit/infer", content=json.dumps(
            {"inputs": [tensor], "outputs": [{"name": BRIGHTNESS}, {"name": "logits"}]}))
        assert as_json.status_code == 200, as_json.text
        brightness, logits = as_json.json()["outputs"]
        assert (brightness["name"], brightness["shape"]) == (BRIGHTNESS, [3])
        np.testing.assert_allclose(brightness["data"], PIXELS.mean(axis=(1, 2, 3)), rtol=1e-6)
        assert logits["data"][:3] == pytest.approx(PIXELS[0].mean(axis=(1, 2)).tolist(), rel=1e-6)
        as_binary = await client.post("/v2/models/tiny-vit/infer", content=json.dumps(
            {"inputs": [tensor], "outputs": [{"name": BRIGHTNESS, "parameters": {"binary_data": True}}]}))
        header_length = int(as_binary.headers["inference-header-content-length"])
        values = np.frombuffer(as_binary.content[header_length:], "<f4")
        np.testing.assert_allclose(values, PIXELS.mean(axis=(1, 2, 3)), rtol=1e-6)


@pytest.mark.slow
async def test_a_runtime_not_registered_stops_the_start_naming_those_there_are(tiny_onnx):
    with pytest.raises(ModelLoadError, match="no runtime 'tensorrt': this server has auto, onnxruntime, openvino"):
        async with serving(settings_for(tiny_onnx, runtime="tensorrt")):
            pass


async def test_an_output_not_declared_is_refused_by_name(tiny_onnx):
    async with serving(settings_for(tiny_onnx)) as client:
        tensor = {"name": "pixel_values", "shape": list(PIXELS.shape), "datatype": "FP32",
                  "data": PIXELS.ravel().tolist()}
        refused = await client.post("/v2/models/tiny-vit/infer", content=json.dumps(
            {"inputs": [tensor], "outputs": [{"name": BRIGHTNESS}]}))
        assert refused.status_code == 400
        assert "outputs.0.name" in refused.json()["error"] and "ood_score" in refused.json()["error"]
