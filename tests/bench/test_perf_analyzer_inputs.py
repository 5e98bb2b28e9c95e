"""The perf_analyzer input files hold what the server takes: normalised pixels of the model's shape, and each
image as a serialised one-element BYTES tensor."""
from __future__ import annotations

import base64
import io
import json

import numpy as np
from PIL import Image

from vitserve.bench.perf_analyzer_inputs import main
from vitserve.service.schemas.binary_tensors import unpack_bytes
from vitserve.service.engine.inference_model import read_model_file_info


def test_the_files_hold_the_models_tensor_and_serialised_images(tiny_onnx, tmp_path):
    assert main(["--model", str(tiny_onnx), "--out", str(tmp_path), "--count", "2"]) == 0
    info = read_model_file_info(tiny_onnx)
    pixels = json.loads((tmp_path / "pixels.json").read_text())["data"]
    images = json.loads((tmp_path / "image.json").read_text())["data"]
    assert len(pixels) == len(images) == 2
    for entry in pixels:
        tensor = entry["pixel_values"]
        assert tensor["shape"] == [info.channels, *info.image_size]
        values = np.array(tensor["content"])
        assert values.size == np.prod(tensor["shape"]) and np.abs(values).max() < 10
    first, second = (unpack_bytes(base64.b64decode(e["image"]["b64"]), 1, 10**6)[0] for e in images)
    assert first != second and all(e["image"]["shape"] == [1] for e in images)
    assert Image.open(io.BytesIO(first)).size == info.image_size[::-1]
